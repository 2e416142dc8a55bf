"""TensorFlow 2 / Keras backend: many Keras-optimizer steps inside one ``tf.function`` call.

``fuse(loss_fn, optimizer, variables, steps=...)`` returns a `Fit`; ``trace = fit(*batch)``
runs the steps in one ``tf.function`` call and updates the variables and the optimizer
state in place. A call's arguments may be streams (`stepfuse.Batches`, `stepfuse.Epochs`,
a ``tf.data`` iterator; `OutOfDataError` when one runs out). TF1 graph mode
(``sess.run``) lives in `stepfuse.tf.v1`.
"""

# the data streams, also here: `sf.Batches(...)` with `import stepfuse.<backend> as sf`
from .._core.data import Batches as Batches
from .._core.data import Epochs as Epochs
from . import checkpoint as checkpoint
from . import v1 as v1
from ._data import OutOfDataError as OutOfDataError
from ._fit import Fit as Fit
from ._fuse import fuse as fuse

__all__ = ["Batches", "Epochs", "Fit", "OutOfDataError", "checkpoint", "fuse", "v1"]
