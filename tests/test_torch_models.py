"""Real torch models fused: each equals the plain ``zero_grad / backward / step`` loop.

A small model zoo (CNN with BatchNorm2d and dropout, a BatchNorm1d MLP with a frozen
layer, LSTM, GRU, an embedding with a TransformerEncoderLayer with dropout, tied weights),
each fused over two calls of three steps against six plain steps under the same
``torch.manual_seed``: losses, parameters, buffers (running statistics,
``num_batches_tracked``) and the optimizer state; dropout must draw the plain loop's
masks (attention's too). Gradient clipping runs inside the loop as ``clip_grad_norm_`` /
``clip_grad_value_`` between ``backward()`` and ``step()``.

Compiles: one program per fit below (tiny shapes); fits are shared across assertions.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_fused, slow_params
from torch import nn

import stepfuse.torch as sf
from stepfuse import Stop

RTOL, ATOL = 1e-6, 1e-7
CALLS = (3, 3)


def plain_loop(model, optimizer, loss_fn, batch, n, clip_norm=None, clip_value=None):
    """The reference: ``n`` plain steps, clipping between backward() and step()."""
    losses = []
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for _ in range(n):
        optimizer.zero_grad()
        loss = loss_fn(*batch)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, clip_value)
        optimizer.step()
        losses.append(float(loss.detach()))
    return np.array(losses)


def _close(got, want, what, rtol=RTOL, atol=ATOL):
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.is_floating_point():
        np.testing.assert_allclose(
            got.double().numpy(), want.double().numpy(), rtol=rtol, atol=atol, err_msg=what
        )
    else:
        assert torch.equal(got, want), what


def assert_same_training(a, b, rtol=RTOL, atol=ATOL):
    """Models ``a`` and ``b`` (with their optimizers) ended at the same point."""
    (ma, oa), (mb, ob) = a, b
    for (name, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items()):
        _close(x, y, name, rtol, atol)  # parameters and buffers (running stats, counts)
    pa = [p for g in oa.param_groups for p in g["params"]]
    pb = [p for g in ob.param_groups for p in g["params"]]
    for i, (p, q) in enumerate(zip(pa, pb)):
        assert (p in oa.state) == (q in ob.state), f"state of parameter {i}"
        for k, v in oa.state.get(p, {}).items():
            w = ob.state[q][k]
            if isinstance(v, torch.Tensor):
                _close(v, w, f"state {k} of parameter {i}", rtol, atol)
            else:
                assert v == w, f"state {k} of parameter {i}"


# -- the zoo: build() -> (model, optimizer, loss_fn, batch), under a fixed seed ------------


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False),  # BatchNorm follows: no bias
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 3),
    )
    x, y = torch.randn(6, 1, 6, 6), torch.randint(0, 3, (6,))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, lambda x, y: F.cross_entropy(model(x), y), (x, y)


def bn_mlp():
    """BatchNorm1d with its first layer frozen inside an AdamW with weight decay: the
    frozen layer takes no update, no state and no decay."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return model, opt, lambda x, y: F.cross_entropy(model(x), y), (x, y)


class Recurrent(nn.Module):
    def __init__(self, cell, layers):
        super().__init__()
        self.rnn = cell(4, 8, num_layers=layers, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def lstm():
    torch.manual_seed(2)
    model = Recurrent(nn.LSTM, 1)
    x, y = torch.randn(4, 3, 4), torch.randint(0, 2, (4,))  # 3 time steps: compile time
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    return model, opt, lambda x, y: F.cross_entropy(model(x), y), (x, y)


def gru():
    torch.manual_seed(3)
    model = Recurrent(nn.GRU, 2)
    x, y = torch.randn(4, 3, 4), torch.randint(0, 2, (4,))  # 3 time steps: compile time
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, lambda x, y: F.cross_entropy(model(x), y), (x, y)


class Tied(nn.Module):
    """An embedding whose output layer reuses its weight (weight tying)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, t):
        return self.out(torch.tanh(self.emb(t)))


def tied():
    torch.manual_seed(4)
    model = Tied()
    t = torch.randint(0, 10, (6,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5, weight_decay=0.01)
    return model, opt, lambda t, y: F.cross_entropy(model(t), y), (t, torch.roll(t, 1))


class Encoder(nn.Module):
    """An embedding, a TransformerEncoderLayer with dropout (batch first: its attention's
    output, which dropout1 takes, is a transposed view) and a head.

    Without biases: the key's share of attention's input bias has a gradient of pure
    rounding noise (softmax ignores a shift of every score of a row), which Adam divides
    by its own size and turns into steps of about ``lr`` in a direction any other rounding
    flips; the loss never sees that bias, the comparison of parameters would."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layer = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.45, batch_first=True, bias=False
        )
        self.head = nn.Linear(8, 2)

    def forward(self, t):
        return self.head(self.layer(self.emb(t)).mean(1))


