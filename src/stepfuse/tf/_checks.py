"""Checks of what a TF2 fit is given (optimizer, variables, batch, loss), and the backend's
argument errors, shared by `stepfuse.tf` and `stepfuse.tf.v1`."""

from __future__ import annotations

import warnings
from typing import Any, NoReturn

import keras
import numpy as np
import tensorflow as tf

from .._core import Described, user_stacklevel
from .._core import fail as _options_fail


class _ArgumentError:
    """Marks stepfuse's own argument errors (so they are not re-wrapped as batch errors)."""


class _ArgTypeError(TypeError, _ArgumentError):
    pass


class _ArgValueError(ValueError, _ArgumentError):
    pass


def _fail(exc: type[BaseException], name: str, value: Any, want: str, fix: str) -> NoReturn:
    """The shared argument error (`stepfuse._core.fail`), marked as stepfuse's own."""
    marks: dict[type[BaseException], type[BaseException]] = {
        TypeError: _ArgTypeError,
        ValueError: _ArgValueError,
    }
    marked = marks.get(exc, exc)
    _options_fail(marked, name, value, want, fix)


def _check_jit_compile(jit_compile: Any) -> None:
    if not isinstance(jit_compile, bool):
        _fail(
            TypeError,
            "jit_compile",
            jit_compile,
            "True or False",
            "Pass jit_compile=False to run the loop without XLA.",
        )


