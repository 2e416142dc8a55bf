"""What a backend supplies to the shared core, and what every backend's fit offers.

A backend is a package (``stepfuse.jax``, ``stepfuse.tf``, ``stepfuse.tf.v1``,
``stepfuse.torch``) that supplies:

1. ``fuse(loss_fn, optimizer, ..., steps, **shared options)``: checks the shared options
   with `stepfuse._core.options.check_options` (and documents them with ``shared_doc``),
   its own arguments with `stepfuse._core.options.fail`, and returns a `FitLike`;
2. an `stepfuse._core.loop.Ops` for its tensors, with which its compiled loop body moves
   the shared `stepfuse._core.loop.Flow` (record slot, ``tol``, stop code, finite check);
3. for ``mode="stepwise"`` (and fallbacks) a `Stepper`, which
   `stepfuse._core.stepwise.run_stepwise` drives with the same semantics on the host;
4. the host side of its fused call through `stepfuse._core.driver`: a `Notifier` for the
   callback and the bar, `next_multiple` / `paced_every` for where its loop reaches the
   host, `CallbackErrors` for a callback's exception, `deferred_interrupts` around the
   write-back of a call's results.

The shared semantics are thus defined once and every loop, fused or stepwise, runs them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .options import Options

__all__ = ["FitLike", "Stepper"]


@runtime_checkable
class FitLike(Protocol):
    """What every backend's ``Fit`` offers besides being called.

    Attributes:
      mode: ``"fused"`` or ``"stepwise"``: the mode the fit runs in (a fused fit that had
        to fall back says ``"stepwise"`` and warns why).
      compiles: how many programs the fit has compiled (traced) so far; one serves every
        ``steps=n`` and every batch of the same shapes.
      opts: the validated shared options.
    """

    mode: str
    compiles: int
    opts: Options


class Stepper(Protocol):
    """One step of the stepwise reference, split where the shared loop decides.

    ``propose()`` evaluates the loss and gradient at the current parameters and computes
    the update without applying it: ``(loss, finite, token)``; ``commit(token)`` applies
    it. `stepfuse._core.stepwise.run_stepwise` takes the two bound methods.
    """

    def propose(self) -> tuple[Any, bool, Any]: ...

    def commit(self, token: Any) -> None: ...
