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

import numpy as np
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


def plain(model, steps, opt=None):
    x, y = data()
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
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
        ("Data-dependent branching: torch.* op returned non-Tensor", "torch.where"),
        ("Could not guard on data-dependent expression FloatTrueDiv(1.0, u0)", "momentum"),
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


def small_net(p=0.0):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(p), nn.Linear(8, 3))


def test_a_parameter_replaced_after_fuse_is_refused_before_anything_runs():
    model = small_net()
    fit = sf.fuse(
        lambda x, y: F.cross_entropy(model(x), y),
        torch.optim.SGD(model.parameters(), lr=0.1),
        steps=2,
    )
    model[3].weight = nn.Parameter(torch.zeros(3, 8))
    with pytest.raises(
        ValueError, match=r"3\.weight \(3, 8\) was replaced after the fit was built"
    ):
        fit(*data())
    assert fit.step == 0 and bool((model[3].weight == 0).all())


def test_modules_rearranged_between_calls_run_as_the_plain_loop_runs_them():
    """A submodule swapped between calls (``model[1] = nn.ReLU()``) is run as the plain
    loop runs it (the fused program kept running the old one, silently), and a module
    replaced with the parameters the optimizer holds (``model[2] = nn.Linear(...)``) is
    refused before anything runs (the program trained the old, detached one, silently).
    The fit evaluates too: its evaluation follows the new modules, with the call's
    ``eval_batch``."""

    def net():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    (model, ref), (x, y) = (net(), net()), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    fit = sf.fuse(loss_fn, opt, steps=STEPS, eval_fn=loss_fn, eval_every=STEPS)

    first, expected = fit(x, y, eval_batch=(x, y)), plain(ref, STEPS, ref_opt)
    assert fit.mode == "fused", fit.fallback_reason
    model[1], ref[1] = nn.ReLU(), nn.ReLU()
    with pytest.warns(RuntimeWarning, match=r"modules changed .*\(1: Tanh -> ReLU\)"):
        second = fit(x, y, eval_batch=(x, y))
    expected += plain(ref, STEPS, ref_opt)
    with torch.no_grad():
        evaluated = F.cross_entropy(ref(x), y).item()
    np.testing.assert_allclose(second.eval.values["value"], [evaluated], rtol=1e-6)
    assert fit.mode == "fused" and fit.compiles == 2, fit.fallback_reason
    np.testing.assert_allclose(np.concatenate([first.loss, second.loss]), expected, rtol=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    held = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    kept, model[2] = model[2], nn.Linear(8, 3)
    with pytest.raises(ValueError, match=r"parameter 2\.weight \(3, 8\) is in no module any more"):
        fit(x, y)
    assert fit.step == 2 * STEPS
    assert all(torch.equal(a, b) for a, b in zip(opt.param_groups[0]["params"], held))
    # torch's hook-based spectral_norm moves the weight to weight_orig, the same tensor: the
    # fit follows it (it had refused it as a replaced parameter), as the plain loop runs it.
    model[2] = kept
    for m in (model, ref):
        torch.manual_seed(5)  # (its power iteration starts from a random vector)
        nn.utils.spectral_norm(m[0])
    with pytest.warns(RuntimeWarning, match=r"parameter 0\.weight -> 0\.weight_orig"):
        third = fit(x, y, eval_batch=(x, y))
    np.testing.assert_allclose(third.loss, plain(ref, STEPS, ref_opt), rtol=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_call_leaves_every_parameters_grad_as_it_found_it():
    """A generator's fit whose loss reads the discriminator: the call's eager steps and
    checks ran backward through the discriminator, whose parameters the optimizer does not
    hold, and added their gradients into its ``.grad`` (one step's worth, fused; every
    step's, stepwise). Every parameter's ``.grad`` is now the tensor it was, unchanged."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    z = torch.randn(8, 2)
    for mode in ("stepwise", "fused"):
        marks = [torch.full_like(p, 7.0) for p in disc.parameters()]
        for p, g in zip(disc.parameters(), marks):
            p.grad = g
        fit = sf.fuse(
            lambda z: disc(gen(z)).mean(),
            torch.optim.SGD(gen.parameters(), lr=0.1),
            steps=2,
            mode=mode,
        )
        assert fit(z).steps == 2 and fit.mode == mode, fit.fallback_reason
        for p, g in zip(disc.parameters(), marks):
            assert p.grad is g and bool((g == 7.0).all()), (mode, p.grad)
        assert all(p.grad is None for p in gen.parameters())
        with pytest.raises(RuntimeError):  # refused by the checks before any step
            fit(torch.randn(8, 3))
        assert all(p.grad is g for p, g in zip(disc.parameters(), marks)), mode


def test_a_parameter_the_optimizer_holds_twice_runs_stepwise_saying_so():
    """A tied weight listed under both names: torch.optim steps it twice a step. The fused
    build failed with an inductor error that never named the cause; the fit now runs
    stepwise from the start, saying why, and equals torch's loop."""

    def tied():
        torch.manual_seed(0)
        emb, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
        head.weight = emb.weight
        return nn.ModuleDict({"emb": emb, "head": head})

    ids = torch.tensor([0, 1, 2, 3, 4, 1])
    losses = {}
    for how in ("fit", "plain"):
        m = tied()
        opt = torch.optim.SGD([m["emb"].weight, m["head"].weight], lr=0.1)
        loss_fn = lambda: F.cross_entropy(m["head"](m["emb"](ids)), ids)  # noqa: E731
        if how == "fit":
            with pytest.warns(RuntimeWarning, match="holds a parameter twice"):
                fit = sf.fuse(loss_fn, opt, steps=3)
            assert fit.mode == "stepwise" and fit.compiles == 0
            losses[how] = (fit().loss, m["emb"].weight.detach().clone())
        else:
            plain_losses = []
            for _ in range(3):
                opt.zero_grad()
                loss = loss_fn()
                loss.backward()
                opt.step()
                plain_losses.append(loss.item())
            losses[how] = (plain_losses, m["emb"].weight.detach().clone())
    np.testing.assert_allclose(losses["fit"][0], losses["plain"][0], rtol=1e-6)
    torch.testing.assert_close(losses["fit"][1], losses["plain"][1])


def test_bare_tensors_run_stepwise_saying_how_to_hold_them_in_a_module():
    """The seed's problem with bare tensors runs stepwise (the fused program swaps
    parameters inside modules), saying how to hold them; held as the message says, it runs
    fused, equal to the plain loop."""
    x, y = data()
    target = x @ torch.tensor([1.0, -2.0, 3.0, 0.5])

    def plain():
        w = torch.zeros(4, requires_grad=True)
        opt, losses = torch.optim.SGD([w], lr=0.05), []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = ((x @ w - target) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, w.detach()

    w = torch.zeros(4, requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"(?s)belong to no nn\.Module.*m\.w = torch"):
        bare = sf.fuse(
            lambda: ((x @ w - target) ** 2).mean(), torch.optim.SGD([w], lr=0.05), steps=STEPS
        )
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(4))
    held = sf.fuse(
        lambda: ((x @ m.w - target) ** 2).mean(), torch.optim.SGD([m.w], lr=0.05), steps=STEPS
    )
    expected, w_expected = plain()
    for fit, param in ((bare, w), (held, m.w)):
        np.testing.assert_allclose(fit().loss, expected, rtol=1e-6)
        torch.testing.assert_close(param.detach(), w_expected)
    assert (bare.mode, held.mode) == ("stepwise", "fused"), held.fallback_reason


def test_a_call_from_the_fits_own_callback_is_refused():
    model = small_net()
    x, y = data()
    calls = []

    def callback(step, loss):
        try:
            fit(x, y, steps=1)
        except RuntimeError as e:
            calls.append(str(e))

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit = sf.fuse(
        lambda x, y: F.cross_entropy(model(x), y),
        opt,
        steps=3,
        callback=callback,
        every=1,
        mode="stepwise",
    )
    assert fit(x, y).steps == 3 and fit.step == 3
    assert len(calls) == 3 and "already running a call" in calls[0]


def test_a_torch_compiled_module_falls_back_saying_to_pass_the_module():
    model = torch.compile(small_net())
    with pytest.warns(RuntimeWarning, match="torch.compile'd module"):
        fit = sf.fuse(
            lambda x, y: F.cross_entropy(model(x), y),
            torch.optim.SGD(model.parameters(), lr=0.1),
            steps=2,
        )
    assert fit.mode == "stepwise"


def test_what_a_callback_or_the_caller_changes_in_the_modules_holds_from_then_on():
    """model.eval() from a callback mid-call, then Dropout's p changed between calls: the
    fused fit runs each as the plain loop does (the rest of the call ran in train mode; p
    was compiled in and silently kept)."""
    x, y = data()
    ref, model = small_net(), small_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for k in range(6):
        if k == 3:
            ref.eval()
        loss = F.cross_entropy(ref(x), y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        want.append(loss.item())

    def callback(step, loss):
        if step == 3:
            model.eval()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit = sf.fuse(
        lambda x, y: F.cross_entropy(model(x), y), opt, steps=6, callback=callback, every=3
    )
    trace = fit(x, y)
    assert fit.mode == "fused", fit.fallback_reason
    torch.testing.assert_close(torch.tensor(trace.loss), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # p changed between calls, in eval mode (no draws): a new program, with a warning
    model[2].p = ref[2].p = 0.5
    with pytest.warns(RuntimeWarning, match=r"Dropout\.p: 0\.0 -> 0\.5") as caught:
        fit(x, y, steps=2)
    assert fit.compiles == 3
    assert {w.filename for w in caught} == {__file__}  # the caller's line


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_a_loss_drawing_from_its_own_generator_draws_what_the_plain_loop_draws(mode):
    # The fit's own eager passes (the probe, the plan's count) drew from the user's
    # generator (torch's own is put back): 1-2 draws more than the plain loop, silently in
    # the stepwise mode; the fused build failed on the Generator after them.
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)

    def run(fitted):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        noise = torch.Generator().manual_seed(123)

        def loss_fn(a, b):
            return F.cross_entropy(model(a + 0.5 * torch.randn(a.shape, generator=noise)), b)

        if not fitted:
            losses = []
            for _ in range(4):
                opt.zero_grad()
                loss = loss_fn(x, y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            return losses, model, noise, None
        fit = sf.fuse(loss_fn, opt, steps=4, mode=mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = list(fit(x, y).loss)
        return losses, model, noise, (fit, caught)

    want, plain, plain_noise, _ = run(False)
    got, model, noise, (fit, caught) = run(True)
    assert fit.mode == "stepwise"
    said = [str(w.message) for w in caught if "torch.Generator" in str(w.message)]
    assert len(said) == (mode == "fused"), [str(w.message) for w in caught]
    assert got == pytest.approx(want, rel=1e-6)
    assert torch.equal(noise.get_state(), plain_noise.get_state())
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)
