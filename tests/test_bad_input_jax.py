"""Bad input to the JAX backend, one table: every case raises a TypeError/ValueError that
names the argument (or, for a callback, the callback's own error) and leaves the
caller's state untouched.

Two inputs have tests of their own below:

* a ``loss_fn`` that does not depend on ``params`` (JAX would give zero gradients and the
  fit would silently do nothing): refused before anything runs, detected from its jaxpr;
* a batch whose shapes do not fit ``loss_fn``: JAX's own error surfaces (a
  TypeError/ValueError naming the shapes), raised while tracing, before any step.
"""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stepfuse.jax as sf
from stepfuse import Stop
from stepfuse.jax._checks import inputs_reaching_output
from stepfuse.problems import blobs, perceptron_init

X, Y = blobs()


def perceptron_loss(params, x, y):
    logits = x @ params["kernel"] + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def build(**kwargs):
    return sf.fuse(perceptron_loss, optax.sgd(0.1), **{"steps": 3, **kwargs})


def call(fit=None, batch=(X, Y), params=None, **kwargs):
    fit = fit or build()
    return fit(fit.init(params or perceptron_init()), *batch, **kwargs)


def build_with_loss(loss_fn, **kwargs):
    return lambda: call(sf.fuse(loss_fn, optax.sgd(0.1), **{"steps": 3, **kwargs}))


def raising_callback(step, loss):
    raise RuntimeError(f"callback failed at step {step}")


def _optimizers_of_other_frameworks():
    cases = []
    try:
        import torch

        cases.append(
            ("torch.optim.SGD", torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))
        )
    except ImportError:  # pragma: no cover - torch is optional
        pass

    class KerasLikeOptimizer:  # stands in for keras.optimizers.SGD without importing TF
        learning_rate = 0.1

        def apply_gradients(self, grads_and_vars):
            return None

    class NotOptax:
        def init(self, params):
            return ()

    cases += [
        ("keras_like", KerasLikeOptimizer()),
        ("init_only", NotOptax()),
        ("uncalled_optax_factory", optax.adam),
        ("string", "adam"),
        ("none", None),
    ]
    return cases


