"""JAX reliability: checkpoints across processes, determinism, long runs, interrupts.

Everything here is compared *bitwise* (``np.array_equal``) unless a tolerance is
stated with its reason.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stepfuse.jax as sf
from stepfuse import Stop, checkpoint
from stepfuse.problems import blobs, mlp_init, perceptron_init

# The problem, as source, so that the test process and the restoring subprocess run
# exactly the same code.
PROBLEM_SRC = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    import stepfuse.jax as sf
    from stepfuse import checkpoint
    from stepfuse.bench.jax import mlp_loss
    from stepfuse.problems import blobs, mlp_init

    X, Y = blobs()

    def make_fit(steps):
        return sf.fuse(mlp_loss, optax.adam(0.01), steps=steps)

    def init_params():
        return mlp_init((2, 16, 2))
    """
)
_ns: dict = {}
exec(PROBLEM_SRC, _ns)
mlp_loss, make_fit, init_params = _ns["mlp_loss"], _ns["make_fit"], _ns["init_params"]
X, Y = blobs()


def perceptron_loss(params, x, y):
    logits = x @ params["kernel"] + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b) or len(la) != len(lb):
        return False
    return all(
        np.asarray(u).dtype == np.asarray(v).dtype and np.array_equal(u, v) for u, v in zip(la, lb)
    )


def max_rel_diff(a, b) -> float:
    diffs = [
        float(
            np.max(
                np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))
                / np.maximum(np.abs(np.asarray(v, np.float64)), 1e-30),
                initial=0.0,
            )
        )
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    ]
    return max(diffs)


# -- 1. checkpoints ---------------------------------------------------------------------

N = 25


