"""Every ``torch.optim`` optimizer fused: the fused fit equals torch's plain loop.

The default run fits a sample (one configuration per optimizer the fused mode gained,
and one of the first five: one compile each, on the seed perceptron with ``chunk=1``;
Adafactor's with all its options at once; CI three of them, ``SLOW_SAMPLE`` with --runslow);
the full sweep over torch's own test database (``optim_db``, every CPU configuration) is
the slow test at the end, also ``benchmarks/torch_optim_sweep.py``. Each fit runs its
steps in two calls and is compared with the plain ``zero_grad / backward / step`` loop of
as many single steps: losses, parameters and the whole ``optimizer.state``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import warnings

import numpy as np
import pytest
import torch
from helpers import assert_fused, slow_params

import stepfuse.torch as sft
from stepfuse.problems import blobs
from stepfuse.torch import _rules

_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "torch_optim_sweep.py"
_SPEC = importlib.util.spec_from_file_location("torch_optim_sweep", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
sweep = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("torch_optim_sweep", sweep)  # dynamo reads its loss_fn's module by name
_SPEC.loader.exec_module(sweep)

RTOL, ATOL = 1e-6, 1e-7

# (class, options, steps per call): options chosen to reach each rule's branches within
# two calls (ASGD's averaging once step > t0, RAdam's rectification from step 6).
SAMPLE = {
    "asgd_t0": (torch.optim.ASGD, dict(lr=0.05, t0=2, lambd=0.1, weight_decay=0.1), 3),
    "adadelta_tensor_lr": (
        torch.optim.Adadelta,
        dict(lr=torch.tensor(0.5), weight_decay=0.1, maximize=False, rho=0.95),
        3,
    ),
    "adamax_maximize": (
        torch.optim.Adamax,
        dict(lr=0.1, weight_decay=0.1, maximize=True),
        3,
    ),
    "nadam_decoupled": (
        torch.optim.NAdam,
        dict(lr=0.01, weight_decay=0.1, momentum_decay=0.006, decoupled_weight_decay=True),
        3,
    ),
    "radam_rectified": (torch.optim.RAdam, dict(lr=0.01, weight_decay=0.1), 4),
    "rprop_etas": (torch.optim.Rprop, dict(lr=0.01, etas=(0.5, 1.5)), 3),
    "adagrad_lr_decay": (
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.5, weight_decay=0.1, initial_accumulator_value=0.1),
        3,
    ),
    # the perceptron's weight takes the factored state (row_var, col_var), its bias the
    # variance; every option of optim_db's Adafactor entries at once
    "adafactor_options": (
        torch.optim.Adafactor,
        dict(lr=0.02, weight_decay=0.1, maximize=True, d=1.5, beta2_decay=-0.9),
        3,
    ),
}


def _config(name):
    cls, kwargs, _ = SAMPLE[name]
    return sweep.Config(cls, name, kwargs)


def _assert_same(got: dict, ref: dict) -> None:
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=RTOL, atol=ATOL, err_msg=k)


# CI compiles three of the sample (RAdam, Rprop, and Adafactor, whose update takes a path
# of its own: `stepfuse.torch._adafactor`); ASGD, Adadelta, Adamax, NAdam and Adagrad
# (update code of the same form as theirs and Adam's) run with --runslow.
SLOW_SAMPLE = {
    "asgd_t0",
    "adadelta_tensor_lr",
    "adamax_maximize",
    "nadam_decoupled",
    "adagrad_lr_decay",
}


@pytest.mark.parametrize("name", slow_params(sorted(SAMPLE), SLOW_SAMPLE))
def test_fused_equals_the_plain_loop_over_split_calls(name):
    config = _config(name)
    got = _fused_over_two_calls_equals_the_plain_loop(
        lambda: sweep.problem(config), SAMPLE[name][2]
    )
    assert any(k.startswith("state") for k in got)  # the whole state was compared


def _fused_over_two_calls_equals_the_plain_loop(make, per_call: int) -> dict:
    """Two fused calls of ``per_call`` steps against ``2 * per_call`` plain steps, each on
    a fresh ``make()`` problem: losses, parameters and optimizer state. The program
    compiled before torch created the state serves the state it created (each key
    shaped, typed and placed as torch makes it): one compile for both calls."""
    model, opt, loss_fn, batch = make()
    ref_losses = sweep.plain_loop(model, opt, loss_fn, batch, 2 * per_call)
    ref = sweep.flat(model, opt)
    model, opt, loss_fn, batch = make()
    fit = sft.fuse(loss_fn, opt, steps=per_call, model=model, chunk=1)
    assert_fused(fit)
    losses = np.concatenate([fit(*batch).loss, fit(*batch).loss])
    assert_fused(fit)
    assert fit.compiles == 1, fit.compiles
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL, err_msg="losses")
    got = sweep.flat(model, opt)
    _assert_same(got, ref)
    return got


def test_scalar_state_keeps_torchs_dtype_and_device():
    """ASGD's ``eta`` / ``mu`` and NAdam's ``mu_product`` stay the 0-dim float tensors
    torch made (placeholders match them, so nothing recompiles)."""
    for cls, keys in (
        (torch.optim.ASGD, ("step", "eta", "mu")),
        (torch.optim.NAdam, ("step", "mu_product")),
    ):
        model, opt, loss_fn, batch = sweep.problem(sweep.Config(cls, "default", {}))
        sweep.plain_loop(model, opt, loss_fn, batch, 1)
        p = next(model.parameters())
        group = opt.param_groups[0]
        for k in keys:
            made, stand_in = opt.state[p][k], _rules.placeholder(opt, k, p, group)
            assert (made.shape, made.dtype, made.device) == (
                stand_in.shape,
                stand_in.dtype,
                stand_in.device,
            ), (cls.__name__, k)


def _muon_problem():
    """Two layers whose weights (4 x 2, 2 x 4) take both of Newton-Schulz's orientations;
    the biases are not Muon's (it takes 2-D parameters only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x_np, y_np = blobs()
    x, y = torch.from_numpy(x_np).float(), torch.from_numpy(y_np).long()
    opt = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.05)

    def loss_fn(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    return model, opt, loss_fn, (x, y)


def test_muon_fused_equals_the_plain_loop_under_its_inductor_options():
    """Muon's bfloat16 Newton-Schulz iterations equal eager torch's: the program applies
    the rule's inductor options (emulate_precision_casts) over its own."""
    assert _rules.RULES[torch.optim.Muon].inductor["emulate_precision_casts"] is True
    got = _fused_over_two_calls_equals_the_plain_loop(_muon_problem, 3)
    assert "state0.momentum_buffer" in got


@pytest.mark.parametrize("foreach", [None, True])
def test_adafactor_op_computes_torchs_own_update_bit_for_bit(foreach):
    """The op the fused program calls runs torch's own Adafactor update: from the same
    parameters, gradients and state, three of its steps equal three ``step()`` bit for
    bit (its single-tensor and foreach forms), over a 3-D, a 2-D, a 1-D and a 0-dim
    parameter; the keys a parameter has not are empty stand-ins, never written."""
    from stepfuse.torch import _adafactor

    torch.manual_seed(0)
    shapes = [(2, 3, 4), (5, 3), (6,), ()]
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    opt = torch.optim.Adafactor(params, lr=0.05, weight_decay=0.1, foreach=foreach)
    mine = [p.detach().clone() for p in params]
    state = {k: [_adafactor.placeholder(k, p) for p in params] for k in _adafactor.KEYS}
    for step in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        h = _rules.hyper(opt.param_groups[0])
        _adafactor.update(mine, grads, state, h, False)
        for i, p in enumerate(params):
            assert torch.equal(mine[i], p.detach()), (step, i)
            for k in _adafactor.KEYS:
                if _adafactor.held(k, p):
                    assert torch.equal(state[k][i], opt.state[p][k]), (step, i, k)
                else:
                    assert k not in opt.state[p] and state[k][i].numel() == 0, (step, i, k)


def test_adafactor_on_another_device_than_the_cpu_runs_stepwise_saying_why():
    """The op reads values on the host inside the loop, which a CUDA graph cannot
    capture: parameters off the CPU (here on the meta device) fall back, with the reason,
    when the fit is built."""
    model = torch.nn.Linear(2, 2, device="meta")
    opt = torch.optim.Adafactor(model.parameters())
    with pytest.warns(RuntimeWarning, match="Adafactor.*GPU it runs stepwise"):
        fit = sft.fuse(lambda x: model(x).sum(), opt, steps=2, model=model)
    assert fit.mode == "stepwise" and "CUDA graph" in fit.fallback_reason


def test_every_optimizer_but_the_refused_ones_has_a_rule_reading_all_its_options():
    classes = {
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    }
    assert classes - set(_rules.RULES) == set(_rules.NOT_FUSED)
    ignored = set(_rules.IGNORED_GROUP_KEYS)
    for cls, handled in _rules.HANDLED.items():
        params = [torch.zeros(2, 2, requires_grad=True)]
        assert set(cls(params).defaults) - ignored == handled, cls.__name__


@pytest.mark.parametrize(
    "cls,option,error",
    [
        (torch.optim.Adam, "differentiable", RuntimeError),
        (torch.optim.NAdam, "capturable", AssertionError),
        (torch.optim.Rprop, "differentiable", RuntimeError),
    ],
)
def test_options_whose_step_raises_raise_before_any_compile(cls, option, error):
    """The plain loop's step() raises for these on CPU; the fused fit raises the same class
    at its first call, before compiling anything, and changes nothing."""
    model, opt, loss_fn, batch = sweep.problem(sweep.Config(cls, option, {option: True}))
    with pytest.raises(error):  # what plain torch does
        m2, o2, l2, b2 = sweep.problem(sweep.Config(cls, option, {option: True}))
        sweep.plain_loop(m2, o2, l2, b2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    fit = sft.fuse(loss_fn, opt, steps=3, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: an error
        with pytest.raises(error, match=f"{option}=True"):
            fit(*batch)
    assert fit.compiles == 0 and fit.step == 0 and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.slow
def test_every_optim_db_cpu_configuration_fuses_exactly_or_falls_back_with_its_reason():
    pytest.importorskip("expecttest")  # torch's optim_db imports it
    rows = sweep.main([], out=lambda line: None)
    bad = [r for r in rows if r.verdict in ("WRONG", "ERROR")]
    assert not bad, bad
    refused = {c.__name__ for c in _rules.NOT_FUSED}
    for r in rows:
        cls = r.name.split("[")[0]
        assert (r.mode == "stepwise") == (cls in refused), r