# (id, action, exception(s), regex the message must match)
CASES = [
    # -- steps, at build time and at call time
    *[
        (f"steps={v!r}", (lambda v=v: build(steps=v)), (TypeError, ValueError), "`steps`")
        for v in (0, -1, 2.5, "3", True, None)
    ],
    *[
        (f"call steps={v!r}", (lambda v=v: call(steps=v)), (TypeError, ValueError), "`steps`")
        for v in (0, -2, 1.5, "2", True)
    ],
    (
        "call steps above the built steps",
        lambda: call(steps=4),
        ValueError,
        r"`steps`.*at most 3.*fuse\(\.\.\., steps=4\)",
    ),
    (
        "call steps above the built steps, stepwise",
        lambda: call(sf.fuse(perceptron_loss, optax.sgd(0.1), steps=3, mode="stepwise"), steps=4),
        ValueError,
        r"`steps`.*at most 3",
    ),
    # -- tol
    *[
        (f"tol={v!r}", (lambda v=v: build(tol=v)), (TypeError, ValueError), "`tol`")
        for v in (-1.0, float("nan"), "1e-3", True, [1e-3])
    ],
    # -- record_every
    *[
        (
            f"record_every={v!r}",
            (lambda v=v: build(record_every=v)),
            (TypeError, ValueError),
            "`record_every`",
        )
        for v in (0, -3, 1.5, None, "2")
    ],
    # -- callback / every / progress / on_nonfinite / mode / flags
    *[
        (
            f"every={v!r}",
            (lambda v=v: build(every=v, callback=print)),
            (TypeError, ValueError),
            "`every`",
        )
        for v in (0, -1, 2.5, "10")
    ],
    ("every without callback", lambda: build(every=10), ValueError, "`every`.*`callback`"),
    ("callback not callable", lambda: build(callback=3), TypeError, "`callback`"),
    ("progress not bool", lambda: build(progress="yes"), TypeError, "`progress`"),
    ("on_nonfinite unknown", lambda: build(on_nonfinite="ignore"), ValueError, "`on_nonfinite`"),
    ("mode unknown", lambda: build(mode="eager"), ValueError, "`mode`"),
    ("has_aux not bool", lambda: build(has_aux=1), TypeError, "`has_aux`"),
    ("differentiable not bool", lambda: build(differentiable="no"), TypeError, "`differentiable`"),
    # -- loss_fn
    (
        "loss_fn not callable",
        lambda: sf.fuse("loss", optax.sgd(0.1), steps=3),
        TypeError,
        "`loss_fn`",
    ),
    (
        "loss not scalar",
        build_with_loss(lambda p, x, y: x @ p["kernel"]),
        TypeError,
        r"`loss_fn`.*scalar.*shape \(50, 2\)",
    ),
    ("loss integer", build_with_loss(lambda p, x, y: jnp.sum(y)), TypeError, "`loss_fn`.*int32"),
    (
        "loss bool",
        build_with_loss(lambda p, x, y: perceptron_loss(p, x, y) > 0),
        TypeError,
        "`loss_fn`.*bool",
    ),
    (
        "loss complex",
        build_with_loss(lambda p, x, y: perceptron_loss(p, x, y) * 1j),
        TypeError,
        "`loss_fn`.*complex",
    ),
    (
        "loss tuple without has_aux",
        build_with_loss(lambda p, x, y: (perceptron_loss(p, x, y), 1)),
        TypeError,
        "`loss_fn`.*floating-point scalar",
    ),
    (
        "has_aux but loss not a pair",
        build_with_loss(perceptron_loss, has_aux=True),
        TypeError,
        r"`loss_fn`.*\(loss, aux\)",
    ),
    (
        "loss_fn signature does not take the batch",
        lambda: call(batch=(X,)),
        TypeError,
        "missing 1 required positional argument: 'y'",
    ),
    # -- batch shapes that do not fit: JAX's own message, naming the shapes
    (
        "batch features do not fit the kernel",
        lambda: call(batch=(np.ones((50, 3), np.float32), Y)),
        TypeError,
        r"dot_general.*\(3,\) and \(2,\)",
    ),
    (
        "batch x and y lengths differ",
        lambda: call(batch=(X, Y[:10])),
        ValueError,
        r"shapes.*\(10, 1\).*\(50, 1\)",
    ),
    (
        # The message listed one `()` per number (44 KB for 2,000 rows of 4) and no fix.
        "batch given as Python lists",
        lambda: call(batch=(X.tolist(), Y.tolist())),
        TypeError,
        r"(?s)^.{0,900}batch\[0\] is a list of 100 numbers; batch\[1\] is a list of 50 numbers: "
        r"JAX reads a list as a pytree of separate scalars; np\.asarray\(\.\.\.\) makes it one",
    ),
    # -- optimizer of another framework / not an optax GradientTransformation
    *[
        (
            f"optimizer {name}",
            (lambda o=opt: sf.fuse(perceptron_loss, o, steps=3)),
            TypeError,
            "`optimizer` must be an optax.GradientTransformation",
        )
        for name, opt in _optimizers_of_other_frameworks()
    ],
    # -- params
    (
        "params of integer dtype",
        lambda: build().init({"kernel": jnp.ones((2, 2), jnp.int32), "bias": jnp.zeros(2)}),
        TypeError,
        r"`params`.*int32.*\['kernel'\]",
    ),
    (
        "params of bool dtype",
        lambda: build().init({"kernel": np.ones((2, 2), bool), "bias": jnp.zeros(2)}),
        TypeError,
        r"`params`.*bool",
    ),
    ("params python ints", lambda: build().init([1, 2]), TypeError, r"`params`.*int.*params\[0\]"),
    ("params empty", lambda: build().init({}), ValueError, "`params`.*at least one"),
    ("params None", lambda: build().init(None), ValueError, "`params`"),
    (
        "state not a FitState",
        lambda: build()(perceptron_init(), X, Y),
        TypeError,
        "`state`.*fit.init",
    ),
    # -- a state of another optimizer or model: it would have run (sgd ignores adam's state)
    *[
        (
            f"state of another optimizer, {mode}",
            (
                lambda mode=mode: build(mode=mode)(
                    sf.fuse(perceptron_loss, optax.adam(0.1), steps=3).init(perceptron_init()), X, Y
                )
            ),
            TypeError,
            r"`state.opt_state` is not a state of this fit's optimizer.*ScaleByAdamState.*fit.init",
        )
        for mode in ("fused", "stepwise")
    ],
    (
        "state whose params changed shape",
        lambda: (
            lambda fit: fit(
                fit.init(perceptron_init())._replace(
                    params={"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}
                ),
                np.ones((50, 3), np.float32),
                Y,
            )
        )(sf.fuse(perceptron_loss, optax.sgd(0.1, momentum=0.9), steps=3)),
        ValueError,
        r"`state.opt_state\[0\].trace\['kernel'\]` has shape \(2, 2\).*\(3, 2\)",
    ),
    # -- callbacks that raise: their own error reaches the caller
    (
        "callback raises",
        lambda: call(build(callback=raising_callback, every=2)),
        RuntimeError,
        "callback failed at step 2",
    ),
    (
        "callback with a wrong signature",
        lambda: call(build(callback=lambda: None, every=1)),
        TypeError,
        "positional argument",
    ),
    (
        "stepwise callback raises",
        lambda: call(build(callback=raising_callback, every=2, mode="stepwise")),
        RuntimeError,
        "callback failed at step 2",
    ),
]


def test_case_ids_are_unique_and_counted():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))
    print(f"\n{len(CASES)} bad-input cases for stepfuse.jax")
    assert len(CASES) >= 50


