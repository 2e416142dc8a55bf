"""The JAX backend's finite check reads less without refusing other steps.

`stepfuse.jax._strict` says which inputs of an optimizer step a non-finite value cannot be
lost from; `stepfuse.jax._step.plan` uses it to leave a gradient unread where a new
parameter is strict in it, and on large models to check the persistent values (parameters
through ``p + u``, Adam's moments) at the end of a call instead of at every step, running
the call again with every step checked when they went non-finite. Checked here:

- every strictness claim, by putting NaN/inf into the claimed input of each optimizer of
  the catalogue (tests/helpers.py) and finding one in the output;
- a NaN/inf gradient entry (the loss finite), an update that overflows to inf from finite
  values, and an Adam moment that overflows, on a small and on a large model, for every
  optimizer of the catalogue: the fused call stops at the stepwise reference's step with
  the state, bit for bit, of a call of just the steps before it;
- notifications never go past the refused step; ``jax.jit`` and ``jax.vmap``; a state
  that starts with an inf entry; the compiled loop of a large Adam fit reads no
  parameter-sized value for its check.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CATALOGUES, slow_params

import stepfuse as sf
import stepfuse.jax as sfj
from stepfuse import Stop
from stepfuse.jax import _step
from stepfuse.jax._checks import Loss
from stepfuse.jax._probe import SMALL
from stepfuse.jax._strict import strict_inputs

RNG = np.random.default_rng(0)
SIZES = {"small": (6, 5), "large": (128, 132)}  # 660 and 16,896 parameters
STEPS = 12


@jax.custom_jvp
def kick(a: Any, s: Any) -> Any:
    """0, with the gradient ``s`` at ``a``'s first entry (elsewhere 0): a non-finite or
    huge gradient entry while the loss stays finite."""
    return jnp.zeros((), a.dtype)


@kick.defjvp
def _kick_jvp(primals: Any, tangents: Any) -> Any:
    a, s = primals
    da, _ = tangents
    return kick(a, s), da.reshape(-1)[0] * s


def loss_fn(p: Any, x: Any, t: Any, s: Any) -> Any:
    """A least-squares fit; ``s`` (per step): the kicks of ``w`` and ``b``."""
    return jnp.mean((x @ p["w"] + p["b"] * 0 - t) ** 2) + kick(p["w"], s[0]) + kick(p["b"], s[1])


def problem(size: str, b0: float = 0.0) -> tuple[dict, tuple]:
    n_in, n_out = SIZES[size]
    params = {
        "w": jnp.asarray(RNG.normal(size=(n_in, n_out)) * 0.1, jnp.float32),
        "b": jnp.zeros((n_out,), jnp.float32).at[0].set(b0),
    }
    x = jnp.asarray(RNG.normal(size=(16, n_in)), jnp.float32)
    t = jnp.asarray(RNG.normal(size=(16, n_out)), jnp.float32)
    return params, (x, t)


def kicks(k: int, w: float = 0.0, b: float = 0.0) -> sf.Batches:
    """The per-step kicks: none, but ``(w, b)`` at step ``k``."""
    s = np.zeros((STEPS, 2), np.float32)
    s[k] = (w, b)
    return sf.Batches(jnp.asarray(s))


def optimizer(name: str) -> optax.GradientTransformation:
    tx = CATALOGUES["jax"][name]()
    return tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx


# -- the analysis ---------------------------------------------------------------------------


def test_strictness_rules():
    def outs(fn, *args):
        return [sorted(s) for s in strict_inputs(fn, *args)]

    x, y = jnp.ones(3), jnp.ones(3)
    assert outs(lambda a, b: a * b + a - b, x, y) == [[0, 1]]  # inf * 0 and inf - inf: NaN
    assert outs(lambda a, b: a / b, x, y) == [[0]]  # 1 / inf == 0
    assert outs(lambda a: (jnp.exp(a), jnp.tanh(a), jnp.maximum(a, 0.0), jnp.sign(a)), x) == [
        [],
        [],
        [],
        [],
    ]
    assert outs(lambda a: (a[1:], jnp.where(a > 0, a, 0.0), jax.nn.relu(a)), x) == [[], [], []]
    assert outs(lambda a: (jnp.sum(a), jnp.sqrt(a), a**2, a**-1, jnp.cumsum(a)), x) == [
        [0],
        [0],
        [0],
        [],
        [0],
    ]
    assert outs(lambda a, b: (jnp.concatenate([a, b]), jnp.dot(a, b)), x, y) == [[0, 1], []]
    assert outs(jax.jit(lambda a: 2 * a), x) == [[0]]  # through a call
    assert outs(lambda a: (a.astype(jnp.bfloat16), a.astype(jnp.int32)), x) == [[0], []]
    assert outs(lambda a, n: (a * n, n + 1), x, jnp.int32(2)) == [[0], []]
    assert outs(lambda a: jnp.broadcast_to(a, (0, 3)), x) == [[]]  # nothing left to hold it


def _step_fn(name: str, size: str = "small") -> tuple[Any, tuple]:
    """The update `stepfuse.jax._step.plan` analyses, and arguments for it from a state
    two steps in."""
    tx = optimizer(name)
    params, (x, t) = problem(size)
    batch = (x, t, jnp.zeros(2, jnp.float32))
    loss = Loss(loss_fn, False, params, batch, False, None)
    apply = _step._apply(tx, loss, batch, None)
    opt_state = tx.init(params)
    for _ in range(2):
        value, grads = jax.value_and_grad(loss_fn)(params, *batch)
        params, opt_state = apply(value, grads, opt_state, params)
    value, grads = jax.value_and_grad(loss_fn)(params, *batch)
    return apply, (value, grads, opt_state, params)


def _bad(x: np.ndarray, value: float, at: int) -> np.ndarray:
    x = np.array(x, copy=True)
    x.reshape(-1)[at % max(x.size, 1)] = value
    return x


# L-BFGS compiles its line search (about 15 s each here): --runslow.
SAMPLED = slow_params(CATALOGUES["jax"], {"lbfgs"})


@pytest.mark.parametrize("name", SAMPLED)
def test_every_strictness_claim_holds_with_nan_and_inf_in_the_input(name):
    # Whatever the other inputs hold (the step's own values, zeros, or another NaN/inf),
    # a NaN/inf anywhere in an input an output is claimed strict in reaches that output.
    fn, args = _step_fn(name)
    flat, tree = jax.tree_util.tree_flatten(args)
    claims = strict_inputs(fn, *args)
    assert any(claims), "nothing proven: the analysis would save nothing"
    run = jax.jit(lambda *leaves: jax.tree_util.tree_leaves(fn(*tree.unflatten(leaves))))
    zeros = [
        np.zeros_like(np.asarray(a))
        if np.issubdtype(np.asarray(a).dtype, np.floating)
        else np.asarray(a)
        for a in flat
    ]
    for base in (list(map(np.asarray, flat)), zeros):
        for i in sorted(set().union(*claims)):
            for value in (np.nan, np.inf, -np.inf):
                for at in (0, 7):
                    leaves = list(base)
                    leaves[i] = _bad(leaves[i], value, at)
                    out = run(*leaves)
                    for o, claim in zip(out, claims):
                        if i in claim:
                            assert not np.all(np.isfinite(o)), (name, i, value, at)
                    # with a second input non-finite too
                    j = next((j for j in sorted(set().union(*claims)) if j != i), None)
                    if j is not None:
                        leaves[j] = _bad(leaves[j], -value, at + 1)
                        out = run(*leaves)
                        for o, claim in zip(out, claims):
                            if i in claim:
                                assert not np.all(np.isfinite(o)), (name, i, j, value)


def test_plans_of_common_optimizers():
    params, (x, t) = problem("large")
    batch = (x, t, jnp.zeros(2, jnp.float32))
    loss = Loss(loss_fn, False, params, batch, False, None)
    for name, lazy_state in (("adam", (False,) * 4), ("sgd", ()), ("sgd_momentum", (False,) * 2)):
        tx = optimizer(name)
        plan = _step.plan(tx, loss, params, tx.init(params), batch)
        assert plan.grads == (False, False), name  # the new parameters see them
        assert plan.lazy and plan.lazy_grads == (False, False), name
        assert plan.lazy_params == (False, False) and plan.lazy_state == lazy_state, name
    # clipping hides a gradient from the update (a select): read at every step
    tx = optimizer("sgd_clip_inf")
    plan = _step.plan(tx, loss, params, tx.init(params), batch)
    assert plan.grads == (True, True) and plan.lazy_grads == (True, True)
    small, (xs, ts) = problem("small")
    batch = (xs, ts, jnp.zeros(2, jnp.float32))
    tx = optimizer("adam")
    plan = _step.plan(
        tx, Loss(loss_fn, False, small, batch, False, None), small, tx.init(small), batch
    )
    assert not plan.lazy and plan.grads == (False, False)
    assert 2 * (6 * 5 + 5) <= SMALL < 2 * (128 * 132 + 132)  # the sizes span the threshold


# -- the loop -------------------------------------------------------------------------------


def leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]


def run_both(tx: Any, params: Any, batch: tuple, **kw: Any) -> Any:
    """The fused call and the stepwise reference on the same steps: the same trace, stop
    and state (float32 reduction order aside); after a refused update, the state of a
    call of just the steps before it, bit for bit, and finite."""
    fused = sfj.fuse(loss_fn, tx, steps=STEPS, **kw)
    ref = sfj.fuse(loss_fn, tx, steps=STEPS, mode="stepwise")
    state, trace = fused(fused.init(params), *batch)
    r_state, r_trace = ref(ref.init(params), *batch)
    assert (trace.steps, trace.stop) == (r_trace.steps, r_trace.stop)
    np.testing.assert_allclose(trace.loss, r_trace.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(leaves(state), leaves(r_state)):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-5, atol=1e-6)
    # finite, but for a state entry non-finite from the start (left so)
    for a, b in zip(leaves(state), leaves(fused.init(params))):
        assert a.dtype.kind != "f" or np.all(np.isfinite(a) | (a == b))
    if trace.stop is Stop.NONFINITE:
        again, e_trace = fused(fused.init(params), *batch, steps=max(trace.steps, 1))
        if trace.steps:
            for a, b in zip(leaves(state), leaves(again)):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(trace.loss[: trace.steps], e_trace.loss)
    return fused, state, trace


BAD = {
    # a NaN/inf gradient entry while the loss stays finite
    "nan_gradient": {"w": np.nan},
    "inf_gradient": {"w": -np.inf},
    # finite values that overflow: Adam's squared gradient; SGD's parameter 3.3e38 + 1.5e37
    "overflow": {"w": 3e37, "b": -3e38},
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("size", SIZES)
def test_a_bad_step_is_refused_where_the_stepwise_reference_refuses_it(size, case):
    for name in ("adam", "sgd"):
        params, (x, t) = problem(size, b0=3.3e38 if case == "overflow" else 0.0)
        fit, _, trace = run_both(optimizer(name), params, (x, t, kicks(6, **BAD[case])))
        assert trace.stop is Stop.NONFINITE and trace.steps == 6, (name, case)
        assert len(trace.loss) == 7 and np.all(np.isfinite(trace.loss)), (name, case)


# On the large model CI runs a plain, a stateful, a wrapping, a line-search and an
# extra-argument optimizer and one whose state holds inf; the others with --runslow.
LARGE_IN_CI = {
    "sgd",
    "adam",
    "multi_steps_adam",
    "sgd_backtracking_linesearch",
    "clip_sam",
    "adam_reduce_on_plateau_every_3",
}
LARGE = slow_params(CATALOGUES["jax"], set(CATALOGUES["jax"]) - LARGE_IN_CI)


@pytest.mark.parametrize("name", LARGE)
def test_every_optimizer_on_a_large_model_stops_where_the_reference_stops(name):
    params, (x, t) = problem("large")
    run_both(optimizer(name), params, (x, t, kicks(4, w=np.inf)))


def count_checked_runs(monkeypatch: Any) -> list:
    """Patches `Fit._checked` (the call run again with every step checked) to record its
    calls."""
    calls: list = []
    original = sfj.Fit._checked

    def checked(self: Any, *args: Any, **kw: Any) -> Any:
        calls.append(self)
        return original(self, *args, **kw)

    monkeypatch.setattr(sfj.Fit, "_checked", checked)
    return calls


@pytest.mark.parametrize("size", SIZES)
def test_a_large_model_runs_the_call_again_only_when_a_lazily_checked_value_went_bad(
    size, monkeypatch
):
    calls = count_checked_runs(monkeypatch)
    params, (x, t) = problem(size)
    fit = sfj.fuse(loss_fn, optimizer("adam"), steps=STEPS)
    _, trace = fit(fit.init(params), x, t, kicks(0))  # all finite
    assert trace.stop is Stop.STEPS and calls == []
    _, trace = fit(fit.init(params), x, t, kicks(5, w=np.nan))
    assert trace.stop is Stop.NONFINITE and trace.steps == 5
    assert len(calls) == (1 if size == "large" else 0)


def test_notifications_stop_before_the_refused_step_on_a_large_model():
    # The loop checks the lazily checked values before each notification: none reaches
    # the host for a step at or past the refused one, and every earlier one does once.
    params, (x, t) = problem("large")
    for k in (7, 9):
        seen: list = []
        fit = sfj.fuse(
            loss_fn, optimizer("adam"), steps=STEPS, callback=lambda s, l: seen.append(s), every=3
        )
        _, trace = fit(fit.init(params), x, t, kicks(k, w=np.inf))
        assert trace.stop is Stop.NONFINITE and trace.steps == k
        assert seen == list(range(3, k + 1, 3)), (k, seen)


def test_jit_and_vmap_run_the_call_again_inside_the_program():
    params, (x, t) = problem("large")
    fit = sfj.fuse(loss_fn, optimizer("adam"), steps=STEPS)
    want = [fit(fit.init(params), x, t, kicks(k, w=np.nan)) for k in (3, 8)]
    for k, (state, trace) in zip((3, 8), want):
        assert trace.stop is Stop.NONFINITE and trace.steps == k
        j_state, j_trace = jax.jit(fit)(fit.init(params), x, t, kicks(k, w=np.nan))
        assert int(j_trace.steps) == k and int(j_trace.stop) == Stop.NONFINITE
        for a, b in zip(leaves(j_state), leaves(state)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # two models stopping at different steps, and one that never stops
    s = np.zeros((3, STEPS, 2), np.float32)
    s[0, 3, 0], s[1, 8, 0] = np.nan, np.inf
    states, traces = jax.vmap(lambda s: fit(fit.init(params), x, t, sf.Batches(s)))(jnp.asarray(s))
    assert [int(v) for v in traces.steps] == [3, 8, STEPS]
    assert [int(v) for v in traces.stop] == [Stop.NONFINITE, Stop.NONFINITE, Stop.STEPS]
    for i, (state, _) in enumerate(want):
        for a, b in zip(leaves(jax.tree_util.tree_map(lambda v: v[i], states)), leaves(state)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def inf_entry_that_returns(finite_at: int, inf_at: int) -> optax.GradientTransformation:
    """Passes the gradient on; its state holds an entry that is inf at init, 1.0 from
    update ``finite_at`` (0-based) and inf again from update ``inf_at``."""

    def init(params: Any) -> Any:
        return {"x": jnp.array(jnp.inf, jnp.float32), "n": jnp.zeros((), jnp.int32)}

    def update(grads: Any, state: Any, params: Any = None) -> Any:
        n = state["n"]
        x = jnp.where(n >= inf_at, jnp.inf, jnp.where(n >= finite_at, 1.0, state["x"]))
        return grads, {"x": x.astype(jnp.float32), "n": n + 1}

    return optax.GradientTransformation(init, update)


def test_a_large_model_whose_state_starts_with_an_inf_entry_checks_every_step():
    # An entry inf from the start and left so is no non-finite update; made finite, then
    # inf again, it is, at that step: the lazy check cannot tell, so the loop checks every
    # step when the call's state starts with a NaN/inf.
    params, (x, t) = problem("large")
    opt = optax.chain(inf_entry_that_returns(finite_at=2, inf_at=5), optax.adam(0.01))
    _, state, trace = run_both(opt, params, (x, t, kicks(0)))
    assert trace.stop is Stop.NONFINITE and trace.steps == 5
    assert float(state.opt_state[0]["x"]) == 1.0


def test_the_loop_of_a_large_adam_fit_reads_no_parameter_sized_value_for_its_check():
    # The innermost loop body of the compiled program: Adam's update reads and writes
    # the parameter-sized arrays (784x256 here); the check adds no reduction over any of
    # them, no concatenation of the state, and no copy of it.
    params = {"w": jnp.zeros((784, 256), jnp.float32), "b": jnp.zeros((256,), jnp.float32)}
    x, t = jnp.ones((8, 784), jnp.float32), jnp.ones((8, 256), jnp.float32)
    fit = sfj.fuse(loss_fn, optax.adam(1e-3), steps=64)
    hlo = fit._compiled_text(fit.init(params), x, t, kicks(0))
    bodies = set(re.findall(r"while\([^)]*\), condition=%?[\w.\-]+, body=%?([\w.\-]+)", hlo))
    computations = {c.split(" ", 1)[0].lstrip("%"): c for c in re.split(r"\n(?=%\S+ \()", hlo)}
    inner = max((computations[b] for b in bodies), key=lambda c: c.count("\n"))
    assert "conditional(" in inner  # the check of every value, taken only when exact
    total = 784 * 256 + 256
    for line in inner.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) ([\w-]+)\(", line)
        if m is None or m.group(2) in ("get-tuple-element", "parameter", "tuple", "bitcast"):
            continue
        shape, op = m.groups()
        # no concatenation of the state (the carried kept entries are not written) ...
        assert not any(f"f32[{k}]" in shape for k in (2 * total, 3 * total + 1, 4 * total + 1)), (
            line
        )
        # ... and every parameter-sized result is Adam's own (a matmul or its update)
        if "f32[784,256]" in shape:
            assert "reduce" not in line and op != "copy", line
