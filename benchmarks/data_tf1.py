"""The per-step cost of data streams and evaluation on TF1 (`stepfuse.tf.v1`), on the
seed's problem (a 2->2 dense layer, SGD lr 0.01, the 50 blobs): a fused run of N steps
over a fixed batch of B rows (fed once per run), over `stepfuse.Batches` (N stacked
minibatches of B, fed once per run), over `stepfuse.Epochs` (the 50 points as a resident
dataset, shuffled or not), and over the fixed batch with ``eval_fn`` (the loss on the 50
points every 100 steps). All are built in one process and timed interleaved, one run of
each in turn, ``--runs`` times; the fastest and the median run of each are reported
(us/step; the fastest is the least disturbed by other processes on a shared machine).

    python benchmarks/data_tf1.py [--steps 1000 10] [--batch-size 10] [--runs 300]

``--only fixed`` times the fixed batch alone (to compare two versions of stepfuse in
separate processes, e.g. with PYTHONPATH pointing at each).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import stepfuse as sf  # noqa: E402
import stepfuse.tf.v1 as sf1  # noqa: E402
from stepfuse.problems import SEED_LR, blobs, perceptron_init  # noqa: E402

tf1 = tf.compat.v1
CASES = ("fixed", "batches", "epochs", "epochs_unshuffled", "fixed_eval")


def _ce(x: Any, y: Any, k: Any, b: Any) -> Any:
    logits = tf.matmul(x, k) + b
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def build(case: str, steps: int, bs: int, x: np.ndarray, y: np.ndarray) -> tuple[Any, ...]:
    """``(session, run)``: ``run()`` runs one fused run of ``steps`` steps."""
    p = perceptron_init()
    g = tf.Graph()
    with g.as_default():
        k = tf1.get_variable("kernel", initializer=p["kernel"])
        b = tf1.get_variable("bias", initializer=p["bias"])
        opt = tf1.train.GradientDescentOptimizer(SEED_LR)
        feed: dict[Any, Any] = {}
        if case in ("fixed", "fixed_eval"):
            xp = tf1.placeholder(tf.float32, (None, 2))
            yp = tf1.placeholder(tf.int32, (None,))
            kw: dict[str, Any] = {}
            if case == "fixed_eval":
                xv = tf1.placeholder(tf.float32, (None, 2))
                yv = tf1.placeholder(tf.int32, (None,))
                kw = {"eval_fn": lambda: _ce(xv, yv, k, b), "eval_every": 100}
                feed.update({xv: x, yv: y})
            fit = sf1.fuse(lambda: _ce(xp, yp, k, b), opt, steps=steps, **kw)
            feed.update({xp: x[:bs], yp: y[:bs]})
        elif case == "batches":
            xs = tf1.placeholder(tf.float32, (None, bs, 2))
            ys = tf1.placeholder(tf.int32, (None, bs))
            fit = sf1.fuse(
                lambda xb, yb: _ce(xb, yb, k, b), opt, steps=steps, data=sf.Batches(xs, ys)
            )
            rows = np.arange(steps * bs) % len(x)
            feed = {xs: x[rows].reshape(steps, bs, 2), ys: y[rows].reshape(steps, bs)}
        else:
            data = sf.Epochs(x, y, batch_size=bs, shuffle=case == "epochs", seed=0)
            fit = sf1.fuse(lambda xb, yb: _ce(xb, yb, k, b), opt, steps=steps, data=data)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=g)
    sess.run(init)
    sess.run(fit.train_op, feed)  # compile
    return sess, lambda: sess.run(fit.train_op, feed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 10])
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--runs", type=int, default=300, help="timed runs of each case")
    ap.add_argument("--only", nargs="+", default=list(CASES), choices=CASES)
    args = ap.parse_args(argv)
    x, y = blobs(50)
    for steps in args.steps:
        built = {c: build(c, steps, args.batch_size, x, y) for c in args.only}
        times: dict[str, list[float]] = {c: [] for c in built}
        for _ in range(args.runs):
            for c, (_, run) in built.items():
                t0 = time.perf_counter()
                run()
                times[c].append((time.perf_counter() - t0) / steps * 1e6)
        print(f"N = {steps} steps a run, batch {args.batch_size}, {args.runs} runs each (us/step)")
        for c, ts in times.items():
            print(f"  {c:<18} fastest {min(ts):9.3f}   median {float(np.median(ts)):9.3f}")
        for sess, _ in built.values():
            sess.close()


if __name__ == "__main__":
    main()
