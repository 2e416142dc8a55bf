"""JAX backend: N optax steps inside one compiled call.

``fuse(loss_fn, optimizer, steps=...)`` returns a `Fit`: ``fit.init(params)`` makes a
`FitState` and ``state, trace = fit(state, *batch)`` runs the steps in one ``jax.jit``
call, a ``lax.while_loop`` on the device that recomputes the gradient at every step,
carries the optimizer state, records the losses and stops early on ``tol`` or a
non-finite update. ``fit`` is a pure function of ``(state, *batch)``: it composes with
``jax.jit``, ``jax.vmap`` (many models, one call) and ``jax.grad``.

The modules, by job: `_fuse` (the entry point and its argument checks), `_fit` (`Fit`:
a call's host side, notifications, the stepwise reference), `_program` (the compiled
loop), `_step` (one proposed step), `_probe` (its finite check), `_checks` (the
inputs' checks), `_ops` (the shared loop semantics' array functions), `_transforms`
(what a call learns of the transforms around it), `_host` (the FFI notification path),
`_state` (`FitState`), `_data` (`stepfuse.Batches` / `stepfuse.Epochs`: their checks and
each step's minibatch inside the loop), `_eval` (evaluation inside the loop).
"""

# the data streams, also here: `sf.Batches(...)` with `import stepfuse.<backend> as sf`
from .._core.data import Batches as Batches
from .._core.data import Epochs as Epochs
from ._fit import Fit as Fit
from ._fuse import fuse as fuse
from ._state import FitState as FitState

__all__ = ["Batches", "Epochs", "Fit", "FitState", "fuse"]
