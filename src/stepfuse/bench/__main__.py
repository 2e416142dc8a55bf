"""One backend's part of ``stepfuse bench``, run in its own process.

``python -m stepfuse.bench --backend jax --sizes seed mlp --steps 10 1000 --json out.json``
"""

from __future__ import annotations

import argparse
import importlib
import os

from . import data
from ._timing import measure, print_table, write_json
from .problems import MAX_STEPS, SIZES

MODULES = {
    "jax": "stepfuse.bench.jax",
    "tf": "stepfuse.bench.tf",
    "tf1": "stepfuse.bench.tf1",
    "torch": "stepfuse.bench.torch",
}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m stepfuse.bench")
    ap.add_argument("--backend", required=True, choices=sorted(MODULES))
    ap.add_argument("--sizes", nargs="+", default=["seed"])
    ap.add_argument("--steps", nargs="+", type=int, default=[1000])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    module = importlib.import_module(MODULES[args.backend])
    results = []
    # The MLP sizes run on every backend; a model size (problems.MODEL_SIZES) on the
    # backends whose module lists it in MODEL_SIZES.
    # The data-stream rows (`stepfuse.bench.data`) on the backends it has contenders for.
    supported = (*SIZES, *getattr(module, "MODEL_SIZES", ()))
    if args.backend in data.CONTENDERS:
        supported += data.DATA_SIZES
    for size in args.sizes:
        if size not in supported:
            continue
        for n in args.steps:
            if n > MAX_STEPS[size]:
                continue
            if size in data.DATA_SIZES:
                builders, steps_for = data.contenders(args.backend, size, n)
            else:
                builders, steps_for = module.contenders(size, n)
            rows = measure(
                builders,
                n,
                backend=args.backend,
                problem=size,
                repeats=2 if args.quick else 5,
                steps_for=steps_for,
                min_seconds=0.0 if args.quick else 0.6,
            )
            for r in rows:
                r.note = getattr(module, "NOTES", {}).get(r.contender, "")
            results += rows
    print_table(results, title=f"{args.backend}")
    if args.json:
        write_json(results, args.json)


if __name__ == "__main__":
    main()