def transformer():
    torch.manual_seed(5)
    model = Encoder()
    t, y = torch.randint(0, 10, (4, 5)), torch.randint(0, 2, (4,))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, lambda t, y: F.cross_entropy(model(t), y), (t, y)


class Attention(nn.Module):
    """Each way torch's attention layers run dropout in training, in one model (one
    program): nn.MultiheadAttention sequence first with a key padding mask
    (scaled_dot_product_attention with dropout and an additive mask), batch first with
    need_weights=True (its own softmax and F.dropout, a boolean attn_mask), a
    TransformerEncoderLayer with norm_first=True and a causal mask, and
    scaled_dot_product_attention called with a boolean mask and with is_causal."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.seq_first = nn.MultiheadAttention(8, 2, dropout=0.15)
        self.weights = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, norm_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, t, pad):
        x = self.emb(t)  # (batch, seq, 8)
        s = x.transpose(0, 1)
        a, _ = self.seq_first(s, s, s, key_padding_mask=pad, need_weights=False)
        n = t.shape[1]
        banded = torch.ones(n, n, dtype=torch.bool).triu(2)  # True: may not attend
        b, w = self.weights(x, x, x, attn_mask=banded, need_weights=True)
        causal = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.layer(a + b.transpose(0, 1) * w.mean(), src_mask=causal, is_causal=True)
        q = h.transpose(0, 1).unflatten(-1, (2, 4)).transpose(1, 2)  # (batch, heads, seq, 4)
        p = 0.25 if self.training else 0.0
        keep = F.scaled_dot_product_attention(q, q, q, attn_mask=~banded, dropout_p=p)
        tri = F.scaled_dot_product_attention(q, keep, keep, dropout_p=p / 2, is_causal=True)
        return self.head(tri.transpose(1, 2).flatten(2).mean(1) + h.mean(0))


def attention():
    torch.manual_seed(6)
    model = Attention()
    t, y = torch.randint(0, 10, (3, 4)), torch.randint(0, 2, (3,))
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[0, -1] = pad[2, -2:] = True
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    return model, opt, lambda t, pad, y: F.cross_entropy(model(t, pad), y), (t, pad, y)


class Padded(nn.Module):
    """nn.MultiheadAttention with dropout, sequence first, with a key padding mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.15)
        self.head = nn.Linear(8, 2)

    def forward(self, t, pad):
        s = self.emb(t).transpose(0, 1)  # (seq, batch, 8)
        a, _ = self.attn(s, s, s, key_padding_mask=pad, need_weights=False)
        return self.head(a.mean(0))


def padded():
    torch.manual_seed(7)
    model = Padded()
    t, y = torch.randint(0, 10, (3, 4)), torch.randint(0, 2, (3,))
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[0, -1] = pad[2, -2:] = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    return model, opt, lambda t, pad, y: F.cross_entropy(model(t, pad), y), (t, pad, y)


ZOO = {
    "cnn": cnn,
    "bn_mlp": bn_mlp,
    "lstm": lstm,
    "gru": gru,
    "tied": tied,
    "transformer": transformer,
}
CLIP = {"cnn": dict(clip_grad_norm=0.5), "lstm": dict(clip_grad_value=0.05)}


def fused_and_plain(build, calls=CALLS, **kw):
    """``(fused fit, its losses, fused (model, opt), plain losses, plain (model, opt))``."""
    model, opt, loss_fn, batch = build()
    fit = sf.fuse(loss_fn, opt, steps=calls[0], model=model, **kw)
    torch.manual_seed(11)
    losses = np.concatenate([fit(*batch, steps=n).loss for n in calls])
    r_model, r_opt, r_loss, r_batch = build()
    torch.manual_seed(11)
    clip = dict(clip_norm=kw.get("clip_grad_norm"), clip_value=kw.get("clip_grad_value"))
    ref = plain_loop(r_model, r_opt, r_loss, r_batch, sum(calls), **clip)
    return fit, losses, (model, opt), ref, (r_model, r_opt)


