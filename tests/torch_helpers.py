"""Shared PyTorch problems and optimizers for tests/test_torch.py (seed perceptron, small MLP)."""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F
from helpers import ATOL, CATALOGUES, RTOL, assert_fused, assert_mode  # noqa: F401 (re-exported)
from torch import nn

from stepfuse.problems import blobs, mlp_init, perceptron_init

X_NP, Y_NP = blobs()
X = torch.from_numpy(X_NP)
Y = torch.from_numpy(Y_NP).long()

# name -> factory(params): every optimizer and variant of test_torch.py (tests/helpers.py)
OPTIMIZERS = {
    name: factory
    for name, factory in CATALOGUES["torch"].items()
    if name != "adam_decoupled"
    or "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters
}


def perceptron() -> nn.Module:
    """The seed's 2->2 dense layer: weight of ones, bias of zeros."""
    init = perceptron_init()
    m = nn.Linear(2, 2)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(init["kernel"].T))
        m.bias.copy_(torch.from_numpy(init["bias"]))
    return m


def mlp() -> nn.Module:
    """A 2-16-2 tanh MLP from `stepfuse.problems.mlp_init`."""
    layers = mlp_init(sizes=(2, 16, 2))
    m = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
    with torch.no_grad():
        for lin, p in zip((m[0], m[2]), layers):
            lin.weight.copy_(torch.from_numpy(p["kernel"].T))
            lin.bias.copy_(torch.from_numpy(p["bias"]))
    return m


MODELS = {"perceptron": perceptron, "mlp": mlp}


def make(model_name: str, opt: str | None = None, param_groups=None):
    """(model, optimizer, loss_fn) for a problem; the loss closes over the model."""
    model = MODELS[model_name]()
    if param_groups is not None:
        cls, groups = param_groups(model)
        optimizer = cls(groups)
    else:
        optimizer = OPTIMIZERS[opt](model.parameters())

    def loss_fn(x, y):
        return F.cross_entropy(model(x), y)

    return model, optimizer, loss_fn


def sgd_variants_groups(model):
    """One SGD over the MLP's 4 tensors, one variant per parameter group."""
    w1, b1, w2, b2 = model.parameters()
    return torch.optim.SGD, [
        {"params": [w1], "lr": 0.05},
        {"params": [b1], "lr": 0.05, "momentum": 0.9},
        {"params": [w2], "lr": 0.05, "momentum": 0.9, "nesterov": True},
        {"params": [b2], "lr": 0.05, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.1},
    ]


def reference_steps(model, optimizer, n, x=X, y=Y, scheduler=None):
    """Plain PyTorch: ``n`` times zero_grad / backward / step (then ``scheduler.step()``,
    a per-batch lr schedule, if given); returns the losses."""
    losses = []
    for _ in range(n):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return np.asarray(losses)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def state_of(optimizer):
    """The optimizer state as a list (param order) of {key: tensor clone}."""
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            out.append(
                {
                    k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in st.items()
                }
            )
    return out


def assert_close_lists(a, b, rtol=RTOL, atol=ATOL):
    """Each pair of tensors within ``rtol`` of each other, relative to the tensor's scale
    too: an entry that is the small difference of O(1) values (a weight of 0.0045 after
    updates of weights near 2) carries the rounding of those values. On a Xeon with AVX-512
    the seed perceptron's fused and eager weights (SGD momentum, 8 steps) differ by 1.6e-7
    at such an entry, each 1.5e-7 from a float64 run of the plain loop. ``rtol = atol = 0``
    is still bit for bit."""
    assert len(a) == len(b)
    for u, v in zip(a, b):
        want = _host(v)
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        np.testing.assert_allclose(_host(u), want, rtol=rtol, atol=max(atol, rtol * scale))


# Centered RMSprop's momentum buffer sums g / sqrt(E[g^2] - E[g]^2) over the steps: terms of
# size ~1 whatever the gradient's scale, so a gradient that is a small difference of large
# sums (the perceptron's second input column) carries its float32 rounding, which differs
# between the compiled and the eager kernels, into the buffer at ~1e-6 absolute (1.1e-6 after
# 8 steps on an AMD EPYC with AVX-512; within ATOL on the machines before). The parameters,
# which move by lr times it, still agree to RTOL.
STATE_ATOL = {"rmsprop": {"momentum_buffer": 1e-5}}


def assert_same_state(s1, s2, rtol=RTOL, atol=ATOL, atol_by_key=None):
    assert len(s1) == len(s2)
    for d1, d2 in zip(s1, s2):
        assert set(d1) == set(d2), (set(d1), set(d2))
        for k in d1:
            if d1[k] is None or d2[k] is None:
                assert d1[k] is None and d2[k] is None
                continue
            np.testing.assert_allclose(
                _host(d1[k]),
                _host(d2[k]),
                rtol=rtol,
                atol=(atol_by_key or {}).get(k, atol),
                err_msg=f"state[{k!r}]",
            )


def _host(v):
    return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)


def reset(model_name, model, optimizer):
    """Put a model back to its initial parameters and empty its optimizer state."""
    fresh = MODELS[model_name]()
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.copy_(q)
    optimizer.state.clear()
