"""JAX backend: N optax steps inside one compiled call.

``fuse(loss_fn, optimizer, steps=...)`` returns a `Fit`: ``fit.init(params)`` makes a
`FitState` and ``state, trace = fit(state, *batch)`` runs the steps in one ``jax.jit``
call. ``fit`` is a pure function of ``(state, *batch)``: it composes with ``jax.jit``,
``jax.vmap`` (many models, one call) and ``jax.grad``.
"""

from ._fit import Fit as Fit
from ._fit import FitState as FitState
from ._fit import fuse as fuse

__all__ = ["Fit", "FitState", "fuse"]