@pytest.mark.parametrize("action, exc, match", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_input_is_refused_with_a_message(action, exc, match):
    with pytest.raises(exc, match=match):
        action()


def test_a_state_made_for_params_of_another_dtype_is_refused_fused_with_the_cast():
    """Adam's state from bfloat16 params, run with float32 ones: a plain loop promotes it
    at its first step, and so does the stepwise mode; the fused loop, whose carry has fixed
    dtypes, refuses it naming the leaf and the cast (JAX's while_loop error said neither).
    Cast as the message says, it runs fused."""
    fit = sf.fuse(perceptron_loss, optax.adam(0.1), steps=3)
    params = jax.tree_util.tree_map(jnp.asarray, perceptron_init())
    state = fit.init(jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params))
    state = state._replace(params=params)
    with pytest.raises(TypeError, match=r"`state.opt_state\[0\].mu\['bias'\]` is bfloat16, an"):
        fit(state, X, Y)
    stepwise = sf.fuse(perceptron_loss, optax.adam(0.1), steps=3, mode="stepwise")
    assert stepwise(state, X, Y)[0].opt_state[0].mu["bias"].dtype == jnp.float32
    cast = state._replace(
        opt_state=jax.tree.map(
            lambda a, b: a.astype(b.dtype), state.opt_state, fit.init(state.params).opt_state
        )
    )
    new, trace = fit(cast, X, Y)
    assert trace.steps == 3 and new.opt_state[0].mu["bias"].dtype == jnp.float32


