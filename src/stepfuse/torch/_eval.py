"""Evaluation inside the torch loop (the shared semantics: `stepfuse._core.evaluation`).

``eval_fn(*eval_batch)`` reads the model, as ``loss_fn`` does. Inside the fused program it
is called through ``torch.func.functional_call`` on a module holding the fit's modules
(`_EvalModule`), so it sees the loop's current parameters and buffers, after each step
whose applied update brings the fit's step count to a multiple of ``eval_every``: a
``torch.cond`` in the loop body runs it only then (no host round trip), and writes its
values into buffers the loop carries (`Spec`: one slot per evaluation a program call may
run, and a spare one). The program takes the call's ``eval_batch`` as inputs after the
batch's (with the fit's step at the program call's start), so new values of the same
shapes reuse the compiled program; a fit without ``eval_fn`` builds the program it built
before (no ``Spec``, no extra inputs).

The modules are seen as they are (their ``training`` flags, as the fit trains them); the
evaluation runs without autograd, and what it does to the modules' buffers (BatchNorm's
running statistics in train mode) and Python number attributes (``model.train()`` at the
end of ``eval_fn``) is put back, in both modes (a warning where it changed the latter). ``Evaluations.check`` runs
``eval_fn`` once eagerly per ``eval_batch`` signature before anything else (its buffers and
random state put back): a named error if it fails or returns anything but a scalar tensor
or a dict of them; it fixes the names and dtypes of the series.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree

from .._core import (
    EvalTrace,
    Options,
    ceil_div,
    check_eval_batch,
    eval_due,
    eval_values,
    host_evals,
)
from .._core.options import fail
from ._changes import changes, module_numbers, watched
from ._probe import hold_buffers
from ._program import batch_key
from ._state import put_back

__all__ = ["Evaluations", "Spec", "check_call", "inputs"]


_NO_STEPS = np.zeros(0, np.int64)


def _buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays, any other float is float32 (as losses are recorded); others keep theirs."""
    if dtype.is_floating_point:
        return torch.float64 if dtype == torch.float64 else torch.float32
    return dtype


