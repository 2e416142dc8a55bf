"""The semantics every backend shares, defined once.

- `trace`: what a call returns (`Trace`, `Stop`, `NonFiniteError`) and how a backend's
  raw loss buffer becomes a `Trace`;
- `options`: the options every ``fuse`` takes, their checks, their documentation and
  the argument-error helper;
- `loop`: one step of every loop (the carried `Flow` and its `advance`, the record
  slot, ``tol``, the stop code), over each framework's array functions;
- `stepwise`: the stepwise reference loop, the same semantics on the host;
- `driver`: the host side of a call (notifications, pacing, a callback's error,
  Ctrl-C held back while results are written);
- `evaluation`: evaluation inside the loop (``eval_fn``, ``eval_every``, `EvalTrace`);
- `protocol`: what a backend supplies.
"""

from .driver import (
    CallbackErrors,
    Notifier,
    deferred_interrupts,
    exclusive,
    next_multiple,
    paced_every,
    user_stacklevel,
    with_state,
)
from .evaluation import (
    EvalTrace,
    check_eval_batch,
    eval_due,
    eval_names,
    eval_values,
    host_evals,
    named_evals,
)
from .loop import HOST, Flow, Ops
from .options import (
    OPTIONS_DOC,
    Described,
    Options,
    check_call_steps,
    check_int,
    check_options,
    check_steps,
    check_tol,
    fail,
    shared_doc,
)
from .protocol import FitLike, Stepper
from .stepwise import finish, run_stepwise
from .trace import NonFiniteError, Stop, Trace, ceil_div, host_trace, n_recorded

__all__ = [
    "HOST",
    "OPTIONS_DOC",
    "CallbackErrors",
    "Described",
    "with_state",
    "EvalTrace",
    "FitLike",
    "Flow",
    "NonFiniteError",
    "Notifier",
    "Ops",
    "Options",
    "Stepper",
    "Stop",
    "Trace",
    "ceil_div",
    "check_call_steps",
    "check_int",
    "check_options",
    "check_steps",
    "check_tol",
    "check_eval_batch",
    "deferred_interrupts",
    "exclusive",
    "eval_due",
    "eval_names",
    "eval_values",
    "fail",
    "finish",
    "host_evals",
    "host_trace",
    "n_recorded",
    "named_evals",
    "next_multiple",
    "paced_every",
    "user_stacklevel",
    "run_stepwise",
    "shared_doc",
]
