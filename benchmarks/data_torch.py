"""PyTorch data streams: stepfuse over `Epochs` against the minibatch loops a torch user writes.

All contenders train the same tanh MLP with Adam (lr 1e-3) on the same 8,192 resident
synthetic rows, reshuffled every epoch, in one process, interleaved round by round
(`stepfuse.bench.data` builds them; `stepfuse bench --backend torch --sizes data-small
data-mnist` runs the same rows):

- ``stepfuse``: ``fit(sf.Epochs(x, y, batch_size=B), steps=N)``, one fused call;
- ``eager DataLoader``: the eager loop over a shuffling ``DataLoader(TensorDataset(x, y),
  batch_size=B, shuffle=True, drop_last=True)``;
- ``eager (resident rows)``: the eager loop indexing the resident tensors with a
  ``torch.randperm`` drawn each epoch;
- ``torch.compile step``: that loop with the model and ``opt.step`` compiled.

Problems: ``small`` (MLP 32-64-10, batch 32) and ``mnist`` (MLP 784-256-10, batch 128). The
first call of each contender (which compiles) is not timed; each round times every contender
once (stepfuse on ``--steps``, the others on ``--loop-steps``); the best of ``--rounds`` is
printed in microseconds a step with each one's time over stepfuse's. Measurements: the
performance page of the docs.

Usage:
  python benchmarks/data_torch.py [--problems small mnist] [--steps 2048] [--loop-steps 512]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from stepfuse.bench import data  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", default=["small", "mnist"], choices=["small", "mnist"])
    ap.add_argument("--steps", type=int, default=2048, help="steps per timed stepfuse call")
    ap.add_argument("--loop-steps", type=int, default=512, help="steps per timed loop call")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(
        f"stepfuse.torch data streams, {data.ROWS} rows, Adam 1e-3, {torch.get_num_threads()} threads"
    )
    print(f"{'problem':8} {'contender':22} {'us/step':>10} {'/stepfuse':>9}  note")
    rows = []
    for name in args.problems:
        builders, _ = data.contenders("torch", f"data-{name}", args.steps)
        runs, notes = {}, {}
        for who, build in builders.items():
            run = build()
            m = args.steps if who == "stepfuse" else args.loop_steps
            t0 = time.perf_counter()
            run(m)  # compiles where it compiles
            notes[who] = f"first call {time.perf_counter() - t0:.1f} s"
            fit = getattr(run, "fit", None)
            if fit is not None:
                notes[who] += f", mode={fit.mode}, compiles={fit.compiles}"
            runs[who] = (run, m)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.rounds):
            for who, (run, m) in runs.items():
                t0 = time.perf_counter()
                run(m)
                best[who] = min(best[who], (time.perf_counter() - t0) / m)
        for who, s in best.items():
            ratio = s / best["stepfuse"]
            print(f"{name:8} {who:22} {s * 1e6:10.1f} {ratio:8.2f}x  {notes[who]}")
            rows.append({"problem": name, "contender": who, "us_per_step": s * 1e6})
            fit = getattr(runs[who][0], "fit", None)
            if fit is not None:
                rows[-1]["mode"] = fit.mode
    return rows


if __name__ == "__main__":
    main()
