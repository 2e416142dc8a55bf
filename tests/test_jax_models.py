"""JAX real models: flax linen, flax nnx and equinox models with batch statistics carried by
``has_state=True``, fused over several calls against the plain loop the guide writes (a
jitted ``jax.value_and_grad`` + ``optax.update`` + ``optax.apply_updates`` per step,
carrying the model state), and the optax transformations that need more than a gradient
(``optax.contrib.sophia``'s ``obj_fn``, ``optax.lookahead``'s ``LookaheadParams``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import RTOL, assert_close, assert_fused, splits

import stepfuse.jax as sf
from stepfuse import Stop
from stepfuse.problems import blobs, perceptron_init

X = jax.random.normal(jax.random.key(1), (16, 3))
Y = (X[:, 0] + X[:, 1] > 0).astype(jnp.int32)
CALLS = splits(8, 3)  # 3 + 3 + 2 steps


def flat(tree: Any) -> dict[str, np.ndarray]:
    """A pytree of any kind (nnx State, equinox Module) as {path: NumPy array}."""
    return {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def xent(logits: Any, y: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def plain_loop(loss_fn, tx, params, model_state, steps, *batch):
    """The guide's plain loop: one jitted step per Python iteration."""

    @jax.jit
    def step(p, s, o):
        (value, s), g = jax.value_and_grad(loss_fn, has_aux=True)(p, s, *batch)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), s, o, value

    p, s, o, losses = params, model_state, tx.init(params), []
    for _ in range(steps):
        p, s, o, value = step(p, s, o)
        losses.append(value)
    return p, s, np.asarray(losses)


def fused_calls(fit, params, model_state, *batch):
    state, losses = fit.init(params, model_state), []
    for n in CALLS:
        state, trace = fit(state, *batch, steps=n)
        assert trace.stop is Stop.STEPS and trace.steps == n
        losses.append(trace.loss)
    return state, np.concatenate(losses)


def check_against_plain(loss_fn, params, model_state, rtol=RTOL):
    tx = optax.adam(0.02)
    fit = sf.fuse(loss_fn, tx, steps=max(CALLS), has_state=True)
    assert_fused(fit)
    state, losses = fused_calls(fit, params, model_state, X, Y)
    p, s, ref_losses = plain_loop(loss_fn, tx, params, model_state, sum(CALLS), X, Y)
    assert int(state.step) == sum(CALLS)
    assert_close(flat(state.params), flat(p), rtol=rtol, what="params")
    assert_close(flat(state.model_state), flat(s), rtol=rtol, what="model_state")
    assert_close(losses, ref_losses, rtol=rtol, what="losses")
    # the statistics moved away from their start: carried, not recomputed from it each step
    start, end = flat(model_state), flat(state.model_state)
    assert any(not np.allclose(start[k], end[k]) for k in start)
    return fit, state


# -- flax linen -------------------------------------------------------------------------------


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(8, use_bias=False)(x)  # no bias before the batch norm: it would cancel
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(2)(nn.relu(x))


LINEN = LinenNet()
LINEN_VARS = LINEN.init(jax.random.key(0), X)


