"""Cost of `progress=True` (a rich bar updated from inside the fused loop).

Times, in one process per backend, a 100,000-step fused call on the seed perceptron
with and without ``progress=True, every=1000`` and prints the slowdown, in wall time and
in the process's CPU time (all threads; a busy neighbour disturbs it less).

Run:  python benchmarks/progress_overhead.py [--steps 100000] [--backends jax tf torch]
"""

from __future__ import annotations

import argparse
import io
import time

from stepfuse.demo import available_backends
from stepfuse.problems import SEED_LR, blobs, perceptron_init


def _jax_fit(progress, n):
    import optax

    import stepfuse.jax as sf

    x, y = blobs()

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(x @ p["kernel"] + p["bias"], y).mean()

    kw = {"progress": True, "every": 1000} if progress else {}
    fit = sf.fuse(loss_fn, optax.sgd(SEED_LR), steps=n, **kw)
    state = fit.init(perceptron_init())
    return lambda: fit(state, x, y)[1].steps


def _tf_fit(progress, n):
    import keras
    import tensorflow as tf

    import stepfuse.tf as sf

    x, y = (tf.constant(a) for a in blobs())
    p = perceptron_init()
    kernel, bias = tf.Variable(p["kernel"]), tf.Variable(p["bias"])

    def loss_fn(x, y):
        logits = tf.matmul(x, kernel) + bias
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    kw = {"progress": True, "every": 1000} if progress else {}
    fit = sf.fuse(loss_fn, keras.optimizers.SGD(SEED_LR), [kernel, bias], steps=n, **kw)
    return lambda: fit(x, y).steps


def _torch_fit(progress, n):
    import torch

    import stepfuse.torch as sf

    xn, yn = blobs()
    x, y = torch.from_numpy(xn), torch.from_numpy(yn).long()
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    kw = {"progress": True, "every": 1000} if progress else {}
    fit = sf.fuse(lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
                  torch.optim.SGD(model.parameters(), lr=SEED_LR), steps=n, model=model, **kw)
    return lambda: fit(x, y).steps


FITS = {"jax": _jax_fit, "tf": _tf_fit, "torch": _torch_fit}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=[b for b in available_backends() if b in FITS])
    args = ap.parse_args(argv)
    import contextlib

    for backend in args.backends:
        runs = {name: FITS[backend](name == "progress", args.steps) for name in ("plain", "progress")}
        cpu = {name: float("inf") for name in runs}
        wall = dict(cpu)
        with contextlib.redirect_stdout(io.StringIO()):  # keep the bars off the report
            for run in runs.values():
                run()
            for _ in range(args.repeats):
                for name, run in runs.items():
                    t0, w0 = time.process_time(), time.perf_counter()
                    run()
                    cpu[name] = min(cpu[name], time.process_time() - t0)
                    wall[name] = min(wall[name], time.perf_counter() - w0)
        for label, best in (("wall", wall), ("cpu", cpu)):
            us = {k: 1e6 * v / args.steps for k, v in best.items()}
            print(f"{backend} ({label} time): {args.steps} steps, plain {us['plain']:.3f} us/step, "
                  f"progress(every=1000) {us['progress']:.3f} us/step, "
                  f"slowdown {100 * (us['progress'] / us['plain'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
