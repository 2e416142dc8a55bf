"""The floor of a compiled torch ``while_loop`` on the CPU: time per iteration against the
number of tensors it carries.

Inductor's C++ wrapper runs a ``while_loop`` without Python, but every tensor an iteration
produces is a new buffer (``aoti_torch_empty_strided``: c10's CPU allocator, a 64-byte
aligned ``posix_memalign``, and a TensorImpl), freed when the next iteration replaces it.
A loop body that only updates ``k`` carried tensors shows what one buffer costs an
iteration, whatever the arithmetic; stepfuse's fused step produces a dozen buffers on the
seed (docs/internals/torch.md), so this bounds how fast a step can get on this path.

Usage:
  python benchmarks/torch_loop_floor.py [--carried 1 4 16] [--iterations 100000]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._higher_order_ops.while_loop import while_loop


def loop_of(k: int):
    def f(n, x):
        def cond(i, *xs):
            return i < n

        def body(i, *xs):
            return (i + 1, *[v * 1.0001 + 0.5 for v in xs])

        start = (torch.zeros((), dtype=torch.int64), *[x.clone() for _ in range(k)])
        return while_loop(cond, body, start)

    return f


def backend(gm, example_inputs):
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    with config.patch({"cpp_wrapper": True}):
        return compile_fx(gm, example_inputs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carried", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--shapes", nargs="+", default=["()", "(50, 2)"])
    ap.add_argument("--iterations", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; thread CPU time")
    for k in args.carried:
        for shape_text in args.shapes:
            shape = eval(shape_text)  # noqa: S307 - a shape literal from the command line
            f = torch.compile(loop_of(k), backend=backend, fullgraph=True, dynamic=False)
            x, n = torch.zeros(shape), torch.tensor(args.iterations)
            f(torch.tensor(1), x)
            best = min(_timed(f, n, x) for _ in range(args.repeats))
            per = best / args.iterations * 1e9
            print(f"{k:3d} carried of shape {shape_text:8s}: {per:7.0f} ns an iteration")


def _timed(f, n, x):
    t0 = time.thread_time()
    f(n, x)
    return time.thread_time() - t0


if __name__ == "__main__":
    main()
