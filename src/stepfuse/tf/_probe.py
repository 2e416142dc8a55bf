"""What tracing the loss alone tells a TF2 fit, before its program is traced (`probe`).

The loss and its gradients are traced once per batch signature in a scratch graph (nothing
runs). That graph says:

- the trace's loss dtype (float64 for a float64 loss, else float32);
- the random-number ops it runs (`_random_ops`), the runtime checks XLA drops (``Assert``)
  and whether it handles strings: each a reason to run without XLA (`avoid_xla`);
- every variable its forward pass writes besides the fit's own state (BatchNorm
  statistics, a custom layer's non-trainable weights, a metric updated in ``loss_fn``),
  found from the resources its ops write, however the variables were passed to `fuse`. A
  refused step puts them back and a ``jit_compile="auto"`` trial undoes them; random
  generators' states (a Keras ``SeedGenerator``, a ``tf.random.Generator``) are kept apart:
  a trial undoes them, a refused step leaves its draws drawn, as the plain loop does;
- trainable variables ``loss_fn`` creates while it is traced (a model built part way):
  the fit would never train them, so that is an error.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import tensorflow as tf

from .._core import Described
from ._checks import _fail, _op_types, _random_ops

try:  # which resources an op writes (nested functions' call ops included)
    from tensorflow.python.framework import auto_control_deps_utils as _acd
except ImportError:  # pragma: no cover - other TF versions: the variables fuse was given
    _acd = None

__all__ = ["Probe", "avoid_xla", "hold", "probe", "resource_writes", "variables_written"]

# TensorFlow's stateful random ops seeded from the graph seed (and their op seed): a
# tf.function draws other numbers from them than eager execution does.
_SEEDED_BY_GRAPH = frozenset(
    {
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "TruncatedNormal",
        "RandomShuffle",
        "Multinomial",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "ParameterizedTruncatedNormal",
    }
)
# Ops that advance a random generator's state; and the names of the state variables a
# Keras SeedGenerator and a tf.random.Generator make.
_RANDOM_STATE_OPS = ("Rng", "Stateful")
_RANDOM_STATE_NAMES = ("seed_generator_state", "StateVar")


@dataclasses.dataclass(frozen=True)
class Probe:
    dtype: tf.DType  # the trace's loss dtype
    random_ops: tuple[str, ...]  # random-number op types (XLA draws other numbers)
    asserts: tuple[str, ...]  # runtime check op types (XLA drops them)
    strings: bool  # the loss handles tf.string tensors (XLA cannot)
    written: tuple[Any, ...] | None  # variables the forward pass writes (None: not known)
    random_states: tuple[Any, ...]  # those of them that are random generators' states


def probe(fit: Any, batch: Any) -> Probe:
    """Trace ``fit``'s loss and gradients on tensors like ``batch``'s (`Probe`)."""
    specs = [tf.TensorSpec(b.shape, b.dtype) for b in batch]
    created: list[Any] = []

    def creator(next_creator: Any, **kwargs: Any) -> Any:
        v = next_creator(**kwargs)
        created.append(v)
        return v

    with tf.variable_creator_scope(creator):
        concrete = tf.function(
            lambda *b: fit._loss_and_grads(b)[0], autograph=False
        ).get_concrete_function(*specs)
    new = [v for v in created if getattr(v, "trainable", False)]
    if new:
        names = [v.name for v in new]
        _fail(
            ValueError,
            "variables",
            Described(f"{len(fit._tf_vars)} variables", fit.variables),
            "every variable loss_fn trains, created before fuse",
            f"loss_fn created the trainable variables {names} while it was first traced (a "
            "model built part way, e.g. a layer built at its first call), so the fit, which "
            "trains the variables it was given, would never train them. Build the model "
            "before fuse: call it once on a batch (model(x)), then pass model (or "
            "model.trainable_variables) to fuse.",
        )
    loss = concrete.structured_outputs
    op_types = _op_types(concrete.graph.as_graph_def())
    written, random_states = variables_written(concrete.graph)
    trained = {id(v) for v in fit._state}
    own = sorted({v.name for v in written or () if id(v) in trained})
    if own:
        warnings.warn(
            f"stepfuse.tf: loss_fn writes variables the fit trains or its optimizer's state "
            f"({', '.join(own[:4])}{', ...' if len(own) > 4 else ''}), so each step applies "
            "those writes and then the optimizer's update, as a plain loop with this loss_fn "
            "does. If loss_fn calls model.train_step, optimizer.apply_gradients or minimize, "
            "that is two updates a step: give fuse the loss alone (e.g. "
            "model.compute_loss(x=x, y=y, y_pred=model(x, training=True))).",
            RuntimeWarning,
            stacklevel=4,
        )
    legacy = sorted(op_types & _SEEDED_BY_GRAPH)
    if legacy:
        warnings.warn(
            f"stepfuse.tf: loss_fn draws with TensorFlow's stateful random ops ({', '.join(legacy)}"
            "; e.g. tf.random.normal, tf.image.random_flip_left_right), which draw other "
            "numbers inside a tf.function than eagerly under the same global seed "
            "(TensorFlow's behaviour). The fit draws what a GradientTape loop inside a "
            "tf.function draws, not an eager one (and leaves the global random state as that "
            "loop does). To draw the same numbers in both, use a "
            "tf.random.Generator or keras.random with a keras.random.SeedGenerator.",
            RuntimeWarning,
            stacklevel=4,
        )
    return Probe(
        dtype=tf.float64 if loss.dtype.base_dtype == tf.float64 else tf.float32,
        random_ops=_random_ops(op_types),
        asserts=("Assert",) if "Assert" in op_types else (),
        strings=any(
            t.dtype == tf.string for op in concrete.graph.get_operations() for t in op.outputs
        ),
        written=written,
        random_states=random_states,
    )


def variables_written(graph: Any) -> tuple[tuple[Any, ...] | None, tuple[Any, ...]]:
    """``(written, random states)``: the variables ``graph``'s ops write, found from the
    resources each op writes (a call of a nested function, a loop or a branch, says which
    of its resources it only reads); ``None`` where TensorFlow cannot say."""
    variables = list(getattr(graph, "variables", ()))
    external = {id(inside): outside for outside, inside in graph.captures}
    by_handle = {id(v.handle): v for v in variables if hasattr(v, "handle")}
    writes = resource_writes(graph.get_operations())
    if writes is None:
        return None, tuple(v for v in variables if _named_random(v))
    written: dict[int, Any] = {}
    random: dict[int, Any] = {}
    for op, t in writes:
        v = by_handle.get(id(external.get(id(t))))
        if v is None:
            continue
        written[id(v)] = v
        if op.type.startswith(_RANDOM_STATE_OPS) or _named_random(v):
            random[id(v)] = v
    return tuple(written.values()), tuple(random.values())


def resource_writes(ops: Any) -> list[tuple[Any, Any]] | None:
    """``(op, resource tensor)`` for each resource one of ``ops`` writes (a call of a
    nested function, a loop or a branch, says which of its resources it only reads);
    None where TensorFlow cannot say (then what is written is not known)."""
    if _acd is None:  # pragma: no cover - other TF versions
        return None
    found = []
    for op in ops:
        try:
            _, writes = _acd.get_read_write_resource_inputs(op)
        except Exception:  # noqa: BLE001 - an op TensorFlow cannot describe
            return None
        found += [(op, t) for t in writes]
    return found


def _named_random(v: Any) -> bool:
    name = getattr(v, "name", "") or ""
    return any(n in name for n in _RANDOM_STATE_NAMES)


def hold(fit: Any, written: Any, drawn: Any) -> bool:
    """Add ``written`` to ``fit._held`` (what a refused step puts back) and ``drawn`` to
    ``fit._drawn`` (random generators' states, left out of ``_held``), the fit's own state
    and its data streams' positions left out of both; whether either grew."""
    out = {id(v) for v in [*fit._state, *fit._streams.variables()]}
    grew = False
    for v in drawn:
        if id(v) not in out and all(v is not d for d in fit._drawn):
            fit._drawn.append(v)
            grew = True
    out |= {id(v) for v in fit._drawn}
    kept = [v for v in fit._held if id(v) not in out]
    grew |= len(kept) != len(fit._held)
    for v in written:
        if id(v) not in out and all(v is not h for h in kept):
            kept.append(v)
            grew = True
    fit._held = kept
    return grew


def avoid_xla(fit: Any, found: Probe) -> None:
    """Run without XLA when the loss draws random numbers (XLA draws other numbers from
    the same seeds), runs runtime checks (XLA drops ``Assert``: a failing
    ``tf.debugging.assert_*`` would not stop the loop) or handles strings (XLA cannot; a
    failed attempt can abort TensorFlow's process)."""
    if found.random_ops:
        ops = ", ".join(found.random_ops)
        fit._without_xla(f"loss_fn draws random numbers ({ops})")
        warnings.warn(
            f"stepfuse.tf: loss_fn draws random numbers (ops: {ops}; e.g. Dropout), and XLA "
            "draws other numbers than TensorFlow's own kernels from the same seeds, so an "
            "XLA-compiled loop would not train as the plain loop (GradientTape + "
            "apply_gradients) does. The fit runs its loop without XLA (fit.jit_compile is "
            "now False; slower). Pass jit_compile=False to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
    elif found.asserts or found.strings:
        what = (
            "runs runtime checks (Assert ops, e.g. tf.debugging.assert_less), which XLA "
            "drops: a failing check would not stop the loop"
            if found.asserts
            else "handles tf.string tensors, which XLA cannot compile"
        )
        fit._without_xla(f"loss_fn {what}")
        if fit._jit_given is True:  # ("auto": fit.plan says it)
            warnings.warn(
                f"stepfuse.tf: loss_fn {what}. The fit runs its loop without XLA "
                "(fit.jit_compile is now False). Pass jit_compile=False to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
