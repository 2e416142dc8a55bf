"""A 1,000,000-step TF2 fused call on the seed perceptron: memory stays flat, the trace is thinned.

One ``fit(x, y)`` call (one ``tf.function`` call; XLA inner loop) runs every step; with
``record_every=1000`` the trace holds 1,000 float32 losses whatever the number of steps.
Prints the peak RSS (``resource.getrusage``) before and after the call, the wall time
of the call (traced and compiled beforehand by a 1-step call) and the time per step.

Run:  python benchmarks/long_run_tf.py [--steps 1000000] [--record-every 1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import stepfuse.tf as sf  # noqa: E402
from stepfuse import Stop  # noqa: E402
from stepfuse.problems import SEED_LR, blobs, perceptron_init  # noqa: E402


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--record-every", type=int, default=1000)
    args = ap.parse_args(argv)
    n, k = args.steps, args.record_every

    x, y = (tf.constant(a) for a in blobs())
    p = perceptron_init()
    kernel, bias = tf.Variable(p["kernel"]), tf.Variable(p["bias"])

    def loss_fn(x, y):
        logits = tf.matmul(x, kernel) + bias
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    opt = keras.optimizers.SGD(SEED_LR)
    fit = sf.fuse(loss_fn, opt, [kernel, bias], steps=n, record_every=k)
    t0 = time.perf_counter()
    fit(x, y, steps=1)  # traces and compiles the one program used below
    compile_s = time.perf_counter() - t0
    rss_before = peak_rss_mib()

    t0 = time.perf_counter()
    trace = fit(x, y)  # the long call: same program, one tf.function call
    wall = time.perf_counter() - t0
    rss_after = peak_rss_mib()

    expected = -(-n // k)
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}; seed perceptron, SGD({SEED_LR}), XLA={fit.jit_compile}")
    print(f"steps              {n:,} in one fused call (record_every={k})")
    print(f"trace + compile    {compile_s:.2f} s (1-step call)")
    print(f"wall time          {wall:.3f} s")
    print(f"per step           {wall / n * 1e6:.3f} us")
    print(f"peak RSS before    {rss_before:.1f} MiB")
    print(f"peak RSS after     {rss_after:.1f} MiB  (+{rss_after - rss_before:.1f} MiB)")
    print(f"trace              {trace!r}")
    print(f"trace points       {len(trace.loss)} (expected {expected}); index "
          f"{trace.index[0]}, {trace.index[1] if len(trace.index) > 1 else '-'}, ..., {trace.index[-1]}")
    print(f"loss               first {trace.loss[0]:.6f}, last {trace.loss[-1]:.6f}; "
          f"fit.step {fit.step:,}, optimizer.iterations {int(opt.iterations):,}; traces {fit.traces}")
    ok = (len(trace.loss) == expected and trace.steps == n and trace.stop == Stop.STEPS
          and fit.step == n + 1 and int(opt.iterations) == n + 1 and np.all(np.isfinite(trace.loss))
          and fit.traces == 1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
