"""PyTorch contenders: stepfuse's fused call against the loops a PyTorch user would write.

Every contender trains the same problem (`stepfuse.bench.problems.problem`: tanh MLP,
softmax cross-entropy, ``torch.optim.SGD(lr=0.01)``, full batch) on the CPU.

Compiles are the expensive part here (10-30 s each on a small CPU), so the compiled
contenders are built **once per size** and cached in this module: the ``stepfuse``
fit is built with a capacity that serves every N (one compiled program runs any
``steps``), and the compiled single step is reused as well. Their ``build s`` is the
full compile for the first N of a size and only the warm-up call for the others.
Timing continues the training from where the previous N left off (SGD on these
problems stays finite for far longer than the benchmark runs).
"""

from __future__ import annotations

import os
from typing import Any

# Small machines: inductor's pool of compile workers would steal the CPU from the
# contenders timed after a compile.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from .. import torch as sf  # noqa: E402
from .problems import problem  # noqa: E402

CONTENDERS = ("stepfuse", "eager per step", "torch.compile of one step")

NOTES = {
    "stepfuse": "stepfuse.torch: one compiled while_loop (inductor, C++ wrapper) per call segment, "
    "trace of every loss, finite checks",
    "eager per step": "zero_grad(); loss.backward(); opt.step() in Python, eager",
    "torch.compile of one step": "torch.compile of zero_grad + forward + backward + opt.step, "
    "called once per step (graph break at backward)",
}

FUSED_CAPACITY = 10_000
"""``steps`` the cached fit is built with: larger than every N, so one program serves all."""

MAX_TIMED = {  # size -> contender -> at most this many steps per timed call
    "seed": {"eager per step": 100, "torch.compile of one step": 300},
    "mlp": {"stepfuse": 200, "eager per step": 30, "torch.compile of one step": 30},
    "wide": {"stepfuse": 10, "eager per step": 5, "torch.compile of one step": 5},
}
"""Caps on the steps of one timed call, so ``stepfuse bench --quick`` stays short on a
small CPU (the per-step time is what is compared; the ``N`` column of a result is the
number of steps actually timed). The seed's stepfuse runs the full N."""


class MLP(nn.Module):
    """The benchmark MLP from ``{"kernel", "bias"}`` layers: ``tanh`` between linear layers."""

    def __init__(self, layers):
        super().__init__()
        self.linears = nn.ModuleList()
        for layer in layers:
            fan_in, fan_out = layer["kernel"].shape
            lin = nn.Linear(fan_in, fan_out)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(layer["kernel"].T))
                lin.bias.copy_(torch.from_numpy(layer["bias"]))
            self.linears.append(lin)

    def forward(self, x):
        for lin in self.linears[:-1]:
            x = torch.tanh(lin(x))
        return self.linears[-1](x)


def data(size: str) -> Any:
    """``(layers, x, y)`` of a size as torch tensors (labels int64, as cross_entropy wants)."""
    layers, xn, yn = problem(size)
    return layers, torch.from_numpy(xn), torch.from_numpy(yn).long()


_CACHE: dict = {}
"""(contender, size, lr) -> its built state, so every N of a size reuses one compile."""


def _cached(key, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def contenders(size: str, n: int, lr: float = 0.01, chunk: int | None = None) -> Any:
    """Builders (see `stepfuse.bench._timing.measure`) for every PyTorch contender on ``size``."""
    layers, x, y = data(size)
    kw: dict[str, Any] = {} if chunk is None else {"chunk": chunk}

    def stepfuse():
        def build():
            model = MLP(layers)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            fit = sf.fuse(
                lambda x, y: F.cross_entropy(model(x), y),
                opt,
                steps=max(n, FUSED_CAPACITY),
                model=model,
                **kw,
            )
            assert fit.mode == "fused", fit.fallback_reason
            return fit

        fit = _cached(("stepfuse", size, lr, chunk), build)

        def run(m):
            return fit(x, y, steps=m)  # returns a host Trace: blocks

        run.fit = fit  # type: ignore[attr-defined]  # read by the benchmark scripts
        return run

    def eager():
        model = MLP(layers)
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def run(m):
            for _ in range(m):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            return loss.item()

        return run

    def compiled_step():
        def build():
            model = MLP(layers)
            opt = torch.optim.SGD(model.parameters(), lr=lr)

            @torch.compile(fullgraph=False)
            def step():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                return loss

            return step

        step = _cached(("compiled step", size, lr), build)

        def run(m):
            for _ in range(m):
                loss = step()
            return loss.item()

        return run

    builders = {
        "stepfuse": stepfuse,
        "eager per step": eager,
        "torch.compile of one step": compiled_step,
    }
    return builders, {name: min(n, cap) for name, cap in MAX_TIMED[size].items()}
