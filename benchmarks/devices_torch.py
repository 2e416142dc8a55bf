"""The fused torch step on one process and on two (gloo on 127.0.0.1), and the collectives
a step runs.

Each run fuses the same MLP and SGD over the same global batch of ``--rows`` rows: one
process takes all of it, each of two ranks half (the gradients averaged over the ranks at
every step inside the compiled program, `stepfuse.torch._dist.Sync`). Every process runs
on one thread. A process times ``--calls`` calls of ``--steps`` steps after a warm-up call
(which compiles), and counts, with ``torch.profiler`` over one call, the collectives that
call ran per step (the ``gloo:`` events: gloo runs one for each functional ``all_reduce``
the program calls).

The two processes share the machine's cores with each other (and, on a shared VM, with
whatever else runs): read the ratio of the step times, not the absolute figures.

Usage:
  python benchmarks/devices_torch.py [--rows 256] [--width 256] [--steps 200] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args: argparse.Namespace) -> dict:
    """One process's run (a rank of two under ``WORLD_SIZE=2``): its step time and counts."""
    import torch
    import torch.nn.functional as F

    import stepfuse.torch as sft

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 32, generator=g)
    y = torch.randint(0, 10, (args.rows,), generator=g)
    rows = args.rows // world
    xs, ys = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    fit = sft.fuse(
        lambda a, b: F.cross_entropy(model(a), b), opt, steps=args.steps, chunk=1, model=model
    )
    t0 = time.perf_counter()
    fit(xs, ys)  # compiles
    compile_s = time.perf_counter() - t0
    fit(xs, ys)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fit(xs, ys)
    names = [e.name for e in prof.events()]
    gloo = sum(n.startswith("gloo:") for n in names)  # the process group's own collectives
    times = []
    for _ in range(args.calls):
        t = time.perf_counter()
        fit(xs, ys)
        times.append(time.perf_counter() - t)
    weight = model[0].weight.detach()
    return {
        "world": world,
        "rank": rank,
        "mode": fit.mode,
        "compile_s": compile_s,
        "step_us": min(times) / args.steps * 1e6,
        "collectives_per_step": gloo / args.steps,
        "weight_sum": float(weight.sum()),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, argv: list[str]) -> list[dict]:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", *argv],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a process exited with {p.returncode}:\n{stderr[-4000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="rows of the global batch")
    ap.add_argument("--width", type=int, default=256, help="hidden units of the MLP")
    ap.add_argument("--steps", type=int, default=200, help="steps a call")
    ap.add_argument("--calls", type=int, default=5, help="timed calls (the fastest counts)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_run(args)))
        return
    argv = [f"--{k}={getattr(args, k)}" for k in ("rows", "width", "steps", "calls")]
    one = _launch(1, argv)
    two = _launch(2, argv)
    print(f"MLP 32-{args.width}-10, global batch {args.rows} rows, {args.steps} steps a call")
    print(
        f"{'processes':>9} {'rank':>4} {'mode':>6} {'step us':>9} {'compile s':>9} {'coll/step':>9}"
    )
    for r in one + two:
        print(
            f"{r['world']:>9} {r['rank']:>4} {r['mode']:>6} {r['step_us']:>9.1f} "
            f"{r['compile_s']:>9.1f} {r['collectives_per_step']:>9.2f}"
        )
    slow = max(r["step_us"] for r in two)
    print(f"step on 2 processes / step on 1: {slow / one[0]['step_us']:.2f}")
    same = two[0]["weight_sum"] == two[1]["weight_sum"]
    print(f"parameters identical on both ranks: {same}")


if __name__ == "__main__":
    main()