# CI compiles the cnn, bn_mlp and lstm fits (about 30-70 s each on a 2-core CPU); gru (an
# RNN as lstm), tied and transformer (attention dropout is also the padded-mask test's) run
# with --runslow.
SLOW_ZOO = ("gru", "tied", "transformer")


@pytest.fixture(
    scope="module",
    params=slow_params(sorted(ZOO), SLOW_ZOO),
)
def zoo_fit(request):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent fallback
        return request.param, fused_and_plain(ZOO[request.param], **CLIP.get(request.param, {}))


def test_zoo_model_is_fused_and_equals_the_plain_loop(zoo_fit):
    name, (fit, losses, got, ref, want) = zoo_fit
    assert_fused(fit)
    assert fit.compiles == 1, fit.compiles
    assert fit.step == sum(CALLS)
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    assert_same_training(got, want)


def test_batchnorm_statistics_move_every_step(zoo_fit):
    name, (fit, _, (model, _opt), _, (ref, _)) = zoo_fit
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        pytest.skip(f"{name} has no BatchNorm")
    for bn in bns:
        assert int(bn.num_batches_tracked) == sum(CALLS)
        assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))


def test_frozen_parameters_take_no_update_no_state_and_no_decay(zoo_fit):
    name, (fit, _, (model, opt), _, _) = zoo_fit
    if name != "bn_mlp":
        pytest.skip("the frozen layer is bn_mlp's")
    init = bn_mlp()[0][0]  # the seed's initial weights again
    for p, q in zip(model[0].parameters(), init.parameters()):
        assert torch.equal(p, q)
        assert p not in opt.state


def test_a_refused_step_leaves_batchnorm_statistics_at_the_last_finite_point(zoo_fit):
    name, (fit, _, (model, _opt), _, _) = zoo_fit
    if name != "bn_mlp":
        pytest.skip("bn_mlp's fit")
    x = torch.randn(8, 4)
    x[0, 0] = math.nan  # same shapes: the same program
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace = fit(x, torch.zeros(8, dtype=torch.long), steps=2)
    assert trace.stop == Stop.NONFINITE and trace.steps == 0
    assert fit.compiles == 1 and fit.mode == "fused"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_attention_dropout_with_a_key_padding_mask_draws_the_plain_loops_masks():
    """nn.MultiheadAttention's dropout (scaled_dot_product_attention's, with the padding
    as an additive mask) fused equals the plain loop: the same masks drawn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent fallback
        fit, losses, got, ref, want = fused_and_plain(padded)
    assert_fused(fit)
    assert fit.compiles == 1 and fit.chunk == 1, (fit.compiles, fit.chunk)
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    assert_same_training(got, want)


@pytest.mark.slow
def test_every_attention_path_with_dropout_equals_the_plain_loop_and_eval_stays_fused():
    """Each way torch's attention layers draw dropout (`Attention`) fused equals the plain
    loop; the same fit in eval mode (no dropout) runs fused and equals it too."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent fallback
        fit, losses, got, ref, want = fused_and_plain(attention)
    assert_fused(fit)
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    assert_same_training(got, want)
    (model, _), (r_model, r_opt) = got, want
    model.eval()
    r_model.eval()
    batch = attention()[3]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        evals = fit(*batch, steps=2).loss
    assert_fused(fit)
    ref_evals = plain_loop(
        r_model, r_opt, lambda t, pad, y: F.cross_entropy(r_model(t, pad), y), batch, 2
    )
    np.testing.assert_allclose(evals, ref_evals, rtol=RTOL, atol=ATOL)
    assert_same_training(got, want)


