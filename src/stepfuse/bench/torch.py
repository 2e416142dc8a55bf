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

The model sizes (``cnn``: Conv2d + BatchNorm2d; ``lstm``) time the same three contenders;
a fit that cannot fuse such a model runs stepwise, and its mode is printed next to its
time.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

# Small machines: inductor's pool of compile workers would steal the CPU from the
# contenders timed after a compile.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from .. import torch as sf  # noqa: E402
from .problems import (  # noqa: E402
    CNN_CHANNELS,
    CNN_IMAGE,
    LSTM_SEQUENCE,
    LSTM_UNITS,
    MODEL_CLASSES,
    model_data,
    problem,
)

CONTENDERS = ("stepfuse", "eager per step", "torch.compile of one step")
MODEL_SIZES = ("cnn", "lstm")
MODEL_CONTENDERS = ("stepfuse", "eager per step", "torch.compile of one step")
"""The contenders of the model sizes (`stepfuse.bench.problems.MODEL_SIZES`)."""

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
    "cnn": {"stepfuse": 1000, "eager per step": 30, "torch.compile of one step": 30},
    "lstm": {"stepfuse": 1000, "eager per step": 30, "torch.compile of one step": 30},
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


class CNN(nn.Module):
    """The ``cnn`` size (`stepfuse.bench.problems`): conv, BatchNorm2d, ReLU, max pool."""

    def __init__(self):
        super().__init__()
        blocks: list[nn.Module] = []
        channels = CNN_IMAGE[0]
        for out in CNN_CHANNELS:
            blocks += [
                nn.Conv2d(channels, out, 3, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            channels = out
        side = CNN_IMAGE[1] // 2 ** len(CNN_CHANNELS)
        self.net = nn.Sequential(
            *blocks, nn.Flatten(), nn.Linear(channels * side * side, MODEL_CLASSES)
        )

    def forward(self, x):
        return self.net(x)


class LSTMNet(nn.Module):
    """The ``lstm`` size: an LSTM over the sequence, its last output through a linear layer."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(LSTM_SEQUENCE[1], LSTM_UNITS, batch_first=True)
        self.head = nn.Linear(LSTM_UNITS, MODEL_CLASSES)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def model_contenders(size: str, n: int, lr: float = 0.01, chunk: int | None = None) -> Any:
    """Builders for a model size: stepfuse against the plain eager loop. The fit is not
    required to fuse: its mode as it ran is reported with its time (`fit_mode`)."""
    xn, yn = model_data(size)
    x, y = torch.from_numpy(xn), torch.from_numpy(yn).long()

    def model():
        torch.manual_seed(0)
        return CNN() if size == "cnn" else LSTMNet()

    def stepfuse():
        def build():
            net = model()
            opt = torch.optim.SGD(net.parameters(), lr=lr)
            with warnings.catch_warnings():  # a fallback's reason is shown as its mode
                warnings.simplefilter("ignore", RuntimeWarning)
                fit = sf.fuse(
                    lambda x, y: F.cross_entropy(net(x), y),
                    opt,
                    steps=max(n, FUSED_CAPACITY),
                    model=net,
                    chunk=chunk,
                )
            return fit

        fit = _cached(("stepfuse", size, lr, chunk), build)

        def run(m):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                return fit(x, y, steps=m)

        run.fit = fit  # type: ignore[attr-defined]  # its mode goes next to its time
        return run

    builders = {
        "stepfuse": stepfuse,
        "eager per step": lambda: _eager(model(), x, y, lr),
        "torch.compile of one step": lambda: _compiled_step(
            ("compiled step", size, lr), model, x, y, lr
        ),
    }
    return builders, {name: min(n, cap) for name, cap in MAX_TIMED[size].items()}


def _eager(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> Any:
    """The plain loop a user writes: ``zero_grad(); backward(); step()`` per step (SGD)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run(m):
        for _ in range(m):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        return loss.item()

    return run


def _compiled_step(key: tuple, model: Any, x: torch.Tensor, y: torch.Tensor, lr: float) -> Any:
    """``torch.compile`` of the plain step (zero_grad, forward, backward, ``opt.step()``; a
    graph break at ``backward``), built once per ``key`` and called once per step."""

    def build():
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=lr)

        @torch.compile(fullgraph=False)
        def step():
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    step = _cached(key, build)

    def run(m):
        for _ in range(m):
            loss = step()
        return loss.item()

    return run


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
    if size in MODEL_SIZES:
        return model_contenders(size, n, lr, chunk)
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
        return _eager(MLP(layers), x, y, lr)

    def compiled_step():
        return _compiled_step(("compiled step", size, lr), lambda: MLP(layers), x, y, lr)

    builders = {
        "stepfuse": stepfuse,
        "eager per step": eager,
        "torch.compile of one step": compiled_step,
    }
    return builders, {name: min(n, cap) for name, cap in MAX_TIMED[size].items()}
