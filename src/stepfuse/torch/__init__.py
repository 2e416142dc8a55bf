"""PyTorch backend: many ``torch.optim`` steps inside one compiled program.

``fuse(loss_fn, optimizer, steps=...)`` returns a `Fit`; ``trace = fit(*batch)`` runs the
steps and updates the model's parameters and ``optimizer.state`` in place, so the model
and optimizer carry on with ordinary PyTorch afterwards.
"""

# the data streams, also here: `sf.Batches(...)` with `import stepfuse.<backend> as sf`
from .._core.data import Batches as Batches
from .._core.data import Epochs as Epochs
from ._fit import SUPPORTED_OPTIMIZERS as SUPPORTED_OPTIMIZERS
from ._fit import BatchError as BatchError
from ._fit import Fit as Fit
from ._fit import FusedFit as FusedFit
from ._fuse import fuse as fuse

__all__ = ["SUPPORTED_OPTIMIZERS", "BatchError", "Batches", "Epochs", "Fit", "FusedFit", "fuse"]