def _tf_var(v):
    """The ``tf.Variable`` behind a Keras 3 variable (or ``v`` itself)."""
    return v.value if isinstance(v, keras.Variable) else v


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        _fail(
            TypeError,
            "optimizer",
            optimizer,
            "a Keras 3 optimizer",
            "Pass e.g. keras.optimizers.SGD(0.01) or keras.optimizers.Adam(1e-3); "
            "optax optimizers go to stepfuse.jax, torch.optim ones to stepfuse.torch, "
            "tf.compat.v1.train ones to stepfuse.tf.v1.",
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        _fail(
            TypeError,
            "optimizer",
            optimizer,
            "an optimizer that is not a LossScaleOptimizer",
            "A fused loop stops at a non-finite gradient and never applies it (Stop.NONFINITE), "
            "while a LossScaleOptimizer needs those steps to lower its scale, so it would never "
            "train. Use mixed_bfloat16 (no loss scaling needed) or float32, with the inner "
            "optimizer.",
        )


def _check_variables(variables: Any) -> list:
    fix = (
        "Pass a non-empty list of trainable floating-point tf.Variable / keras.Variable, "
        "a tf.Module, or a built Keras model (e.g. model.trainable_variables)."
    )
    given = variables
    if isinstance(variables, (list, tuple)):  # (its repr holds every value: say what it is)
        given = Described(f"a {type(variables).__name__} of {len(variables)} items", variables)
    if hasattr(variables, "trainable_variables") and not isinstance(variables, (list, tuple)):
        variables = list(variables.trainable_variables)
        if not variables:
            _fail(
                ValueError,
                "variables",
                given,
                "a module/model with trainable variables",
                "Build the model first (call it once on a batch or give it an Input) "
                "and make sure some layers are trainable.",
            )
    elif isinstance(variables, (tf.Variable, keras.Variable)):
        variables = [variables]
    elif isinstance(variables, (list, tuple)):
        variables = list(variables)
    else:
        _fail(
            TypeError, "variables", given, "a list of variables, a tf.Module or a Keras model", fix
        )
    if not variables:
        _fail(ValueError, "variables", given, "a non-empty list of variables", fix)
    seen = set()
    for v in variables:
        if not isinstance(v, (tf.Variable, keras.Variable)):
            _fail(
                TypeError,
                "variables",
                given,
                "a list of tf.Variable / keras.Variable only",
                f"{_short(v)} is not a variable. " + fix,
            )
        if not v.trainable:
            _fail(
                ValueError,
                "variables",
                given,
                "trainable variables",
                f"{_path(v)!r} has trainable=False. " + fix,
            )
        if not tf.as_dtype(v.dtype).is_floating:
            _fail(
                TypeError,
                "variables",
                given,
                "floating-point variables",
                f"{_path(v)!r} has dtype {tf.as_dtype(v.dtype).name}. " + fix,
            )
        if id(v) in seen:
            _fail(
                ValueError,
                "variables",
                given,
                "a list without duplicates",
                f"{_path(v)!r} is in it twice. " + fix,
            )
        seen.add(id(v))
    return variables


def _path(v: Any) -> str:
    """A variable's path (``sequential/batch_normalization/moving_mean``), else its name."""
    return str(getattr(v, "path", None) or getattr(v, "name", v))


def _short(value: Any) -> str:
    """A value's repr cut to 120 characters (an array's repr holds every value)."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _flat_batch(batch):
    """``(tensors, structure)``: the batch's tensors in `tf.nest` order (a batch argument
    may be a dict, tuple or list of them) and its nesting with the tensors as 0s."""
    if all(isinstance(b, tf.Tensor) for b in batch):  # the usual case, and the cheapest
        return batch, (0,) * len(batch)
    flat = []
    for i, b in enumerate(tf.nest.flatten(batch)):
        if isinstance(b, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(
                f"`batch` must hold dense tensors; got a {type(b).__name__} ({b.dtype.name}, shape "
                f"{list(b.shape)}) as tensor {i}. Pass it dense (tf.sparse.to_dense / .to_tensor()), "
                "or its component tensors, and rebuild it inside loss_fn."
            )
        if isinstance(b, (tf.distribute.DistributedIterator, tf.distribute.DistributedDataset)):
            raise TypeError(
                f"`batch` must hold tensors or a tf.data iterator; got a "
                f"{type(b).__name__} (from strategy.experimental_distribute_dataset) as "
                f"tensor {i}. Pass iter(dataset) of the global batches instead (batch with "
                "drop_remainder=True so each splits evenly): a fit built under the strategy's "
                "scope splits each step's batch over the replicas itself."
            )
        if isinstance(b, tf.data.Dataset):
            raise TypeError(
                f"`batch` must hold tensors; got a tf.data.Dataset ({type(b).__name__}) as "
                f"tensor {i}. Pass iter(dataset): the loop pulls one element a step."
            )
        try:
            flat.append(tf.convert_to_tensor(b))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`batch` must hold tensors (or arrays, numbers), also inside dicts, tuples and "
                f"lists; tensor {i} of it is {type(b).__name__}, which TensorFlow cannot convert "
                f"({e}). Pass the values loss_fn needs as tensors."
                + (
                    " For a stream of batches (a Python generator, a keras.utils.PyDataset): "
                    "iter(tf.data.Dataset.from_generator(...)), one element a step, or "
                    "stepfuse.Batches of the stacked batches."
                    if (hasattr(b, "__iter__") or hasattr(b, "__getitem__"))
                    and not isinstance(b, (str, bytes, list, tuple, dict))
                    else ""
                )
            ) from None
    return tuple(flat), tf.nest.map_structure(lambda _: 0, batch)


def _learning_rate_of(optimizer):
    """The object a Keras optimizer reads its learning rate from (a variable, a schedule or
    a callable), which ``optimizer.learning_rate = ...`` may replace."""
    return getattr(optimizer, "_learning_rate", None)


def hyper_of(optimizer: Any) -> tuple:
    """The optimizer's public attributes that are numbers (``beta_1``, ``momentum``,
    ``weight_decay``, ``clipnorm`` ..., Python's or NumPy's), and those of the optimizers it
    wraps (a ``MultiOptimizer``'s): Keras's update reads them as constants when it is
    traced, where the learning rate is a variable (`_learning_rate_of`)."""
    found = []
    for k, v in vars(optimizer).items():
        if v is None or isinstance(v, (int, float, np.number, np.bool_)):
            if not k.startswith("_") and k != "built":
                found.append((k, v))
            continue
        inner = [v] if isinstance(v, keras.optimizers.Optimizer) else v
        if isinstance(inner, (list, tuple)) and inner:
            if all(isinstance(o, keras.optimizers.Optimizer) for o in inner):
                for i, o in enumerate(inner):
                    found += [(f"{k.strip('_')}[{i}].{n}", x) for n, x in hyper_of(o)]
    return tuple(sorted(found, key=lambda kv: kv[0]))


def follow_hyper(fit: Any, callback: bool = False) -> None:
    """Trace the fit's programs again where the optimizer's `hyper_of` changed since they
    were traced (a tf.function loop or ``model.fit`` would go on with the old values, an
    eager loop uses the new ones at its next step). After a call whose ``callback`` changed
    them, warn that they hold from the next call only (a call is one traced program)."""
    now = hyper_of(fit.optimizer)
    if now == fit._hyper:
        return
    old, new = dict(fit._hyper), dict(now)
    said = "; ".join(
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k)
    )
    if callback:
        text = (
            "changed in the callback during the call: Keras reads them as constants in the "
            "traced update, so they hold from the next call (traced again for them), not "
            "from the next step of this one as in an eager loop. A learning rate changes at "
            "once (it is a variable)."
        )
    else:
        text = (
            "changed: Keras reads them as constants in the traced update (a tf.function "
            "loop or model.fit would go on with the old values), so the fit is traced again "
            "for them now, as an eager loop uses them."
        )
        fit._hyper = now
        fit._build()
    warnings.warn(
        f"stepfuse.tf: the optimizer's hyper-parameters ({said}) {text}",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def _check_loss(loss: Any, loss_fn: Any) -> Any:
    if isinstance(loss, (tuple, list)):
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "a function returning a scalar float tensor",
            f"It returned a {type(loss).__name__} of {len(loss)}: stepfuse.tf has no has_aux; "
            "return the loss alone (compute auxiliary values after the call, or record them "
            "in a callback or eval_fn).",
        )
    try:
        t = tf.convert_to_tensor(loss)
    except (TypeError, ValueError):
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "a function returning a scalar float tensor",
            f"It returned {loss!r}; return e.g. tf.reduce_mean(...).",
        )
    if t.shape.rank is None:  # (a tf.numpy_function's output): a scalar when it runs
        return tf.ensure_shape(t, [])
    if t.shape.rank != 0:
        _fail(
            ValueError,
            "loss_fn",
            loss_fn,
            "a function returning a scalar (shape ())",
            f"It returned a tensor of shape {t.shape}; reduce it, e.g. tf.reduce_mean(loss).",
        )
    if not t.dtype.is_floating:
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "a function returning a floating-point scalar",
            f"It returned dtype {t.dtype.name}; cast it, e.g. tf.cast(loss, tf.float32).",
        )
    return t


def _op_types(graph_def: Any) -> set[str]:
    """The op types of a graph and of its functions (loop bodies, branches)."""
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes += function.node_def
    return {n.op for n in nodes}


def _random_ops(op_types: Any) -> tuple[str, ...]:
    """The random-number op types among ``op_types`` (`_op_types`).

    XLA implements TensorFlow's random ops with its own generators: the same seed draws
    other numbers than TensorFlow's kernels do, eagerly or in a plain ``tf.function``
    (a Keras Dropout layer draws a different mask), so an XLA loop would drift from the
    plain training loop from its first step."""
    marks = ("Random", "Rng", "Multinomial", "TruncatedNormal", "Shuffle")
    return tuple(sorted(t for t in op_types if any(m in t for m in marks)))


def _check_known(optimizer: Any, variables: Any) -> None:
    """A built optimizer knows every variable (Keras applies updates only to the variables
    it was built for, and says so only at the first update, deep in the loop)."""
    check = getattr(optimizer, "_check_variables_are_known", None)
    if check is None:
        return
    unknown = []
    for v in variables:
        try:
            check([v])
        except ValueError:
            unknown.append(getattr(v, "path", None) or v.name)
    if unknown:
        _fail(
            ValueError,
            "optimizer",
            optimizer,
            "an optimizer not yet built, or built for these variables",
            f"It was built for other variables, not for {unknown}. Create a new optimizer "
            "for this model (a Keras optimizer keeps its slots for the variables it was "
            "built for; fuse builds it, so an earlier fuse with other variables that was "
            "refused at its first call built it too).",
        )


def _shape_text(shape: Any) -> str:
    return "[unknown rank]" if shape.rank is None else str(list(shape))


def _described(arg: Any) -> str:
    """One batch argument, briefly: ``float32[50, 3]``, or a structure's leaves (a list of
    numbers named as such: ``fit(x.tolist())`` hands loss_fn a list of scalar tensors)."""
    if isinstance(arg, (tf.Tensor, tf.Variable)):
        return f"{arg.dtype.name}{_shape_text(arg.shape)}"
    leaves = tf.nest.flatten(arg)
    if isinstance(arg, list) and leaves and all(getattr(t, "shape", None) == () for t in leaves):
        return (
            f"a list of {len(leaves)} scalars (a list is a structure of separate tensors, "
            "as tf.function reads it: np.asarray(...) makes it one array)"
        )
    text = str(tf.nest.map_structure(lambda b: f"{b.dtype.name}{_shape_text(b.shape)}", arg))
    return text if len(text) <= 200 else text[:200] + " [...]"


def _batch_mismatch(error: Exception, batch: Any) -> Exception:
    """The error for a batch that ``loss_fn`` could not be traced on (``error``, a
    TypeError or ValueError, is its cause): the arguments' dtypes and shapes, the cause, and
    the fix."""
    shapes = ", ".join(_described(b) for b in batch)
    cause = str(error).strip()
    if len(cause) > 600:
        cause = cause[:600] + " [...]"
    ints = any(
        getattr(t, "dtype", None) == tf.int32 and t.shape.rank == 0 for t in tf.nest.flatten(batch)
    )
    exc = TypeError if isinstance(error, TypeError) else ValueError
    if "singleton tf.Variables created on the first call" in cause:
        return exc(
            f"`loss_fn` must create no variables; got one that made a new tf.Variable while "
            f"traced on [{shapes}] ({cause}). A layer or variable made inside loss_fn is made "
            "again on every call, so the fit could never train it. Build it once before fuse, "
            "outside loss_fn (call a layer once on a batch), and pass it with the variables."
        )
    return exc(
        f"`batch` must fit loss_fn; got {len(batch)} argument(s) [{shapes}] and "
        f"loss_fn(*batch) failed while tracing: {cause} -- Pass the tensors "
        "loss_fn expects (count, shapes, dtypes), e.g. fit(x, y) for loss_fn(x, y)."
        + (" A Python int becomes an int32 tensor: pass 0.0 for a float." if ints else "")
        + (
            " A tensor of unknown rank (a tf.data element made by tf.py_function, say) has "
            "no shape while traced: give it one in the dataset, e.g. "
            "dataset.map(lambda x, y: (tf.ensure_shape(x, [None, 3]), tf.ensure_shape(y, [None])))."
            if any(t.shape.rank is None for t in tf.nest.flatten(batch) if hasattr(t, "shape"))
            else ""
        )
        + (
            " A dict (a fixed one, or a tf.data element) reaches loss_fn as one argument: "
            "read its keys inside loss_fn(batch), or map the dataset to a tuple."
            if any(isinstance(b, dict) for b in batch)
            else ""
        )
    )
