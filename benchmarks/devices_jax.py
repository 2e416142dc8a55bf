"""stepfuse.jax on 1 and on N devices: the fused step's time, the collectives the compiled
program holds, and what a host notification (``callback``) costs there.

A tanh MLP (``--batch`` rows of ``--features``, ``--hidden`` units, 10 classes) trained by
Adam on a fixed batch, in four layouts of the same inputs:

- ``1 device``: everything on the first device;
- ``N data``: the batch split over a mesh axis of N devices, parameters replicated;
- ``N fsdp``: a 2 x N/2 grid, the batch split over all N devices and the parameters (and
  Adam's moments) over the grid's second axis.

For each it prints the fused step's time (us/step, a ``--steps``-step call, the best of
``--repeats``; all layouts timed in turn, repeat by repeat, in one process), the same with a
no-op ``callback`` at every ``--every`` steps, and the cost of one notification: the
difference over the notifications sent. On one device the loop reaches the host through
stepfuse's own FFI target; over several it goes through ``jax.debug.callback`` (the FFI
target has no sharding). The collectives are counted in the compiled HLO text (an async
one by its ``-start``); the loop's body holds them, so each runs once a step.

On a CPU host XLA's devices are fake (``--xla_force_host_platform_device_count``, set
here before JAX starts): they share the host's cores, so N devices show the cost of the
SPMD program and its collectives, not a speed-up. On a machine with N accelerators, pass
``--real`` to use them.

Run:  python benchmarks/devices_jax.py [--devices 8] [--steps 300] [--repeats 7]
      [--every 1] [--batch 256] [--features 32] [--hidden 64] [--real]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--real", action="store_true", help="use the machine's own devices")
    return ap.parse_args(argv)


def collectives(text: str) -> dict[str, int]:
    return {k: len(re.findall(rf"\b{k}(?:-start)?\(", text)) for k in COLLECTIVES}


def main(argv=None) -> None:
    args = parse(argv)
    if not args.real:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import stepfuse.jax as sf

    n = args.devices
    devices = jax.devices()[:n]
    if len(devices) < n or n % 2:
        sys.exit(f"--devices {n}: an even number of at most {len(jax.devices())} devices")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.features)).astype("float32")
    y = rng.integers(0, 10, args.batch).astype("int32")
    p0 = {
        "w1": (rng.normal(size=(args.features, args.hidden)) / args.features**0.5).astype("f4"),
        "b1": np.zeros(args.hidden, "float32"),
        "w2": (rng.normal(size=(args.hidden, 10)) / args.hidden**0.5).astype("float32"),
    }

    def loss_fn(p, x, y):
        logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    data = Mesh(np.array(devices), ("data",))
    grid = Mesh(np.array(devices).reshape(2, n // 2), ("data", "fsdp"))

    def put(a, mesh, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    fsdp = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}
    layouts = {
        "1 device": (
            {k: jax.device_put(a, devices[0]) for k, a in p0.items()},
            (jax.device_put(x, devices[0]), jax.device_put(y, devices[0])),
        ),
        f"{n} data": (
            {k: put(a, data, P()) for k, a in p0.items()},
            (put(x, data, P("data")), put(y, data, P("data"))),
        ),
        f"{n} fsdp 2x{n // 2}": (
            {k: put(a, grid, fsdp[k]) for k, a in p0.items()},
            (put(x, grid, P(("data", "fsdp"))), put(y, grid, P(("data", "fsdp")))),
        ),
    }
    fits = {}
    for name, (params, batch) in layouts.items():
        plain = sf.fuse(loss_fn, optax.adam(1e-3), steps=args.steps)
        noted = sf.fuse(
            loss_fn,
            optax.adam(1e-3),
            steps=args.steps,
            callback=lambda step, loss: None,
            every=args.every,
        )
        states = {}
        for kind, fit in (("plain", plain), ("callback", noted)):
            state = fit.init(params)
            state, _ = fit(state, *batch)  # compiles
            jax.block_until_ready(state)
            states[kind] = (fit, state)
        fits[name] = (states, batch, plain._compiled_text(states["plain"][1], *batch))
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.repeats):
        for name, (states, batch, _) in fits.items():
            for kind, (fit, state) in states.items():
                t0 = time.perf_counter()
                new, trace = fit(state, *batch)
                jax.block_until_ready(new)
                seconds = time.perf_counter() - t0
                assert trace.steps == args.steps
                key = (name, kind)
                best[key] = min(best.get(key, float("inf")), seconds)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({len(jax.devices())} devices "
        f"shown); MLP {args.features}-{args.hidden}-10, batch {args.batch}, "
        f"{args.steps}-step calls, best of {args.repeats}"
    )
    notes = args.steps // args.every
    header = f"{'layout':>16} {'us/step':>9} {'+callback':>10} {'us/note':>8}  collectives/step"
    print(header)
    base = best[("1 device", "plain")]
    for name, (_, _, text) in fits.items():
        plain, noted = best[(name, "plain")], best[(name, "callback")]
        counts = ", ".join(f"{k} {v}" for k, v in collectives(text).items() if v) or "none"
        print(
            f"{name:>16} {plain / args.steps * 1e6:9.1f} {noted / args.steps * 1e6:10.1f} "
            f"{(noted - plain) / notes * 1e6:8.1f}  {counts}"
            f"   (x{plain / base:.2f} of 1 device)"
        )
    print(f"us/note: the callback's extra time over the {notes} notifications of a call")


if __name__ == "__main__":
    main()