def test_checkpoint_restored_in_a_new_process_continues_bitwise(tmp_path):
    fit = make_fit(2 * N)
    # Reference: 2N steps in one call.
    ref_state, ref_trace = fit(fit.init(init_params()), X, Y)
    assert ref_trace.steps == 2 * N and ref_trace.stop is Stop.STEPS
    # N steps here, then save.
    half, t1 = fit(fit.init(init_params()), X, Y, steps=N)
    ckpt, out = tmp_path / "half.npz", tmp_path / "final.npz"
    checkpoint.save(ckpt, half)
    assert leaves_equal(checkpoint.restore(ckpt, fit.init(init_params())), half)
    # A fresh interpreter restores it, runs N more and saves the result and its losses.
    script = PROBLEM_SRC + textwrap.dedent(
        f"""
        fit = make_fit({2 * N})
        state = checkpoint.restore({str(ckpt)!r}, fit.init(init_params()))
        assert int(state.step) == {N}, int(state.step)
        state, trace = fit(state, X, Y, steps={N})
        checkpoint.save({str(out)!r}, state)
        np.savez({str(tmp_path / "losses.npz")!r}, loss=trace.loss,
                 steps=np.int64(trace.steps), stop=np.int64(int(trace.stop)))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = checkpoint.restore(out, fit.init(init_params()))
    with np.load(tmp_path / "losses.npz", allow_pickle=False) as f:
        t2_loss, t2_steps, t2_stop = f["loss"], int(f["steps"]), int(f["stop"])
    assert (t2_steps, t2_stop) == (N, Stop.STEPS)
    assert isinstance(final, sf.FitState) and int(final.step) == 2 * N == int(ref_state.step)
    assert leaves_equal(final.params, ref_state.params)
    assert leaves_equal(final.opt_state, ref_state.opt_state)  # adam: count, mu, nu
    assert leaves_equal(final.step, ref_state.step)
    assert np.array_equal(np.concatenate([t1.loss, t2_loss]), ref_trace.loss)


def test_checkpoint_of_a_state_holding_prng_keys_continues_bitwise(tmp_path):
    """optax.noisy_sgd keeps a typed PRNG key in its state: saved as its raw bits with its
    implementation's name (NumPy cannot hold key arrays; save failed with JAX's error)."""
    fit = sf.fuse(mlp_loss, optax.noisy_sgd(0.05), steps=6)
    ref, _ = fit(fit.init(init_params()), X, Y)
    half, _ = fit(fit.init(init_params()), X, Y, steps=3)
    checkpoint.save(tmp_path / "noisy.npz", half)
    back = checkpoint.restore(tmp_path / "noisy.npz", jax.eval_shape(fit.init, init_params()))
    assert leaves_equal(
        jax.random.key_data(back.opt_state[0].rng_key),
        jax.random.key_data(half.opt_state[0].rng_key),
    )
    done, _ = fit(back, X, Y, steps=3)
    assert leaves_equal(done.params, ref.params)
    other = sf.fuse(mlp_loss, optax.sgd(0.05), steps=6)
    with pytest.raises(ValueError, match="checkpoint"):
        checkpoint.restore(tmp_path / "noisy.npz", other.init(init_params()))


def test_checkpoint_refuses_pickled_object_arrays(tmp_path):
    fit = make_fit(3)
    like = fit.init(init_params())
    good = tmp_path / "good.npz"
    checkpoint.save(good, like)
    # The same file with one leaf replaced by an object array (which np.savez pickles).
    with np.load(good, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    arrays[".step"] = np.array([{"evil": 1}], dtype=object)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    with pytest.raises(ValueError, match=r"`path`.*object \(pickled\) array.*\.step"):
        checkpoint.restore(bad, like)
    # A plain pickle file is refused as well.
    pkl = tmp_path / "state.pkl"
    np.save(pkl, np.array([object()], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"`path`.*pickle"):
        checkpoint.restore(str(pkl) + ".npy", like)


def test_checkpoint_mismatches_name_the_argument(tmp_path):
    adam = make_fit(3)
    state = adam.init(init_params())
    path = tmp_path / "adam.npz"
    checkpoint.save(path, state)
    sgd = sf.fuse(mlp_loss, optax.sgd(0.1), steps=3)
    with pytest.raises(ValueError, match=r"`like` has \d+ leaves.*`path`"):
        checkpoint.restore(path, sgd.init(init_params()))
    wider = adam.init(mlp_init((2, 8, 2)))
    with pytest.raises(
        ValueError, match=r"`like` has shape \(8,\) at \.params\[0\]\['bias'\].*has \(16,\)"
    ):
        checkpoint.restore(path, wider)
    f16 = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float16) if a.dtype == jnp.float32 else a, state
    )
    with pytest.raises(ValueError, match=r"`like` has dtype float16"):
        checkpoint.restore(path, f16)
    other = tmp_path / "other.npz"
    np.savez(other, a=np.zeros(3))
    with pytest.raises(ValueError, match=r"`path`.*not a stepfuse checkpoint"):
        checkpoint.restore(other, state)
    with pytest.raises(TypeError, match=r"`state`.*numeric arrays"):
        checkpoint.save(tmp_path / "x.npz", {"w": jnp.ones(2), "f": object()})
    assert leaves_equal(checkpoint.restore(path, jax.eval_shape(adam.init, init_params())), state)


# -- 2. determinism ---------------------------------------------------------------------

_FITS: dict = {}


def _run(built, split, mode="fused", opt="adam", fresh=False):
    """Run ``split`` calls; fits are cached per (opt, built, mode) unless ``fresh``."""
    key = (opt, built, mode)
    if fresh or key not in _FITS:
        _FITS[key] = sf.fuse(mlp_loss, OPTS[opt](), steps=built, mode=mode)
    fit = _FITS[key]
    state, losses = fit.init(init_params()), []
    for n in split:
        state, trace = fit(state, X, Y, steps=n)
        assert trace.steps == n
        losses.extend(trace.loss)
    return state, np.asarray(losses, np.float32)


OPTS = {"adam": lambda: optax.adam(0.01), "momentum": lambda: optax.sgd(0.05, momentum=0.9)}


def test_same_inputs_give_bitwise_same_results():
    # Twice with one compiled program, and once more with a freshly built (recompiled) fit.
    runs = [_run(12, [12]), _run(12, [12]), _run(12, [12], fresh=True)]
    for state, loss in runs[1:]:
        assert leaves_equal(state, runs[0][0]) and np.array_equal(loss, runs[0][1])


@pytest.mark.parametrize("opt", OPTS)
def test_splitting_the_steps_into_calls_is_bitwise(opt):
    """1x12, 3x4 and 12x1 calls, of one program and of programs built for 4 and 1 steps.

    Measured on XLA:CPU (jax 0.10): bitwise identical in every case, also against
    the stepwise mode (a separately compiled single-step program). The API promises
    this only "wherever the framework allows"; should an XLA version fuse the loop body
    differently from a single-step program the fallback bound would be 1e-6 relative,
    which the second block checks against a hand-written optax loop.
    """
    ref_state, ref_loss = _run(12, [12], opt=opt)
    for built, split, mode in [
        (12, [4] * 3, "fused"),
        (12, [1] * 12, "fused"),
        (4, [4] * 3, "fused"),
        (1, [1] * 12, "fused"),
        (12, [5, 7], "stepwise"),
    ]:
        state, loss = _run(built, split, mode, opt=opt)
        assert leaves_equal(state, ref_state), (built, split, mode, max_rel_diff(state, ref_state))
        assert np.array_equal(loss, ref_loss), (built, split, mode)
    # Against the usual hand-written optax loop (jax.jit of one step, no stepfuse).
    o = OPTS[opt]()
    params = jax.tree_util.tree_map(jnp.asarray, init_params())
    opt_state = o.init(params)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(mlp_loss)(p, X, Y)
        u, s = o.update(g, s, p)
        return loss, optax.apply_updates(p, u), s

    hand = []
    for _ in range(12):
        loss, params, opt_state = step(params, opt_state)
        hand.append(float(loss))
    assert max_rel_diff(ref_state.params, params) <= 1e-6
    assert max_rel_diff(ref_state.opt_state, opt_state) <= 1e-6
    np.testing.assert_allclose(ref_loss, hand, rtol=1e-6)


# -- 3. long runs and interrupts -----------------------------------------------------------


def test_long_call_with_thinned_trace():
    n, k = 20_000, 1000
    fit = sf.fuse(perceptron_loss, optax.sgd(0.01), steps=n, record_every=k)
    state, trace = fit(fit.init(perceptron_init()), X, Y)
    assert trace.steps == n and trace.stop is Stop.STEPS and int(state.step) == n
    assert trace.loss.shape == (20,) and trace.loss.dtype == np.float32
    assert list(trace.index) == list(range(0, n, k))
    assert trace.loss[0] == pytest.approx(np.log(2), abs=1e-6)
    assert np.all(np.isfinite(trace.loss)) and np.all(np.diff(trace.loss) < 0)
    # The thinned entries are exactly the full trace's every k-th loss (first 3000 steps).
    full = sf.fuse(perceptron_loss, optax.sgd(0.01), steps=3 * k)
    _, ftrace = full(full.init(perceptron_init()), X, Y)
    assert np.array_equal(trace.loss[:3], ftrace.loss[::k])


def test_keyboard_interrupt_from_a_callback_leaves_the_state_usable():
    fired = {"raised": False, "steps": []}

    def callback(step, loss):
        fired["steps"].append(step)
        if step == 6 and not fired["raised"]:
            fired["raised"] = True
            raise KeyboardInterrupt

    fit = sf.fuse(perceptron_loss, optax.adam(0.05), steps=10, callback=callback, every=2)
    state = fit.init(perceptron_init())
    snapshot = jax.tree_util.tree_map(np.array, state)
    with pytest.raises(KeyboardInterrupt):
        fit(state, X, Y)
    assert fired["steps"] == [2, 4, 6]  # nothing reached the host after the interrupt
    assert leaves_equal(jax.tree_util.tree_map(np.asarray, state), snapshot)  # pure: untouched
    # The next call works and equals a run that was never interrupted.
    fired["steps"].clear()
    state, trace = fit(state, X, Y)
    assert trace.steps == 10 and int(state.step) == 10 and fired["steps"] == [2, 4, 6, 8, 10]
    clean = sf.fuse(perceptron_loss, optax.adam(0.05), steps=10)
    cstate, ctrace = clean(clean.init(perceptron_init()), X, Y)
    assert leaves_equal(state, cstate) and np.array_equal(trace.loss, ctrace.loss)
