"""The TF1 graph pieces of `stepfuse.tf.v1`: checks that the graph and the optimizer fit,
the variables a loss trains, and one guarded step's ops."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import tensorflow as tf

from .._core import Described
from ._checks import _check_loss, _fail, _random_ops
from ._loop import _all_finite
from ._probe import resource_writes

tf1 = tf.compat.v1


def _check_graph_mode() -> None:
    if tf.executing_eagerly():
        raise RuntimeError(
            "stepfuse.tf.v1.fuse builds a TF1 graph but TensorFlow is executing eagerly. "
            "Build inside `with tf.Graph().as_default():` (and run with "
            "tf.compat.v1.Session(graph=...)), or call tf.compat.v1.disable_eager_execution() "
            "first; for eager TF2 / Keras use stepfuse.tf.fuse."
        )


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, tf1.train.Optimizer):
        _fail(
            TypeError,
            "optimizer",
            optimizer,
            "a tf.compat.v1.train optimizer",
            "Pass e.g. tf.compat.v1.train.GradientDescentOptimizer(0.01) or AdamOptimizer(); "
            "Keras optimizers go to stepfuse.tf.fuse.",
        )


def _as_var(v):
    """The ``tf.Variable`` behind ``v`` (Keras 3 variables wrap one in ``.value``)."""
    if isinstance(v, tf.Variable):
        return v
    inner = getattr(v, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    return v


def _check_var_list(var_list: Any, given: Any, found: str = "") -> list:
    """``found``: for ``var_list=None``, which variables that took (said in every error)."""
    fix = found + (
        "Pass var_list=None for the graph's trainable variables, or a non-empty list of "
        "trainable floating-point variables that loss_fn reads."
    )
    if var_list is None or isinstance(var_list, (str, bytes)) or not hasattr(var_list, "__iter__"):
        _fail(TypeError, "var_list", given, "a list of variables or None", fix)
    var_list = [_as_var(v) for v in var_list]
    if not var_list:
        _fail(ValueError, "var_list", given, "a non-empty list (no trainable variables found)", fix)
    for v in var_list:
        if not isinstance(v, tf.Variable):
            _fail(TypeError, "var_list", given, "a list of variables only", f"{v!r}: " + fix)
        if not v.dtype.base_dtype.is_floating:
            _fail(
                TypeError,
                "var_list",
                given,
                "floating-point variables",
                f"{v.name} has dtype {v.dtype.base_dtype.name}. " + fix,
            )
        if _is_ref(v):
            _fail(
                TypeError,
                "var_list",
                given,
                "resource variables",
                f"{v.name} is a reference variable (dtype {v.dtype.name}), which the fused loop "
                "cannot update. Call tf.compat.v1.enable_resource_variables() after "
                "disable_v2_behavior() and before building the graph, or create the variables "
                "with use_resource=True.",
            )
    return var_list


def _is_ref(v: Any) -> bool:
    """A reference variable (``use_resource=False``, or after ``disable_v2_behavior``)."""
    return v.dtype.name.endswith("_ref")


def _handles_read(tensor: Any) -> set:
    """The names of the variable handles read in the computation of ``tensor``."""
    return {t.name for op in _variable_reads(tensor) for t in op.inputs if t.dtype == tf.resource}


def _ancestors(tensor: Any, control: bool = False) -> list:
    """The ops ``tensor`` is computed from (its own op first), through their inputs and,
    with ``control``, their control inputs."""
    found, seen, todo = [], set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        found.append(op)
        todo.extend(t.op for t in op.inputs)
        if control:
            todo.extend(op.control_inputs)
    return found


def _variable_reads(tensor: Any) -> list:
    """The ops that read a variable in the computation of ``tensor`` (those taking a
    resource handle: ReadVariableOp, ResourceGather ...)."""
    return [op for op in _ancestors(tensor) if any(t.dtype == tf.resource for t in op.inputs)]


def _random_draws(loss: Any) -> tuple[str, ...]:
    """The random-number op types ``loss`` is computed with (``tf1.nn.dropout``'s
    ``RandomUniform`` ...), found from its ancestors and the functions they call (a
    ``tf.cond``'s branches ...): the variables' random initializers are not among them (a
    read starts at the handle)."""
    ops = _ancestors(loss, control=True)
    types = {op.type for op in ops}
    called = [name for op in ops for name in _functions_called(op.node_def)]
    if called:
        library = {f.signature.name: f for f in loss.graph.as_graph_def().library.function}
        done: set[str] = set()
        while called:
            name = called.pop()
            if name in done or name not in library:
                continue
            done.add(name)
            for node in library[name].node_def:
                types.add(node.op)
                called += _functions_called(node)
    return _random_ops(types)


def _functions_called(node_def: Any) -> list[str]:
    """The names of the functions a node's attributes name (a call's ``f``, a ``tf.cond``'s
    branches, a while loop's body and condition)."""
    names = []
    for a in node_def.attr.values():
        if a.HasField("func"):
            names.append(a.func.name)
        elif a.HasField("list"):
            names += [f.name for f in a.list.func]
    return names


def _without_xla_for(drawn: tuple[str, ...]) -> dict[str, Any]:
    """The plan of a fused loop whose loss draws random numbers: TensorFlow's kernels
    (XLA draws other numbers from the same seeds, and a ``"auto"`` trial would use up
    draws of the plain loop's), with a warning."""
    ops = ", ".join(drawn)
    warnings.warn(
        f"stepfuse.tf.v1: the loss draws random numbers (ops: {ops}; e.g. tf1.nn.dropout), "
        "and XLA draws other numbers than TensorFlow's own kernels from the same seeds, so "
        "an XLA loop would not train as the plain minimize loop does. The loop runs on "
        "TensorFlow's kernels (fused.jit_compile is False; slower for small models). Pass "
        "jit_compile=False to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return {"xla": False, "reason": f"the loss draws random numbers ({ops})"}


def _warn_stale_hyper_parameters(optimizer: Any, state: Any) -> None:
    """Warn where a hyper-parameter of ``optimizer`` is a tensor computed from a variable
    the loop changes (a learning rate decaying with the global step): the loop reads it
    once per run, where one ``minimize`` per run would read it at every step. Called once the
    loop is built: a tensor the optimizer made itself for a step (its ``_prepare``: the
    learning rate of a callable, AdagradDA's global step) then belongs to the loop's body,
    even where an earlier ``minimize`` of the user's left one of its own graph."""
    handles = {v.handle.name for v in state if getattr(v, "handle", None) is not None}
    stale = [  # (one warning: GradientDescent keeps its rate as `_learning_rate` and a tensor)
        name.lstrip("_")
        for name, value in sorted(vars(optimizer).items())
        if isinstance(value, tf.Tensor)
        and value.dtype != tf.resource
        and value.graph is tf1.get_default_graph()  # (not made inside the loop's body)
        and _handles_read(value) & handles
    ]
    if stale:
        warnings.warn(
            f"stepfuse.tf.v1: the optimizer's {stale[0]} is a tensor computed from a "
            "variable the loop changes (the global step?): it is read once per run, so every "
            "step of a run uses the same value. Give the optimizer a callable instead, e.g. "
            "learning_rate=lambda: tf1.train.exponential_decay(..., global_step, ...), which it "
            "evaluates at every step."
            + (f" (It holds it as {', '.join(stale[1:])} too.)" if stale[1:] else ""),
            RuntimeWarning,
            stacklevel=3,
        )


def _reuse_scope():
    return tf1.variable_scope(tf1.get_variable_scope(), reuse=True)


def _check_loss_fn(loss_fn: Any) -> None:
    if not callable(loss_fn):
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            "callable as loss_fn() -> scalar tensor",
            "Pass a function that builds the loss from placeholders and variables.",
        )


def _check_arity(loss_fn: Any, n: int | None) -> None:
    """``loss_fn`` can be called with ``n`` positional arguments: none without ``data``,
    one a data array with it (a signature that Python cannot read is not checked)."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(n or 0))
    except TypeError as e:
        if not n:
            _fail(
                TypeError,
                "loss_fn",
                loss_fn,
                f"a function called with no arguments, as loss_fn() (no data= given; {e})",
                "Read the batch from placeholders inside loss_fn, or pass "
                "data=stepfuse.Batches(...) or stepfuse.Epochs(...) to have loss_fn called "
                "with each step's minibatch, as loss_fn(*minibatch).",
            )
        _fail(
            TypeError,
            "loss_fn",
            loss_fn,
            f"a function called as loss_fn(*minibatch) with the {n} arrays of data ({e})",
            f"Give loss_fn one parameter per array of data ({n}).",
        )


def _prepare(loss_fn, optimizer, var_list, shown=None):
    """Checks, the first (variable-creating) forward pass, the var list and the slots.
    ``shown``: the user's function, where ``loss_fn`` wraps it (for messages)."""
    _check_graph_mode()
    _check_loss_fn(loss_fn)
    _check_optimizer(optimizer)
    # (creates the variables: tf1.get_variable, layers). What it adds to the LOSSES and
    # UPDATE_OPS collections is taken out again: each later call (the loop's, the stepwise
    # step's) adds its own, and ``tf1.losses.get_total_loss()`` or an UPDATE_OPS dependency
    # in loss_fn must find that call's alone, as in the plain loop's single call.
    graph = tf1.get_default_graph()
    kept = {k: list(graph.get_collection(k)) for k in _PER_CALL_COLLECTIONS}
    first = len(graph.get_operations())
    loss0 = _check_loss(loss_fn(), loss_fn if shown is None else shown)
    for key, before in kept.items():
        graph.get_collection_ref(key)[:] = before
    writes = _written(graph.get_operations()[first:])
    given = var_list
    if var_list is None:
        # As optimizer.minimize(loss): the trainable variables the loss reads (another
        # model's in the same graph are not this loss's).
        read = _handles_read(loss0)
        everything = tf1.trainable_variables()
        var_list = [
            v
            for v in everything
            if _is_ref(v)  # refused below, by name
            or (getattr(v, "handle", None) is not None and v.handle.name in read)
        ]
        # and, as minimize, not those the loss reads without a gradient (stop_gradient ...)
        dropped = {id(v) for v in _unreached(loss0, [v for v in var_list if not _is_ref(v)])}
        var_list = [v for v in var_list if id(v) not in dropped]
        found = (
            f"var_list=None took the trainable variables the loss reads: "
            f"{[v.name for v in var_list]} of {[v.name for v in everything]}. "
        )
    else:
        found = ""
    var_list = _check_var_list(var_list, given, found)
    if given is not None:  # as minimize: a variable no gradient reaches is left alone
        unreached = _unreached(loss0, var_list)
        if unreached and len(unreached) < len(var_list):
            warnings.warn(
                f"stepfuse.tf.v1: no gradient reaches {[v.name for v in unreached]} of "
                "var_list from the loss: the fit leaves them alone, as optimizer.minimize "
                "does (no update, no slots). Leave them out of var_list to silence this.",
                stacklevel=4,
            )
            var_list = [v for v in var_list if all(v is not u for u in unreached)]
    # Slot and non-slot variables (momentum, Adam moments and beta powers) are created
    # here, outside the loop, so the loop body only reads and writes them.
    create = getattr(optimizer, "_create_slots", None)
    if create is not None:
        with tf1.init_scope():
            create(var_list)
    ids = {id(v) for v in var_list}
    state = list(var_list) + [v for v in optimizer.variables() if id(v) not in ids]
    ids = {id(v) for v in state}
    return loss0, var_list, state, [v for v in writes if id(v) not in ids]


def _unreached(loss: Any, variables: list) -> list:
    """The ``variables`` no gradient of ``loss`` reaches (read through ``stop_gradient``,
    or not read at all), which ``minimize`` leaves alone."""
    if not variables:
        return []
    grads = tf.gradients(loss, variables, unconnected_gradients="none")
    return [v for v, g in zip(variables, grads) if g is None]


def _written(ops: Any) -> list:
    """The variables ``ops`` write (a forward pass's moving statistics, counters), from
    the resources each op writes; what a ``jit_compile="auto"`` trial run must undo."""
    variables = tf1.global_variables() + tf1.local_variables()
    by_handle = {v.handle.name: v for v in variables if getattr(v, "handle", None) is not None}
    found: dict[int, Any] = {}
    for _, t in resource_writes(ops) or ():
        v = by_handle.get(t.name)
        if v is not None:
            found[id(v)] = v
    return list(found.values())


# The collections a call of loss_fn adds to that the next call must not find (`_prepare`).
_PER_CALL_COLLECTIONS = (tf1.GraphKeys.LOSSES, tf1.GraphKeys.UPDATE_OPS)


def _stale_reads(loss: Any, state: Any) -> list:
    """The tensors of the graph outside the loop that ``loss`` (built in the loop's body)
    reads and that are computed from the variables the loop changes: inside the loop each
    keeps the value it had when the run started (a loss built before `fuse`, e.g.
    ``fuse(lambda: loss, ...)``, would apply the first step's gradient at every step)."""
    handles = {v.handle.name for v in state if getattr(v, "handle", None) is not None}
    if not hasattr(loss.graph, "captures"):  # the user's tensor itself (lambda: loss)
        return [loss] if _handles_read(loss) & handles else []
    stale, seen, todo = [], set(), [loss.op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
        if op.type != "Placeholder":
            continue
        outer = op.outputs[0]
        while hasattr(outer.graph, "captures"):  # a function's input: what it captured
            outer = next((o for o, i in outer.graph.captures if i is outer), None)
            if outer is None or outer.dtype == tf.resource:
                break
            if outer.op.type != "Placeholder" and hasattr(outer.graph, "captures"):
                todo.append(outer.op)  # computed in an enclosing function: walk it too
                outer = None
                break
        else:  # a tensor of the user's graph
            if _handles_read(outer) & handles and outer not in stale:
                stale.append(outer)
    return stale


def _step_ops(loss_fn, optimizer, var_list, state, global_step=None, shown=None):
    """One proposed step, ops ordered explicitly: ``(loss, snapshot, new, ok)``, the state
    before and after the optimizer's update and whether loss, gradients and new state are
    all finite (the caller keeps or restores the update). ``shown``: the user's function,
    where ``loss_fn`` wraps it (for messages)."""
    shown = loss_fn if shown is None else shown
    with _reuse_scope():
        loss = _check_loss(loss_fn(), shown)
        inside = hasattr(tf1.get_default_graph(), "captures")  # the loop's body
        stale = _stale_reads(loss, state) if inside else []
        if stale:
            _fail(
                ValueError,
                "loss_fn",
                Described(f"a loss that reads {[t.name for t in stale]}", shown),
                "a function that builds the loss from the variables each time it is called",
                "Those tensors were built outside loss_fn from the variables the loop trains: "
                "inside the loop each would keep the value it had when the run started, so "
                "every step would apply the first step's gradient. Move the lines that build "
                "them into loss_fn, e.g. loss_fn = lambda: tf.reduce_mean(...(tf.matmul(x, "
                "w) + b)...) rather than logits or a loss built before fuse.",
            )
        gvs = optimizer.compute_gradients(loss, var_list)
    missing = [v.name for g, v in gvs if g is None]
    if missing:
        _fail(
            ValueError,
            "loss_fn",
            shown,
            "a loss that depends on every variable in var_list",
            f"No gradient reaches {missing}: use those variables in loss_fn or leave them "
            "out of `var_list`. (If loss_fn makes its variables with tf.Variable or a new Keras "
            "layer on each call, make them once before fuse, outside loss_fn: loss_fn is called "
            "again inside the loop, where only tf1.get_variable reuses what the first call made.)",
        )
    grads = [g for g, _ in gvs]
    with tf.control_dependencies(
        [loss] + [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    ):
        snapshot = [tf.identity(v.read_value()) for v in state]
    with tf.control_dependencies(snapshot + [loss]):
        apply = optimizer.apply_gradients(gvs, global_step=global_step)
    with tf.control_dependencies([apply]):
        new = [tf.identity(v.read_value()) for v in state]
    return loss, snapshot, new, _all_finite([loss, *grads, *new])
