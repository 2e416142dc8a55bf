"""Save and restore a TF2 fused fit with ``tf.train.Checkpoint`` (no pickle, no code).

A checkpoint covers what a fit needs to continue exactly where it stopped: the
trained variables, the Keras optimizer (its slot variables, ``iterations`` and
``learning_rate``), the fit's step count (``fit.step``, used for the global step
numbers of callbacks and `stepfuse.NonFiniteError`) and, for a model passed to ``fuse``
whole, the model's non-trainable variables (BatchNorm statistics, dropout seed states).
A fit given a list of variables knows no others before its first call: save the rest
yourself (``model.save_weights``), or pass the model::

    from stepfuse.tf import checkpoint
    checkpoint.save("ckpt/fit", fit)       # writes ckpt/fit.index + ckpt/fit.data-*
    checkpoint.restore("ckpt/fit", fit)    # into a fit built the same way (any process)

``tf.train.Checkpoint`` files hold tensors and an object graph of names: reading one
never runs code from the file. ``restore`` checks that every value in the file lands
on a variable of ``fit`` and that every variable of ``fit`` gets a value
(``assert_consumed``), so a checkpoint of another model fails loudly instead of
restoring half a state. Values are restored bit for bit.

For TF1 graph mode (`stepfuse.tf.v1`), `saver` gives a ``tf.compat.v1.train.Saver``
over the fused loop's state (variables and optimizer slots).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import tensorflow as tf

__all__ = ["make", "save", "restore", "saver"]


def _check_fit(fit: Any, name: str = "fit") -> Any:
    from ._fit import Fit

    if not isinstance(fit, Fit):
        raise TypeError(
            f"`{name}` must be a stepfuse.tf Fit (from stepfuse.tf.fuse); got "
            f"{fit!r} ({type(fit).__name__}). For TF1 graph mode use checkpoint.saver(fused)."
        )
    return fit


def make(fit: Any) -> tf.train.Checkpoint:
    """A ``tf.train.Checkpoint`` of ``fit``'s variables, optimizer and step count.

    The step count is a fresh int64 ``tf.Variable`` attached as ``checkpoint.step``;
    `save` and `restore` keep it in sync with ``fit.step``.
    """
    _check_fit(fit)
    parts = {
        "variables": list(fit.variables),
        "optimizer": fit.optimizer,
        "step": tf.Variable(int(fit.step), dtype=tf.int64, trainable=False),
    }
    if fit._given_held:  # a model passed whole: its other variables (BatchNorm, seeds)
        parts["model_state"] = list(fit._given_held)
    return tf.train.Checkpoint(**parts)


def save(path: str | os.PathLike[str], fit: Any) -> str:
    """Write ``fit``'s state to the checkpoint prefix ``path``; returns the prefix written."""
    ckpt = make(fit)
    ckpt.step.assign(int(fit.step))
    return ckpt.write(os.fspath(path))


def restore(path: str | os.PathLike[str], fit: Any) -> None:
    """Load the checkpoint prefix ``path`` into ``fit`` (variables, optimizer, step count).

    ``fit`` must be built the same way as the saved one (same variables and optimizer
    class); anything missing or left over raises (``AssertionError`` from
    ``assert_consumed``) and ``fit.step`` is then left as it was.
    """
    ckpt = make(fit)
    path = os.fspath(path)
    if not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(
            f"`path` must be a checkpoint prefix written by save(); got {path!r} "
            f"(no {path}.index). Pass the value save() returned."
        )
    # Compare the file's entries (names, shapes, dtypes) with what this fit would write
    # *before* reading, so a mismatched checkpoint changes nothing.
    with tempfile.TemporaryDirectory() as tmp:
        expected = _entries(ckpt.write(os.path.join(tmp, "expected")))
    found = _entries(path)
    if found != expected:
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        differ = sorted(k for k in set(found) & set(expected) if found[k] != expected[k])
        raise ValueError(
            f"`path` must be a checkpoint of a fit built like this one; got {path!r} with "
            f"missing entries {missing[:5]}, unexpected entries {extra[:5]}, different "
            f"shape/dtype {differ[:5]}. Build the fit with the same variables and optimizer "
            "class as the one that was saved. Nothing was restored."
        )
    ckpt.read(path).assert_consumed()
    fit.step = int(ckpt.step.numpy())


def _entries(path: str) -> dict:
    reader = tf.train.load_checkpoint(path)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    return {
        k: (tuple(shapes[k]), dtypes[k].name) for k in shapes if k != "_CHECKPOINTABLE_OBJECT_GRAPH"
    }


def saver(fused, **kwargs):
    """A ``tf.compat.v1.train.Saver`` over a `stepfuse.tf.v1` loop's state.

    Covers ``fused.state`` (the trained variables and the optimizer's slot and
    non-slot variables) and, where the fit has one, its step count ``fused.counter``
    (``data=Epochs``, ``eval_fn``, ``callback``): a restored fit continues with the
    minibatches and evaluations of the run that never stopped. Build it in the fused
    loop's graph; ``saver.save(sess, path)`` and ``saver.restore(sess, path)`` as usual.
    (A ``Saver()`` of every global variable also saves an ``Epochs`` dataset, which the
    graph holds as variables.) Without ``fused.counter``, the Python-side ``fused.step``
    (only used for `stepfuse.NonFiniteError` step numbers) is not saved.
    """
    state = getattr(fused, "state", None)
    if state is None:
        raise TypeError(f"`fused` must be the result of stepfuse.tf.v1.fuse; got {fused!r}.")
    counter = getattr(fused, "counter", None)
    return tf.compat.v1.train.Saver(
        var_list=list(state) + ([] if counter is None else [counter]), **kwargs
    )
