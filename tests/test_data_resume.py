"""A fit over `stepfuse.Epochs` saved at step k and restored in a NEW process continues
with exactly the minibatches, parameters and losses of the run that never stopped.

Each backend's case is one script, run twice in fresh Python processes (the same code, so
the same model): run ``first`` runs k steps, saves a checkpoint with the backend's own
tools, then runs the remaining steps in the same process (the uninterrupted run); run
``resumed`` builds the fit anew, restores the checkpoint and runs the remaining steps.
The calls cross epoch boundaries (the minibatch of global step t depends on the step
count the checkpoint holds), and both runs are fused. Parameters and the losses of the
remaining steps must be equal bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import slow_params

from stepfuse.demo import available_backends

K, REST = 7, 11  # 8 rows / batch 2 = 4 steps an epoch: both parts cross epoch boundaries

# Each script defines `fit`, `data`, `save(path)`, `restore(path)`, `params()`, `call(n)`.
SCRIPTS = {
    "jax": """
        import jax.numpy as jnp, numpy as np, optax
        import stepfuse as sf, stepfuse.jax as sfj
        from stepfuse import checkpoint

        rng = np.random.default_rng(0)
        x = rng.normal(size=(8, 3)).astype("float32")
        y = rng.integers(0, 2, 8).astype("int32")

        def loss_fn(p, xb, yb):
            logits = jnp.tanh(xb @ p["w1"]) @ p["w2"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        init = {"w1": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                "w2": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}
        fit = sfj.fuse(loss_fn, optax.adam(1e-2), steps=16)
        state = fit.init(init)
        data = sf.Epochs(x, y, batch_size=2, seed=3)

        def save(path):
            checkpoint.save(path + "/fit.npz", state)

        def restore(path):
            global state
            state = checkpoint.restore(path + "/fit.npz", fit.init(init))

        params = lambda: [np.asarray(state.params[k]) for k in sorted(state.params)]

        def call(n):
            global state
            state, trace = fit(state, data, steps=n)
            return trace

    """,
    "tf": """
        import keras, numpy as np, tensorflow as tf
        import stepfuse as sf, stepfuse.tf as sft

        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(8, 3)).astype("float32")
        y = rng.integers(0, 2, 8).astype("int32")
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.Dense(2)])
        ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        fit = sft.fuse(lambda xb, yb: ce(yb, model(xb)), keras.optimizers.Adam(1e-2), model,
                       steps=16, jit_compile=True)
        data = sf.Epochs(x, y, batch_size=2, seed=3)
        # (as an attribute: `import stepfuse.tf` alone did not import the module)
        save = lambda path: sft.checkpoint.save(path + "/fit", fit)
        restore = lambda path: sft.checkpoint.restore(path + "/fit", fit)
        params = lambda: [v.numpy() for v in model.trainable_variables]
        call = lambda n: fit(data, steps=n)
    """,
    "tf1": """
        import numpy as np, tensorflow as tf
        import stepfuse as sf, stepfuse.tf.v1 as sf1
        tf1 = tf.compat.v1
        tf1.disable_eager_execution()

        rng = np.random.default_rng(0)
        x = rng.normal(size=(8, 3)).astype("float32")
        y = rng.integers(0, 2, 8).astype("int32")
        w1 = tf1.get_variable("w1", initializer=rng.normal(size=(3, 4)).astype("float32"))
        w2 = tf1.get_variable("w2", initializer=rng.normal(size=(4, 2)).astype("float32"))

        def loss_fn(xb, yb):
            logits = tf.matmul(tf.tanh(tf.matmul(xb, w1)), w2)
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))

        data = sf.Epochs(x, y, batch_size=2, seed=3)
        fit = sf1.fuse(loss_fn, tf1.train.AdamOptimizer(1e-2), steps=16, data=data,
                        jit_compile=True)
        saver = tf1.train.Saver()  # every variable: the fit's step count and Adam's state too
        sess = tf1.Session()
        sess.run(tf1.global_variables_initializer())
        save = lambda path: saver.save(sess, path + "/fit")
        restore = lambda path: saver.restore(sess, path + "/fit")
        params = lambda: sess.run([w1, w2])
        call = lambda n: fit.run(sess, steps=n)
        step_count = lambda: sess.run(fit.counter)
    """,
    "torch": """
        import numpy as np, torch
        import torch.nn.functional as F
        import stepfuse as sf, stepfuse.torch as sft

        torch.manual_seed(0)
        x = torch.randn(8, 3)
        y = (x.sum(1) > 0).long()
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        fit = sft.fuse(lambda xb, yb: F.cross_entropy(model(xb), yb), opt, steps=16,
                       model=model)
        data = sf.Epochs(x, y, batch_size=2, seed=3)

        def save(path):
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": fit.step}, path + "/fit.pt")

        def restore(path):
            ckpt = torch.load(path + "/fit.pt", weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            fit.step = ckpt["step"]

        params = lambda: [p.detach().numpy().copy() for p in model.parameters()]
        call = lambda n: fit(data, steps=n)
    """,
}

RUN = """
import sys
run, path = sys.argv[1], sys.argv[2]
def step():  # JAX: the FitState's; TF1: the graph's step count
    if "step_count" in globals():
        return int(step_count())
    return int(state.step) if "state" in globals() else fit.step
assert fit.mode == "fused", fit.mode
if run == "first":
    call({K})
    save(path)
else:
    restore(path)
trace = call({REST})
assert fit.mode == "fused", fit.mode
np.savez(path + "/" + run + ".npz", *params(), loss=np.asarray(trace.loss),
         step=np.asarray(step()))
"""


def _run(script: str, run: str, path: Path) -> dict[str, np.ndarray]:
    code = textwrap.dedent(script) + RUN.format(K=K, REST=REST)
    proc = subprocess.run(
        [sys.executable, "-c", code, run, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"the {run!r} process failed:\n{proc.stderr[-4000:]}"
    with np.load(path / f"{run}.npz") as f:
        return {k: f[k] for k in f.files}


# torch (its program compiled in each of three processes), TF1 and TF2 (whose new-process
# checkpoint restore is test_reliability_tf's) run with --runslow; the in-process resume of
# every backend is tested with its data streams.
@pytest.mark.parametrize(
    "backend",
    slow_params(sorted(SCRIPTS), {"torch", "tf1", "tf"}),
)
def test_epochs_fit_restored_in_a_new_process_continues_exactly(backend, tmp_path) -> None:
    if backend not in available_backends():
        pytest.skip(f"{backend} is not installed")
    first = _run(SCRIPTS[backend], "first", tmp_path)
    resumed = _run(SCRIPTS[backend], "resumed", tmp_path)
    assert int(first["step"]) == int(resumed["step"]) == K + REST
    assert first["loss"].shape == (REST,)
    assert np.isfinite(first["loss"]).all()
    for key in first:
        np.testing.assert_array_equal(resumed[key], first[key], err_msg=key)
