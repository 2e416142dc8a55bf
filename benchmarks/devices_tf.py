"""A TF2 fit on one device against the same fit under a MirroredStrategy of several
logical CPU devices: microseconds per step (fused calls), the first call's time, and the
collective operations a step runs (counted in the traced program: the loop body holds one
step, so its collectives are those of every step).

Logical devices share the machine's cores, so on a CPU this measures the strategy's
overhead (splitting the batch, the all-reduce, the mirrored updates), not a speed-up.

    python benchmarks/devices_tf.py [--devices 2] [--steps 200] [--size mlp] [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

SIZES = {"seed": ((2, 2), 50), "mlp": ((2, 64, 64, 2), 1024), "data-small": ((32, 64, 10), 32)}


def _collectives(fit: Any) -> dict[str, int]:
    """Op types of the fit's traced programs that talk across devices, and their counts."""
    counts: collections.Counter = collections.Counter()
    for concrete in fit._concrete.values():
        graph = concrete.graph.as_graph_def()
        nodes = list(graph.node)
        for function in graph.library.function:
            nodes += function.node_def
        counts.update(n.op for n in nodes if "Collective" in n.op or "Nccl" in n.op)
    return dict(counts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--size", default="mlp", choices=sorted(SIZES))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices
    )
    import keras
    import numpy as np

    import stepfuse.tf as sf

    dims, rows = SIZES[args.size]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(rows, dims[0])).astype("float32"))
    y = tf.constant(rng.integers(0, dims[-1], rows).astype("int32"))
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model() -> Any:
        keras.utils.set_random_seed(0)
        layers: list[Any] = [keras.Input((dims[0],))]
        layers += [keras.layers.Dense(d, activation="tanh") for d in dims[1:-1]]
        return keras.Sequential([*layers, keras.layers.Dense(dims[-1])])

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.devices)])
    contenders: dict[str, Any] = {}
    for name, scope, jit in (
        ("1 device (auto)", None, "auto"),
        ("1 device, no XLA", None, False),
        (f"{args.devices} devices (MirroredStrategy)", strategy, "auto"),
    ):
        t0 = time.perf_counter()
        if scope is None:
            m, opt = model(), keras.optimizers.SGD(0.01)
        else:
            with scope.scope():
                m, opt = model(), keras.optimizers.SGD(0.01)
        fit = sf.fuse(lambda a, b, m=m: ce(b, m(a)), opt, m, steps=args.steps, jit_compile=jit)
        fit(x, y)
        contenders[name] = (fit, time.perf_counter() - t0)
    best = dict.fromkeys(contenders, float("inf"))
    for r in range(args.rounds):
        for name in list(contenders) if r % 2 == 0 else list(contenders)[::-1]:
            fit = contenders[name][0]
            t0 = time.perf_counter()
            fit(x, y)
            best[name] = min(best[name], (time.perf_counter() - t0) / args.steps)
    print(f"{args.size} ({rows} rows), {args.steps} steps a call, best of {args.rounds} rounds:")
    for name, (fit, first) in contenders.items():
        print(
            f"  {name:34s} {1e6 * best[name]:9.1f} us/step  first call {first:6.2f} s  "
            f"xla={fit.plan['xla']}  collectives per step: {_collectives(fit) or 'none'}"
        )


if __name__ == "__main__":
    main()
