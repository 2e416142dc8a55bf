"""stepfuse: run many optimizer steps inside one compiled call.

The backends live in submodules so that importing the package needs none of the
frameworks: ``stepfuse.jax`` (JAX + optax), ``stepfuse.tf`` (TensorFlow 2 / Keras)
with ``stepfuse.tf.v1`` (TF1 graph mode, ``sess.run``), and ``stepfuse.torch``.

The data streams, `Batches` (stacked minibatches) and `Epochs` (a resident dataset,
shuffled epoch after epoch), serve every backend.
"""

from ._core import EvalTrace as EvalTrace
from ._core import NonFiniteError as NonFiniteError
from ._core import Stop as Stop
from ._core import Trace as Trace
from ._core.data import Batches as Batches
from ._core.data import Epochs as Epochs

__version__ = "0.1.0"

__all__ = ["Batches", "EvalTrace", "Epochs", "NonFiniteError", "Stop", "Trace", "__version__"]
