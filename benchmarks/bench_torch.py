"""PyTorch on the seed problem: eager steps vs torch.compile of one step vs stepfuse.

All contenders train the seed perceptron (2->2 linear, weight ones, bias zeros,
cross-entropy, SGD lr 0.01, 50 blobs) in one process, timed side by side by
`stepfuse.bench._timing.measure`; ``build s`` is the first call (compile included).

Usage:
  python benchmarks/bench_torch.py [--steps 1000 10000] [--json FILE] [--chunk 4]
"""

from __future__ import annotations

import argparse
import os

# 2-core machines: inductor's pool of compile workers would steal the CPU from the
# contenders timed after a compile.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import stepfuse.torch as sf  # noqa: E402
from stepfuse.bench._timing import measure, print_table, write_json  # noqa: E402
from stepfuse.problems import SEED_LR, blobs, perceptron_init  # noqa: E402

X_NP, Y_NP = blobs()
X, Y = torch.from_numpy(X_NP), torch.from_numpy(Y_NP).long()


def seed_model():
    init = perceptron_init()
    m = nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(init["kernel"].T))
        m.bias.copy_(torch.from_numpy(init["bias"]))
    return m


def eager():
    model = seed_model()
    opt = torch.optim.SGD(model.parameters(), lr=SEED_LR)

    def run(n):
        for _ in range(n):
            opt.zero_grad()
            loss = F.cross_entropy(model(X), Y)
            loss.backward()
            opt.step()
        return loss.item()

    return run


def compiled_step():
    """torch.compile of one whole step (forward, backward, optimizer), called n times."""
    model = seed_model()
    opt = torch.optim.SGD(model.parameters(), lr=SEED_LR)

    @torch.compile(fullgraph=False)
    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        opt.step()
        return loss

    def run(n):
        for _ in range(n):
            loss = step()
        return loss.item()

    return run


def fused(steps, chunk):
    def build():
        model = seed_model()
        opt = torch.optim.SGD(model.parameters(), lr=SEED_LR)
        fit = sf.fuse(lambda x, y: F.cross_entropy(model(x), y), opt, steps=steps, chunk=chunk)
        assert fit.mode == "fused", fit.fallback_reason

        def run(n):
            return fit(X, Y, steps=n)

        run.fit = fit
        return run

    return build


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--chunk", type=int, default=4, help="steps per compiled loop iteration")
    ap.add_argument("--eager-steps", type=int, default=300, help="steps per timed eager call")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    results = []
    for n in args.steps:
        contenders = {
            "eager stepwise": eager,
            "torch.compile(step) x N": compiled_step,
            "stepfuse": fused(n, args.chunk),
        }
        steps_for = {"eager stepwise": min(n, args.eager_steps), "torch.compile(step) x N": min(n, 1000)}
        results += measure(contenders, n, backend="torch", problem="seed perceptron",
                           steps_for=steps_for, repeats=3)
    print_table(results, title=f"stepfuse.torch, seed problem (chunk={args.chunk}, {torch.get_num_threads()} threads)")
    if args.json:
        write_json(results, args.json, torch=torch.__version__, chunk=args.chunk)


if __name__ == "__main__":
    main()
