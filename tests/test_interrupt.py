"""Ctrl-C (SIGINT) while a program calls fit in a loop leaves a consistent state, on every backend.

A child process fits the seed perceptron with Adam in an endless loop of fused calls (of 3 steps for
torch, to make many write-backs); the
test sends it SIGINT at a random moment (during a call or between calls). The child then
checks that parameters, optimizer state and step counter all belong to the same step:
they must equal a fresh run of exactly that many steps.
"""

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import slow_params

from stepfuse.demo import available_backends

# Each child: (set-up ending with one warm call of `call()`, the check after the loop).
# Between them every child runs LOOP: calls until Ctrl-C, telling the parent where it is.
LOOP = """
import signal
print("ready", flush=True)
try:
    while True:
        call()
except KeyboardInterrupt:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent may send more
    print("interrupted", flush=True)
"""

CHILDREN = {
    "jax": (
        """
        import jax, numpy as np, optax
        import stepfuse.jax as sf
        from stepfuse.problems import blobs, perceptron_init
        x, y = blobs()
        def loss(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(x @ p["kernel"] + p["bias"], y).mean()
        def make():
            fit = sf.fuse(loss, optax.adam(0.01), steps=300)
            return fit, fit.init(perceptron_init())
        fit, state = make()
        def call():
            global state
            state, _ = fit(state, x, y)
        call()
    """,
        """
        n = int(state.step)
        ref, rstate = make()
        while int(rstate.step) < n:
            rstate, _ = ref(rstate, x, y, steps=min(300, n - int(rstate.step)))
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(state),
                                                         jax.tree_util.tree_leaves(rstate)))
        print("CONSISTENT" if same else "INCONSISTENT", n, flush=True)
    """,
    ),
    "tf": (
        """
        import keras, numpy as np, tensorflow as tf
        import stepfuse.tf as sf
        from stepfuse.problems import blobs, perceptron_init
        x, y = (tf.constant(a) for a in blobs())
        def make():
            p = perceptron_init()
            k, b = tf.Variable(p["kernel"]), tf.Variable(p["bias"])
            def loss(x, y):
                logits = tf.matmul(x, k) + b
                return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            opt = keras.optimizers.Adam(0.01)
            return sf.fuse(loss, opt, [k, b], steps=300), opt, [k, b]
        fit, opt, vs = make()
        def call():
            fit(x, y)
        call()
    """,
        """
        n = fit.step
        ref, ropt, rvs = make()
        while ref.step < n:
            ref(x, y, steps=min(300, n - ref.step))
        same = int(opt.iterations.numpy()) == n and all(
            np.allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7) for a, b in zip(vs, rvs))
        print("CONSISTENT" if same else "INCONSISTENT", n, flush=True)
    """,
    ),
    "torch": (
        """
        import numpy as np, torch
        import stepfuse.torch as sf
        from stepfuse.problems import blobs, perceptron_init
        xn, yn = blobs()
        x, y = torch.from_numpy(xn), torch.from_numpy(yn).long()
        def make(mode):
            p = perceptron_init()
            model = torch.nn.Linear(2, 2)
            with torch.no_grad():
                model.weight.copy_(torch.from_numpy(p["kernel"].T.copy()))
                model.bias.zero_()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            fit = sf.fuse(lambda x, y: torch.nn.functional.cross_entropy(model(x), y), opt,
                          steps=3, model=model, mode=mode)
            return fit, opt, model
        fit, opt, model = make("fused")
        def call():
            fit(x, y)
        call()
    """,
        """
        n = fit.step
        ref, ropt, rmodel = make("fused")
        ref(x, y, steps=n)  # one long fused call of the same program
        steps_ok = all(int(opt.state[p]["step"]) == n for p in model.parameters())
        same = steps_ok and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                                for a, b in zip(model.parameters(), rmodel.parameters()))
        print("CONSISTENT" if same else "INCONSISTENT", n, flush=True)
    """,
    ),
}


# torch's child compiles its fit (about a minute of CI): --runslow.
@pytest.mark.parametrize(
    "backend",
    slow_params([b for b in CHILDREN if b in available_backends()], {"torch"}),
)
def test_sigint_leaves_parameters_state_and_step_consistent(backend):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TORCHINDUCTOR_COMPILE_THREADS="1")
    setup, check = CHILDREN[backend]
    # A child inherits an ignored SIGINT (pytest started under nohup or as a background
    # job): give it Python's own handler, as a program started from a terminal has.
    handler = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    script = handler + textwrap.dedent(setup) + LOOP + textwrap.dedent(check)
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    time.sleep(0.7)
    # Like a user pressing Ctrl-C again if the first press lands where it is held back; the
    # child answers "interrupted" once it has caught KeyboardInterrupt.
    for _ in range(10):
        child.send_signal(signal.SIGINT)
        if select.select([child.stdout], [], [], 3)[0]:
            assert child.stdout.readline().strip() == "interrupted"
            break
    else:
        child.kill()
        raise AssertionError("the child ignored 10 SIGINTs")
    out, err = child.communicate(timeout=240)
    assert child.returncode == 0, err[-3000:]
    verdict, n = out.split()
    assert verdict == "CONSISTENT" and int(n) > 10, (out, err[-2000:])