def test_failed_calls_leave_the_state_untouched_and_the_fit_usable():
    fit = sf.fuse(perceptron_loss, optax.adam(0.1), steps=4, callback=raising_callback, every=2)
    state = fit.init(perceptron_init())
    snapshot = jax.tree_util.tree_map(np.array, state)
    for bad in [
        lambda: fit(state, X, Y),
        lambda: fit(state, X, Y, steps=9),
        lambda: fit(state, np.ones((50, 3), np.float32), Y),
    ]:
        with pytest.raises((RuntimeError, TypeError, ValueError)):
            bad()
        for u, v in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(snapshot)):
            assert np.array_equal(u, v)
    ok = sf.fuse(perceptron_loss, optax.adam(0.1), steps=4)
    _, trace = ok(state, X, Y)
    assert trace.steps == 4 and trace.stop is Stop.STEPS


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_a_raising_callback_hands_back_the_state_at_its_step(mode):
    """As a plain loop stopped by its callback: the updates up to the callback's step are
    kept, in ``error.state`` (a JAX fit updates nothing in place); the input is unchanged."""
    stops = []

    def callback(step, loss):
        if step == 5:
            stops.append(step)
            raise RuntimeError("stop here")

    fit = sf.fuse(perceptron_loss, optax.adam(0.1), steps=9, callback=callback, every=1, mode=mode)
    state = fit.init(perceptron_init())
    state, _ = fit(state, X, Y, steps=2)  # the step count runs on from a call before
    with pytest.raises(RuntimeError, match="stop here") as caught:
        fit(state, X, Y)
    assert stops == [5] and int(state.step) == 2
    reached = caught.value.state
    assert int(reached.step) == 5 and "error.state" in "".join(caught.value.__notes__)
    ref = sf.fuse(perceptron_loss, optax.adam(0.1), steps=9)
    want, _ = ref(state, X, Y, steps=3)
    for u, v in zip(jax.tree_util.tree_leaves(reached), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(u, v)


# -- a loss that does not depend on params ---------------------------------------------------


def constant_in_params(p, x, y):
    return jnp.mean(x**2)


def detached(p, x, y):
    return jnp.mean(x**2) + jnp.sum(jax.lax.stop_gradient(p["kernel"]))


@pytest.mark.parametrize(
    "loss_fn", [constant_in_params, detached], ids=["constant", "stop_gradient"]
)
@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_loss_not_depending_on_params_is_refused_before_running(loss_fn, mode):
    fit = sf.fuse(loss_fn, optax.adam(0.1), steps=5, mode=mode)
    with pytest.raises(ValueError, match="`loss_fn` does not depend on `params`"):
        fit(fit.init(perceptron_init()), X, Y)


def params_used(loss_fn, params, *batch):
    """Which leaves of ``params`` the loss of ``loss_fn`` depends on (the library's check)."""
    closed = jax.make_jaxpr(loss_fn)(params, *batch)
    n = len(jax.tree_util.tree_leaves(params))
    return inputs_reaching_output(closed.jaxpr)[:n]


@pytest.mark.parametrize(
    "loss_fn, want",
    [
        (perceptron_loss, [True, True]),  # leaves in key order: bias, kernel
        (constant_in_params, [False, False]),
        (detached, [False, False]),
        (
            lambda p, x, y: perceptron_loss({"kernel": p["kernel"], "bias": jnp.zeros(2)}, x, y),
            [False, True],
        ),
        (jax.jit(perceptron_loss), [True, True]),  # through a pjit equation
        (
            lambda p, x, y: jax.lax.cond(x.sum() > 0, lambda: p["kernel"].sum(), lambda: 0.0),
            [False, True],
        ),
    ],
    ids=["uses_all", "constant", "stop_gradient", "bias_unused", "jitted", "cond"],
)
def test_a_loss_without_params_can_be_detected_from_its_jaxpr(loss_fn, want):
    assert (
        params_used(loss_fn, jax.tree_util.tree_map(jnp.asarray, perceptron_init()), X, Y) == want
    )


@pytest.mark.parametrize("mistake", ["bool", "int", "numpy"])
def test_python_control_flow_on_traced_values_names_the_loss_and_jaxs_reason(mistake):
    """JAX's own tracer errors take a tracer to build: re-raised as their type, with a new
    message, they became "'str' object has no attribute '_error_repr'"."""

    def loss(w, x):
        if mistake == "bool" and w.sum() > 0:
            return jnp.sum(w**2)
        if mistake == "int":
            return jnp.sum(w ** int(x[0]))
        if mistake == "numpy":
            return jnp.sum(np.asarray(w) * x)
        return jnp.sum((w - x) ** 2)

    fit = sf.fuse(loss, optax.sgd(0.1), steps=2)
    with pytest.raises(TypeError, match=r"loss_fn\(params, \*batch\)` failed .*(traced|tracer)"):
        fit(fit.init(jnp.ones(3)), jnp.ones(3))


def test_a_loss_returning_a_pair_without_has_aux_is_told_of_the_flag():
    def with_aux(p, x, y):
        return perceptron_loss(p, x, y), {"norm": jnp.sum(p["kernel"] ** 2)}

    fit = sf.fuse(with_aux, optax.sgd(0.1), steps=2)
    with pytest.raises(TypeError, match=r"`loss_fn` must .*tuple of 2: .*has_aux=True"):
        fit(fit.init(perceptron_init()), X, Y)
    fit = sf.fuse(with_aux, optax.sgd(0.1), steps=2, has_aux=True)
    assert fit(fit.init(perceptron_init()), X, Y)[1].steps == 2


def test_a_collective_in_loss_fn_under_shard_map_is_told_to_use_a_named_sharding():
    """``jax.lax.pmean`` in ``loss_fn`` with the fit inside ``jax.shard_map``: JAX's check of
    the axes a value varies over fails where the fit runs loss_fn's traced program (a plain
    loop runs). The error says so, and what gives data-parallel training instead."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    fit = sf.fuse(
        lambda p, x, y: jax.lax.pmean(perceptron_loss(p, x, y), "data"), build().optimizer, steps=2
    )
    params = jax.tree_util.tree_map(jnp.asarray, perceptron_init())

    def run(p, x, y):
        return fit(fit.init(p), x, y)[0].params

    mapped = jax.shard_map(run, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    with pytest.raises(ValueError) as caught:
        jax.jit(mapped)(params, X, Y)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "under jax.shard_map" in notes and "NamedSharding" in notes, notes
