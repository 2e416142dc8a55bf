"""stepfuse.torch on model code that changes Python state in ``forward``, or that the fused
program cannot trace: the forward passes the fit runs for its own checks (the probe, the
plan) leave nothing behind, and a failed build leaves torch as it found it.

- A buffer assigned a new tensor in ``forward`` (``self.ema = 0.9 * self.ema + ...``, not
  updated in place) and a Python counter (``self.calls += 1``): after the fit they equal the
  plain loop's (the probe's and the plan's forward passes had been left in them).
- ``torch.utils.checkpoint(use_reentrant=False)``: the fused build fails and the fit runs
  stepwise, equal to the plain loop, and a plain ``backward()`` still works afterwards
  (the failed trace had left autograd's saved-tensor hooks off for the whole process).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import stepfuse.torch as sf

STEPS = 4


class Averaging(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 3)
        self.register_buffer("ema", torch.zeros(4))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * x.mean(0)  # a new tensor each time
            self.calls += 1
        return self.lin(x - self.ema)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(checkpoint(lambda z: torch.tanh(self.a(z)), x, use_reentrant=False))


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def plain(model, steps):
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fused(model, steps):
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit = sf.fuse(lambda x, y: F.cross_entropy(model(x), y), opt, steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = fit(x, y)
    return fit, trace, [str(w.message) for w in caught]


@pytest.mark.parametrize("net", [Averaging, Checkpointed], ids=["reassigned-buffer", "checkpoint"])
def test_forward_state_and_autograd_are_left_as_the_plain_loop_leaves_them(net):
    ref, model = net(), net()
    want = plain(ref, STEPS)
    fit, trace, caught = fused(model, STEPS)
    print(fit.mode, caught)
    torch.testing.assert_close(torch.tensor(trace.loss), torch.tensor(want), rtol=1e-6, atol=1e-7)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if net is Averaging:
        assert model.calls == ref.calls == STEPS
    else:  # a plain step still runs in this process
        assert fit.mode == "stepwise" and "could not be built" in caught[0]
        assert plain(model, 1)


@pytest.mark.parametrize(
    "text, hint",
    [
        ("Unsafe side effect: Attempted to mutate ConstDictVariable()", "in place"),
        ("body_fn might be modifying the input!", "max_norm"),
        ("Attempted to wrap sparse Tensor", "sparse=False"),
        ("some other failure", None),
    ],
)
def test_a_build_failure_says_what_to_change_where_dynamo_names_the_cause(text, hint):
    from stepfuse.torch._failure import build_failure

    reason = build_failure(RuntimeError(text))
    assert text in reason and reason.endswith("(pass mode='stepwise' to silence this warning)")
    if hint is None:
        assert "What to change" not in reason
    else:
        assert "What to change" in reason and hint in reason