def _outputs_grads_and_rng(fn, inputs):
    """``fn(*inputs)``, the gradients of a weighted sum of it, and the random state after."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    torch.manual_seed(7)
    out = fn(*xs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights).sum().backward()
    return [out.detach(), *(x.grad for x in xs if x.grad is not None), torch.get_rng_state()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_programs_dropout_and_attention_are_torchs_own_bit_for_bit_eagerly(dtype):
    """What the program runs for F.dropout and F.scaled_dot_product_attention with dropout
    (`stepfuse.torch._draws`) equals torch's own functions eagerly, bit for bit: values,
    gradients and the random state after, over input layouts and masks (p = 0.15 is one
    where native_dropout's own scaling differs in the last bit)."""
    from stepfuse.torch import _draws

    torch.manual_seed(0)
    layouts = [
        torch.randn(3, 4, 5, dtype=dtype),
        torch.randn(5, 3, 4, dtype=dtype).transpose(0, 1),
        torch.randn(3, 4, 10, dtype=dtype)[..., ::2],
        torch.randn(2, 3, 4, 5, dtype=dtype).to(memory_format=torch.channels_last),
    ]
    for p in (0.15, 0.5):
        for x in layouts:
            got = _outputs_grads_and_rng(lambda x: _draws.eager_dropout(x, p), [x])
            want = _outputs_grads_and_rng(lambda x: F.dropout(x, p), [x])
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (p, x.stride())
    q, k, v = (torch.randn(2, 2, n, 4, dtype=dtype) for n in (3, 5, 5))
    masks = {
        "none": {},
        "bool": dict(attn_mask=torch.rand(3, 5) > 0.3),
        "additive": dict(attn_mask=torch.randn(2, 1, 3, 5, dtype=dtype)),
        "causal": dict(is_causal=True),
        "scale": dict(scale=0.3),
    }
    for name, kw in masks.items():
        got = _outputs_grads_and_rng(
            lambda q, k, v: _draws.eager_attention(q, k, v, dropout_p=0.15, **kw), [q, k, v]
        )
        want = _outputs_grads_and_rng(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.15, **kw),
            [q, k, v],
        )
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


def test_a_draw_the_program_cannot_match_falls_back_naming_the_op(monkeypatch):
    """The safety net: a random op the program draws otherwise than eager torch (here
    dropout as functorch's form draws it under torch.func.grad, its mask laid out
    contiguously, on a transposed input) is caught at the first fused step; the fit falls
    back naming the op, and equals the plain loop."""
    from stepfuse.torch import _draws

    monkeypatch.setattr(_draws, "eager_dropout", _draws._DROPOUT)

    def build():
        torch.manual_seed(0)
        model = nn.Linear(8, 1)
        x = torch.randn(8, 6)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, lambda x: model(F.dropout(x.t(), 0.5)).square().mean(), (x,)

    with pytest.warns(RuntimeWarning, match=r"draws random numbers \(aten.bernoulli_"):
        fit, losses, got, ref, want = fused_and_plain(build)
    assert fit.mode == "stepwise" and "loss or buffers" in fit.fallback_reason
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    assert_same_training(got, want)


@pytest.mark.parametrize(
    "kw", [dict(clip_grad_norm=0.1), dict(clip_grad_value=0.01)], ids=["norm", "value"]
)
def test_stepwise_clipping_equals_the_plain_loop(kw):
    fit, losses, got, ref, want = fused_and_plain(bn_mlp, mode="stepwise", **kw)
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    assert_same_training(got, want)
    _, _, _, plain, _ = fused_and_plain(bn_mlp, mode="stepwise")
    assert not np.allclose(losses, plain)  # the clipping did clip


@pytest.mark.parametrize(
    "name, value, exc",
    [
        ("clip_grad_norm", 0.0, ValueError),
        ("clip_grad_norm", -1.0, ValueError),
        ("clip_grad_value", math.inf, ValueError),
        ("clip_grad_value", "1", TypeError),
        ("clip_grad_norm", True, TypeError),
    ],
)
def test_bad_clipping_arguments_are_named(name, value, exc):
    model, opt, loss_fn, _ = bn_mlp()
    with pytest.raises(exc, match=f"`{name}`"):
        sf.fuse(loss_fn, opt, steps=2, **{name: value})


def test_an_optimizer_over_frozen_parameters_only_is_refused():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="`optimizer`.*requires_grad"):
        sf.fuse(lambda x: model(x).sum(), torch.optim.SGD(model.parameters(), lr=0.1), steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("build", [cnn, bn_mlp, lstm, gru, tied], ids=lambda b: b.__name__)
@pytest.mark.parametrize("chunk", [1, 3])
def test_zoo_over_chunks_and_odd_calls(build, chunk):
    fit, losses, got, ref, want = fused_and_plain(build, calls=(2, 5, 1), chunk=chunk)
    assert_fused(fit)
    np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
    assert_same_training(got, want)