def _pad(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((), math.nan if dtype.is_floating_point else 0, dtype=dtype, device=device)


class _EvalModule(nn.Module):
    """The fit's modules, under the names the loss's wrapper gives them (``models.<i>``),
    with ``eval_fn`` as its forward: `functional_call` swaps in the loop's tensors."""

    def __init__(self, eval_fn: Callable[..., Any], modules: Sequence[nn.Module]):
        super().__init__()
        self.models = nn.ModuleList(modules)
        self.eval_fn = eval_fn
        self.numbers = watched(modules)  # (a plain list: found once, outside the trace)

    def forward(self, *args: Any) -> Any:
        # The modules' Python number attributes are put back after an evaluation, as the
        # stepwise mode's `put_back` does: ``model.train()`` at the end of eval_fn leaves a
        # model trained in eval mode in eval mode (and the traced branch without effects).
        before = [[getattr(m, k) for k in names] for m, names in self.numbers]
        out = self.eval_fn(*args)
        for (m, names), old in zip(self.numbers, before):
            for k, a in zip(names, old):
                if getattr(m, k) != a:
                    setattr(m, k, a)
        return out


class Spec(NamedTuple):
    """The evaluation as the fused program builds it (plain values, `stepfuse.torch._program.Body`).

    ``names``: the series, in order, ``dtypes`` their buffers' dtypes; ``slots``: the
    evaluations one program call may run (the buffers hold one more, the spare slot a step
    that does not evaluate writes)."""

    module: nn.Module
    every: int
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    slots: int

    @property
    def size(self) -> int:
        """Tensors the loop carries for it: the count, the steps and each series."""
        return 2 + len(self.names)

    def start(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The carry at a program call's start: nothing evaluated."""
        cap = self.slots + 1
        return (
            torch.zeros((), dtype=torch.int64, device=device),
            torch.full((cap,), -1, dtype=torch.int64, device=device),
            *(
                torch.full((cap,), _pad(d, device).item(), dtype=d, device=device)
                for d in self.dtypes
            ),
        )

    def after(
        self,
        carry: Sequence[torch.Tensor],
        step: torch.Tensor,
        applied: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        args: tuple,
    ) -> tuple[torch.Tensor, ...]:
        """The carry after a step: ``step`` the fit's step count after it, ``applied``
        whether it applied an update, ``tensors`` the modules' tensors (by name) after it.
        A ``torch.cond`` evaluates if due, else gives the pads; the values are written at
        slot ``count`` either way (the next evaluation overwrites the pads)."""
        count, steps, *series = carry
        due = applied & eval_due(step, self.every)
        flat = tuple(tensors.values())
        keys = tuple(tensors)
        device = step.device

        def evaluate(*operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
            ts = dict(zip(keys, operands[: len(keys)]))
            out = eval_values(torch.func.functional_call(self.module, ts, operands[len(keys) :]))
            return tuple(
                torch.as_tensor(out[n], device=device).to(d).reshape(())
                for n, d in zip(self.names, self.dtypes)
            )

        def skip(*operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(_pad(d, device) for d in self.dtypes)

        values = torch.cond(due, evaluate, skip, (*flat, *args))
        at = count.reshape(1)
        steps = steps.index_copy(0, at, torch.where(due, step, -1).reshape(1))
        series = [s.index_copy(0, at, v.reshape(1)) for s, v in zip(series, values)]
        return (count + due.to(count.dtype), steps, *series)


class Evaluations:
    """A torch fit's evaluation: its arguments, its check, the stepwise evaluation, the
    fused program's `Spec` and the results read back."""

    def __init__(self, opts: Options, modules: Sequence[nn.Module]):
        assert opts.eval_fn is not None and opts.eval_every is not None
        self.eval_fn, self.every = opts.eval_fn, opts.eval_every
        self.module = _EvalModule(opts.eval_fn, modules)
        self._modules = list(modules)
        self._checked: dict[tuple, dict[str, torch.dtype]] = {}  # signature -> series dtypes
        self._subs = self.module.numbers
        self._modes: set[tuple] = set()  # (signature, module numbers) eval_fn was checked in
        self.dtypes: dict[str, torch.dtype] = {}  # those of the call's eval_batch
        self.args: tuple = ()  # the call's eval_batch
        self.key: tuple = ()  # its signature (a program is built for one)

    def check(self, args: tuple, key: tuple) -> None:
        """Run ``eval_fn(*args)`` once per signature ``key`` (eagerly, without autograd,
        the buffers and random state put back): a named error if it fails or returns
        anything but a scalar or a non-empty dict of scalars. Sets the call's arguments.
        Run again in each train/eval mode (the modules' numbers), where it may differ."""
        mode = (key, module_numbers(self._subs))
        if mode not in self._modes:
            rng = torch.get_rng_state()
            out = eval_values(self._run(args, what="checking it", rng=rng))
            found = {}
            for name, v in out.items():
                if not isinstance(v, torch.Tensor):
                    v = torch.as_tensor(v)
                found[name] = _buffer_dtype(v.dtype)
            self._checked[key] = found
            self._modes.add(mode)
        self.dtypes, self.args, self.key = self._checked[key], args, key

    def _run(self, args: tuple, what: str, rng: torch.Tensor | None = None) -> Any:
        """``eval_fn(*args)`` without autograd, the buffers and random state put back;
        with ``rng`` (the random state before), an error if it drew random numbers."""
        held = hold_buffers(self._modules)
        before = torch.get_rng_state() if rng is None else rng
        numbers = module_numbers(self._subs)
        try:
            with torch.no_grad():
                out = self.eval_fn(*args)
            drew = not torch.equal(before, torch.get_rng_state())
            if rng is not None:
                _left_changed(self._subs, numbers, module_numbers(self._subs))
        except (TypeError, ValueError, RuntimeError, IndexError) as e:
            shapes = [
                f"{a.dtype}{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                for a in args
            ]
            raise type(e)(
                f"`eval_fn(*eval_batch)` failed while {what} with eval_batch {shapes}: {e} -- "
                "Pass the arguments eval_fn takes as fit(..., eval_batch=(...)) (a tuple is "
                "the arguments, any other value one argument)."
            ) from e
        finally:
            put_back(held)
            torch.set_rng_state(before)
        if drew and rng is not None:
            fail(
                ValueError,
                "eval_fn",
                self.eval_fn,
                "a function that draws no random numbers (the fused loop would draw them "
                "in another order than the stepwise one)",
                "A model with dropout: call model.eval() at the start of eval_fn and "
                "model.train() before it returns (the torch guide's example).",
            )
        return out

    def evaluate(self) -> dict[str, np.ndarray]:
        """The stepwise mode's evaluation at the model's current parameters (as NumPy
        scalars of the buffers' dtypes; the buffers and random state put back)."""
        out = eval_values(self._run(self.args, what="evaluating"))
        return {
            n: torch.as_tensor(out[n]).detach().to("cpu", d).numpy() for n, d in self.dtypes.items()
        }

    def spec(self, cap: int) -> Spec:
        """The fused program's evaluation for program calls of up to ``cap`` steps."""
        return Spec(
            self.module,
            self.every,
            tuple(self.dtypes),
            tuple(self.dtypes.values()),
            ceil_div(cap, self.every),
        )

    def read(self, carry: Sequence[torch.Tensor]) -> EvalTrace:
        """One program call's evaluations from its final carry's evaluation tensors."""
        count, steps, *series = (t.detach().cpu() for t in carry)
        values = {n: s.numpy() for n, s in zip(self.dtypes, series)}
        return host_evals(steps.numpy(), values, int(count))

    def join(self, parts: Sequence[EvalTrace | None]) -> EvalTrace:
        """The evaluations of a call's program calls (and eager step), in order."""
        got = [p for p in parts if p is not None and len(p)]
        return EvalTrace(
            step=np.concatenate([np.asarray(p.step, np.int64) for p in got] + [_NO_STEPS]),
            values={
                n: np.concatenate([np.asarray(p[n]) for p in got] + [np.zeros(0, d)])
                for n, d in self.empty().items()
            },
        )

    def empty(self) -> dict[str, Any]:
        """The series' dtypes as NumPy's (`stepfuse._core.named_evals`)."""
        return {n: torch.empty((), dtype=d).numpy().dtype for n, d in self.dtypes.items()}


def inputs(evals: Evaluations | None, batch: tuple, step: int, device: torch.device) -> tuple:
    """The program's ``batch``, followed with ``eval_fn`` by the evaluation's inputs: the
    fit's step at the program call's start and the call's ``eval_batch``."""
    if evals is None:
        return batch
    # torch's while_loop refuses inputs that share memory (an eval_batch tensor that is a
    # batch tensor, or a view of one): those are given as copies.
    seen = {_storage(t) for t in _pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)}
    args = []
    for a in evals.args:
        if isinstance(a, torch.Tensor):
            if _storage(a) in seen:
                a = a.clone()
            seen.add(_storage(a))
        args.append(a)
    return (*batch, (torch.tensor(step, dtype=torch.int64, device=device), *args))


def _storage(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def _left_changed(subs: Any, before: tuple, after: tuple) -> None:
    """Warn where ``eval_fn`` leaves a module attribute changed (``model.train()`` at its
    end, with the model in eval mode): each evaluation's are put back, in both modes, where
    a plain loop calling it would go on with them changed."""
    changed = changes(subs, before, after)
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        warnings.warn(
            f"stepfuse.torch: eval_fn leaves module attributes changed ({', '.join(changed[:3])}"
            f"{more}). The fit puts them back after each evaluation, so the steps run as "
            "the model was set for the call, where a plain loop calling this eval_fn would "
            "go on with them changed. To say so in eval_fn: was = model.training; "
            "model.eval(); ...; model.train(was).",
            stacklevel=5,
        )


def check_call(evals: Evaluations | None, eval_batch: Any) -> None:
    """Check the call's ``eval_batch`` (`stepfuse._core.check_eval_batch`: none is no
    arguments) and, once per signature, ``eval_fn`` on it (`Evaluations.check`: an
    ``eval_fn`` that needs arguments it was not given fails there, by name); it becomes the
    evaluations' arguments. Changes nothing else."""
    args = check_eval_batch(eval_batch, None if evals is None else evals.eval_fn)
    if evals is not None:
        evals.check(args, batch_key(args))