def linen_loss(params, batch_stats, x, y):
    logits, updates = LINEN.apply(
        {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    return xent(logits, y), updates["batch_stats"]


@pytest.fixture(scope="module")
def linen_fit():
    return check_against_plain(linen_loss, LINEN_VARS["params"], LINEN_VARS["batch_stats"])


def test_flax_linen_batch_stats_carried(linen_fit):
    fit, state = linen_fit
    # linen's own running mean after 8 steps (the plain loop above), not the one-step value
    # every step recomputed from the initial statistics would give
    one = linen_loss(LINEN_VARS["params"], LINEN_VARS["batch_stats"], X, Y)[1]
    mean = np.asarray(state.model_state["BatchNorm_0"]["mean"])
    assert not np.allclose(mean, np.asarray(one["BatchNorm_0"]["mean"]))


def test_flax_linen_stepwise_equals_fused(linen_fit):
    _, fused = linen_fit
    fit = sf.fuse(linen_loss, optax.adam(0.02), steps=max(CALLS), has_state=True, mode="stepwise")
    state = fit.init(LINEN_VARS["params"], LINEN_VARS["batch_stats"])
    for n in CALLS:
        state, _ = fit(state, X, Y, steps=n)
    assert_close(flat(state), flat(fused), rtol=0, atol=0, what="state")


def test_flax_linen_has_aux_with_state():
    def loss(params, batch_stats, x, y):
        logits, updates = LINEN.apply(
            {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
        )
        return xent(logits, y), (updates["batch_stats"], {"logits": logits})

    fit = sf.fuse(loss, optax.adam(0.02), steps=3, has_state=True, has_aux=True)
    state, trace, aux = fit(fit.init(LINEN_VARS["params"], LINEN_VARS["batch_stats"]), X, Y)
    p, s, _ = plain_loop(linen_loss, optax.adam(0.02), *LINEN_VARS.values(), 3, X, Y)
    assert_close(flat(state.model_state), flat(s), what="model_state")
    assert aux["logits"].shape == (16, 2) and trace.steps == 3


# -- flax nnx ---------------------------------------------------------------------------------


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(3, 8, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def test_flax_nnx_batch_norm():
    graphdef, params, rest = nnx.split(NnxNet(nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(x)  # updates the model's BatchStat variables
        return xent(logits, y), nnx.split(model, nnx.Param, ...)[2]

    check_against_plain(loss, params, rest)


def test_nnx_module_passed_whole_is_refused():
    fit = sf.fuse(lambda m, x, y: xent(m(x), y), optax.sgd(0.1), steps=2)
    with pytest.raises(TypeError, match=r"BatchStat.*nnx\.split\(model, nnx\.Param"):
        fit.init(NnxNet(nnx.Rngs(0)))


# -- equinox ----------------------------------------------------------------------------------


class EqxNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(3, 8, use_bias=False, key=k1)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="batch")
        self.l2 = eqx.nn.Linear(8, 2, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.l1(x), state)
        return self.l2(jax.nn.relu(h)), state


def test_equinox_batch_norm():
    model, model_state = eqx.nn.make_with_state(EqxNet)(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, model_state, x, y):
        model = eqx.combine(params, static)
        batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        logits, model_state = batched(x, model_state)
        return xent(logits, y), model_state

    check_against_plain(loss, params, model_state)


def test_equinox_module_with_functions_is_refused():
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))  # holds its activation functions
    fit = sf.fuse(lambda m, x, y: xent(jax.vmap(m)(x), y), optax.sgd(0.1), steps=2)
    with pytest.raises(TypeError, match=r"params\.activation.*eqx\.partition.*nnx\.split"):
        fit.init(model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    fit = sf.fuse(
        lambda p, x, y: xent(jax.vmap(eqx.combine(p, static))(x), y), optax.sgd(0.1), steps=2
    )
    state, trace = fit(fit.init(params), X, Y)
    assert trace.steps == 2


# -- has_state semantics on a toy model --------------------------------------------------------


def counting_loss(params, model_state, x):
    """A running mean of the params and a step count; the loss turns NaN at count 3."""
    n, ema = model_state["n"], model_state["ema"]
    loss = jnp.sum((params - x) ** 2) + jnp.where(n >= 3, jnp.nan, 0.0)
    return loss, {"n": n + 1, "ema": 0.5 * ema + 0.5 * jnp.sum(params)}


STATE0 = {"n": jnp.int32(0), "ema": jnp.float32(0)}
P0 = jnp.zeros(3)


def test_nonfinite_leaves_model_state_at_last_finite_step():
    ref_p, ref_s, _ = plain_loop(counting_loss, optax.sgd(0.1), P0, STATE0, 3, jnp.ones(3))
    for mode in ("fused", "stepwise"):
        fit = sf.fuse(counting_loss, optax.sgd(0.1), steps=6, has_state=True, mode=mode)
        state, trace = fit(fit.init(P0, STATE0), jnp.ones(3))
        assert trace.stop is Stop.NONFINITE and trace.steps == 3 == int(state.step), mode
        assert_close(flat(state.model_state), flat(ref_s), rtol=0, atol=0, what=mode)
        assert_close(flat(state.params), flat(ref_p), rtol=0, atol=0, what=mode)
        assert int(state.model_state["n"]) == 3
    # inside jax.jit the state before the refused update is rebuilt in the program
    fit = sf.fuse(counting_loss, optax.sgd(0.1), steps=6, has_state=True)
    j_state, j_trace = jax.jit(lambda s, x: fit(s, x))(fit.init(P0, STATE0), jnp.ones(3))
    assert int(j_trace.stop) == Stop.NONFINITE and int(j_trace.steps) == 3
    assert_close(flat(j_state.model_state), flat(ref_s), rtol=0, atol=0, what="jit")


def test_has_state_vmap_and_grad():
    def loss(params, model_state, x):
        return jnp.sum((params - x) ** 2), {"ema": 0.5 * model_state["ema"] + 0.5 * params}

    fit = sf.fuse(loss, optax.sgd(0.1), steps=4, has_state=True)
    starts = jnp.stack([jnp.zeros(3), jnp.ones(3)])
    ema0 = {"ema": jnp.zeros((2, 3))}
    states, _ = jax.vmap(lambda p, s: fit(fit.init(p, s), jnp.full(3, 2.0)))(starts, ema0)
    for i in range(2):
        one, _ = fit(fit.init(starts[i], {"ema": jnp.zeros(3)}), jnp.full(3, 2.0))
        assert_close(flat(one.model_state), {k: v[i] for k, v in flat(states.model_state).items()})

    def final_ema(x):  # through the loop, and through the carried model state
        state, _ = fit(fit.init(jnp.zeros(3), {"ema": jnp.zeros(3)}), x)
        return jnp.sum(state.model_state["ema"])

    g = jax.grad(final_ema)(jnp.full(3, 2.0))
    eps = 1e-2
    numeric = (final_ema(jnp.full(3, 2.0 + eps)) - final_ema(jnp.full(3, 2.0 - eps))) / (2 * eps)
    np.testing.assert_allclose(float(jnp.sum(g)), float(numeric), rtol=1e-3)
    assert float(jnp.sum(g)) > 0


def test_has_state_bad_inputs():
    fit = sf.fuse(counting_loss, optax.sgd(0.1), steps=2, has_state=True)
    with pytest.raises(
        TypeError, match=r"`model_state` must be .*fit\.init\(params, model_state\)"
    ):
        fit.init(P0)
    plain = sf.fuse(lambda p, x: jnp.sum(p * x), optax.sgd(0.1), steps=2)
    with pytest.raises(TypeError, match="has_state=True"):
        plain.init(P0, STATE0)
    with pytest.raises(TypeError, match="`state.model_state` must be a model state"):
        fit(plain.init(P0), jnp.ones(3))
    with pytest.raises(TypeError, match="has_state"):
        sf.fuse(counting_loss, optax.sgd(0.1), steps=2, has_state=1)
    wrong = sf.fuse(
        lambda p, s, x: (jnp.sum(p * x), {"n": s["n"]}), optax.sgd(0.1), steps=2, has_state=True
    )
    with pytest.raises(TypeError, match="new model state"):
        wrong(wrong.init(P0, STATE0), jnp.ones(3))
    no_pair = sf.fuse(lambda p, s, x: jnp.sum(p * x), optax.sgd(0.1), steps=2, has_state=True)
    with pytest.raises(TypeError, match=r"\(loss, new_model_state\)"):
        no_pair(no_pair.init(P0, STATE0), jnp.ones(3))


# -- optax transformations that need more than a gradient --------------------------------------

BX, BY = blobs()


def perceptron_loss(params, x, y):
    return xent(x @ params["kernel"] + params["bias"], y)


def _stateless_plain(tx, params, steps, grad_at=lambda p: p, **extra_fns):
    @jax.jit
    def step(p, o):
        value, g = jax.value_and_grad(perceptron_loss)(grad_at(p), BX, BY)
        extra = {k: (lambda q: perceptron_loss(q, BX, BY)) for k in extra_fns}
        updates, o = tx.update(g, o, p, **extra)
        return optax.apply_updates(p, updates), o, value

    p, o, losses = params, tx.init(params), []
    for _ in range(steps):
        p, o, value = step(p, o)
        losses.append(value)
    return p, np.asarray(losses)


def _fused_stateless(tx, params):
    fit = sf.fuse(perceptron_loss, tx, steps=max(CALLS))
    state, losses = fit.init(params), []
    for n in CALLS:
        state, trace = fit(state, BX, BY, steps=n)
        losses.append(trace.loss)
    return state, np.concatenate(losses)


def test_sophia_gets_obj_fn():
    tx = optax.contrib.sophia(1e-2, update_interval=2)
    p0 = jax.tree_util.tree_map(jnp.asarray, perceptron_init())
    state, losses = _fused_stateless(tx, p0)
    p, ref = _stateless_plain(tx, p0, sum(CALLS), obj_fn=True)
    assert_close(state.params, p, what="params")
    assert_close(losses, ref, what="losses")
    assert float(jnp.sum(jnp.abs(state.opt_state[0].nu["kernel"]))) > 0  # the Hessian estimate


def test_lookahead(caplog):
    tx = optax.lookahead(optax.adam(0.05), sync_period=3, slow_step_size=0.5)
    p0 = optax.LookaheadParams.init_synced(jax.tree_util.tree_map(jnp.asarray, perceptron_init()))
    state, losses = _fused_stateless(tx, p0)
    p, ref = _stateless_plain(tx, p0, sum(CALLS), grad_at=lambda p: p.fast)
    assert isinstance(state.params, optax.LookaheadParams)
    assert_close(state.params, p, what="params")
    assert_close(losses, ref, what="losses")
    fit = sf.fuse(perceptron_loss, tx, steps=2)
    with caplog.at_level("WARNING"):
        with pytest.raises(TypeError, match=r"optax\.lookahead.*LookaheadParams\.init_synced"):
            fit.init(perceptron_init())
    # (optax's lookahead init logs that it continues, which the refusal then contradicts)
    assert not [r for r in caplog.records if r.name == "absl"], caplog.records


# -- the guide's examples ----------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "jax.md"
MODEL_BLOCKS = [
    b
    for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    if "has_state=True" in b
]


def test_guide_has_the_three_model_examples():
    assert [("linen" in b, "nnx" in b, "equinox" in b) for b in MODEL_BLOCKS] == [
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]


@pytest.mark.parametrize("block", MODEL_BLOCKS, ids=["linen", "nnx", "equinox"])
def test_guide_model_example_runs(block):
    scope: dict[str, Any] = {}
    exec(compile(block, str(GUIDE), "exec"), scope)
    state, trace = scope["state"], scope["trace"]
    assert trace.stop is Stop.STEPS and trace.steps == 100 and state.model_state is not None
    assert np.isfinite(trace.loss).all() and trace.loss[-1] < trace.loss[0]
