"""JAX backend: N optax steps inside one compiled call.

``fuse(loss_fn, optimizer, steps=...)`` returns a `Fit`: ``fit.init(params)`` makes a
`FitState` and ``fit(state, *batch)`` runs the steps in one ``jax.jit`` call, a
``lax.while_loop`` on the device that recomputes the gradient at every step, carries
the optimizer state, records the losses and stops early on ``tol`` or a non-finite
update. ``fit`` is a pure function of ``(state, *batch)``: it composes with
``jax.jit``, ``jax.vmap`` (many models, one call) and ``jax.grad``.
"""

from __future__ import annotations

import contextlib
import inspect
import struct
import time
import warnings
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

from .._core import (
    OPTIONS_DOC,
    Notifier,
    Stop,
    Trace,
    check_call_steps,
    check_options,
    finish,
    host_trace,
    run_stepwise,
)
from . import _host as _jax_host

__all__ = ["fuse", "Fit", "FitState"]

# A float32/float64 loss buffer travels to the host as the integers of its bits (`Fit._run`).
_INT_OF = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}
_FLOAT_OF = {np.dtype(i): f.type for f, i in _INT_OF.items()}
_CHUNK = 32  # losses kept on the side before each copy into the trace (see `Fit._run`)
# A progress bar alone is drawn about ten times a second, so the loop need not reach the
# host at every multiple of `every`: it does so at a multiple of `every` about this far
# apart, judged by the previous call's speed (a host call and the loop's split cost
# ~20-40 us each here, a few % of a 100,000-step call on the seed at every=1000).
_DRAW_SECONDS = 0.1

jax.tree_util.register_pytree_node(
    Trace,
    lambda t: ((t.loss, t.steps, t.stop), t.record_every),
    lambda k, children: Trace(*children, record_every=k),
)


class FitState(NamedTuple):
    """Everything a fit carries between calls: a pytree, so it vmaps, saves and restores.

    Attributes:
      params: the parameters (any pytree of float arrays).
      opt_state: the optax optimizer state.
      step: int32 scalar, the number of updates applied since ``init``.
    """

    params: Any
    opt_state: Any
    step: jax.Array


def _leaves_with_paths(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _check_params(params: Any, name: str = "params") -> None:
    leaves = _leaves_with_paths(params)
    if not leaves:
        raise ValueError(
            f"`{name}` must hold at least one float array; got {params!r} (no array leaves). "
            "Pass the model's parameters, e.g. a dict of jnp arrays."
        )
    for path, leaf in leaves:
        dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`{name}` must hold only floating-point arrays; got dtype {dtype} at "
                f"{name}{jax.tree_util.keystr(path)} (value {leaf!r}). Cast it, e.g. "
                "jnp.asarray(x, jnp.float32), or close over non-trainable values in loss_fn."
            )


def _check_opt_state(optimizer, params, opt_state) -> None:
    """Raise if ``opt_state`` has not the structure and shapes that ``optimizer.init(params)``
    gives (a state from another optimizer or model: it would fail deep inside optax, or
    worse, run). Checked while tracing, so a call pays nothing for it."""
    spec = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params
    )
    want = jax.eval_shape(optimizer.init, spec)
    fix = (
        "Pass the state this fit's init(params) made or its calls returned; after changing "
        "the optimizer or the model, start again from fit.init(params)."
    )
    want_tree, got_tree = (
        jax.tree_util.tree_structure(want),
        jax.tree_util.tree_structure(opt_state),
    )
    if want_tree != got_tree:
        raise TypeError(
            f"`state.opt_state` is not a state of this fit's optimizer for these params: it is "
            f"{_short(got_tree)}, where optimizer.init(params) gives {_short(want_tree)}. {fix}"
        )
    for (path, got), w in zip(_leaves_with_paths(opt_state), jax.tree_util.tree_leaves(want)):
        if np.shape(got) != w.shape:
            raise ValueError(
                f"`state.opt_state{jax.tree_util.keystr(path)}` has shape {np.shape(got)}, where "
                f"optimizer.init(params) gives {w.shape} (the params' shapes changed?). {fix}"
            )


def _short(tree, limit: int = 400) -> str:
    text = str(tree)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SMALL = 1 << 14  # elements: below this the NaN/inf check copies the leaves into one array


def _inexact_leaves(tree) -> list:
    return [
        jnp.ravel(x)
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]


def _flat_state(opt_state) -> jax.Array:
    """The float entries of an optimizer state as one vector."""
    leaves = _inexact_leaves(opt_state)
    return jnp.concatenate(leaves) if leaves else jnp.zeros((0,), jnp.float32)


def _held(flat: jax.Array) -> jax.Array:
    """``flat``'s non-finite entries, NaN at every finite one (NaN equals nothing): the
    entries of an optimizer state that the next state may keep (see `_nonfinite_probe`)."""
    return jnp.where(jnp.isfinite(flat), jnp.full_like(flat, jnp.nan), flat)


def _nonfinite_probe(tree, state, held):
    """``(probe, held')``: ``probe`` a float32 scalar, 0 if every float entry of ``tree``
    and ``state`` is finite, NaN otherwise (``x * 0`` is 0 for finite ``x``, NaN for
    NaN/inf). The loop carries it as is and its test reads it, so checking a step costs
    one reduction.

    An entry of ``state`` equal to its entry of ``held`` (`_held` of the state before,
    flattened) counts as finite: a state entry already inf and left so
    (reduce_on_plateau's best value before its first average, an injected max_norm=inf)
    is no non-finite update. ``held'`` is ``held`` for the next step. The loop carries
    it: compared with the state of the step before, which the step overwrites in place,
    every state leaf's comparison was a kernel of its own on XLA:CPU (with Adam: 38
    against 31 kernels a step on the seed, 80 against 59 on the `mlp`).

    XLA splits a sum over concatenated leaves into one reduction per leaf; on XLA:CPU
    each is a kernel launch, which dominates for small models, so there the leaves are
    concatenated behind an optimization barrier and summed once (measured on the seed:
    1.07-1.09 -> 1.01-1.02 us/step). Large models keep the per-leaf reductions, which
    read each leaf once and copy nothing.
    """
    checked, kept = _inexact_leaves(tree), _inexact_leaves(state)
    if not checked + kept:
        return jnp.float32(0), held
    dtype = jnp.result_type(*checked, *kept)
    flat = jnp.concatenate([x.astype(dtype) for x in checked + kept])
    if flat.size <= _SMALL:
        flat = jax.lax.optimization_barrier(flat)
    zeros = flat * 0  # times 0 before any cast: a float64 1e300 is finite
    if kept:
        n = flat.size - held.size
        zeros = jnp.where(
            flat == jnp.concatenate([jnp.full((n,), jnp.nan, dtype), held.astype(dtype)]),
            jnp.zeros_like(zeros),
            zeros,
        )
        held = _held(flat[n:]).astype(held.dtype)  # exact: the entries are of that dtype
    return jnp.sum(zeros.astype(jnp.float32)), held


def _extra_args(optimizer, loss, value, grads, batch) -> dict[str, Any]:
    """The keyword arguments optax's ``GradientTransformationExtraArgs`` may read in
    ``update``: the loss ``value`` and gradient ``grad`` at ``params`` (reduce_on_plateau,
    polyak_sgd), ``value_fn(params)``, the loss on this call's batch (lbfgs and the line
    searches), and ``grad_fn(params, i)``, its gradient (sam). An update that takes
    ``**extra_args`` gets the first three, optax's convention (its transformations drop
    what they do not read; the backtracking line search hands any other one on to
    ``value_fn``); one with named keywords gets those it names; a plain
    ``GradientTransformation`` none."""
    if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
        return {}
    on_batch = lambda p: loss(p, *batch)[0]  # noqa: E731
    offered = {
        "value": value,
        "grad": grads,
        "value_fn": on_batch,
        "grad_fn": lambda p, i: jax.grad(on_batch)(p),
    }
    try:
        accepted = list(inspect.signature(optimizer.update).parameters.values())
    except (TypeError, ValueError):  # no signature to read
        accepted = [inspect.Parameter("extra_args", inspect.Parameter.VAR_KEYWORD)]
    names = {a.name for a in accepted}
    if any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted):
        names |= set(offered)  # `_update` drops those a transformation inside refuses
    return {k: v for k, v in offered.items() if k in names}


def _update(optimizer, grads, opt_state, params, extra: dict[str, Any]):
    """``optimizer.update`` with the extra arguments it takes. A ``**extra_args`` update
    (``optax.chain``) hands them to every transformation inside, and some accept only
    their own (``sam``: ``grad_fn``) or pass them on to ``value_fn`` (the line search):
    a name refused while tracing is dropped and the update traced again (no run-time cost)."""
    extra = dict(extra)
    while True:
        try:
            return optimizer.update(grads, opt_state, params, **extra)
        except (
            TypeError
        ) as e:  # "unexpected keyword argument 'x'", "... not consumed by `value_fn`: ['x']"
            message = str(e)
            refused = [k for k in extra if f"'{k}'" in message]
            if not refused or not ("unexpected keyword" in message or "not consumed" in message):
                raise
            for k in refused:
                del extra[k]


def _select(pred, on_true, on_false):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _wants_reverse_mode(leaves) -> bool:
    """Whether the leaves are being differentiated (``jax.grad`` / ``jax.jvp`` tracers),
    also beneath ``jax.vmap``'s batch tracers (``jax.grad(jax.vmap(fit))``)."""
    for x in leaves:
        while isinstance(x, jax.core.Tracer):
            if type(x).__name__ in ("JVPTracer", "LinearizeTracer"):
                return True
            x = getattr(x, "val", None)  # a BatchTracer's batched value
    return False


def _spans_devices(leaves) -> bool:
    """Whether any array is placed on more than one device (sharded or replicated)."""
    return any(len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in leaves)


try:
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - a JAX without it: under a trace any op is staged

    def _trace_state_clean() -> bool:
        return not isinstance(jnp.zeros((), jnp.int32), jax.core.Tracer)


def _varying_like(tree, inputs):
    """``tree`` made varying over every manual mesh axis any of ``inputs`` varies over.

    Under ``jax.shard_map`` with one model per device, the parameters vary across devices;
    after one step so does everything in the loop that depends on them (the counters, the
    loss buffer, a count in the optimizer state), and ``while_loop`` wants its carry's
    types to stay the same, so the carry starts varying. Elsewhere nothing changes."""
    if not (hasattr(jax, "typeof") and hasattr(jax.lax, "pcast")):
        return tree

    def vma(x):  # the manual axes x varies over (`.vma` in some JAX versions)
        t = jax.typeof(x)
        return frozenset(
            getattr(getattr(t, "manual_axis_type", None), "varying", None)
            or getattr(t, "vma", None)
            or ()
        )

    axes = frozenset().union(*map(vma, jax.tree_util.tree_leaves(inputs)))
    if not axes:
        return tree

    def vary(x):
        missing = tuple(sorted(axes - vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(vary, tree)


def _inside_a_trace() -> bool:
    """Whether a JAX transformation is tracing the caller (even one that closes over every
    input, so no argument is a tracer)."""
    return not _trace_state_clean()


def _floor(x: Fraction, dtype) -> np.ndarray:
    """The largest value of ``dtype`` not above the exact number ``x``."""
    t = np.asarray(float(x), dtype)
    return np.nextafter(t, dtype.type(-np.inf)) if Fraction(float(t)) > x else t


def _within_tol(tol: float, dtype) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``met(a, b)``: whether ``abs(a - b) <= tol`` holds exactly, as the host computes it
    from the recorded losses (the stepwise mode; float64 is exact for them).

    ``a - b`` rounded in the loss dtype can cross ``tol`` when the losses are more than 2x
    apart, and a float32 ``tol`` may round above the float64 one, either way stopping a
    step early or late. So the difference is kept exactly as ``s + e`` (TwoSum: ``s`` the
    rounded difference, ``e`` its rounding error, both exact in the dtype; additions only,
    which XLA does not reassociate) and compared with ``tol`` split at the two values of
    the dtype around it. Losses narrower than float32 are compared in float32 (exactly).
    """
    dtype = np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    if tol == float("inf"):
        return lambda a, b: jnp.abs(a.astype(dtype) - b.astype(dtype)) <= np.inf  # False for NaN
    lo = _floor(Fraction(tol), dtype)  # lo <= tol < hi, neighbours in the dtype
    hi = np.nextafter(lo, dtype.type(np.inf))
    room_lo = _floor(Fraction(tol) - Fraction(float(lo)), dtype)  # >= 0
    room_hi = (
        _floor(Fraction(tol) - Fraction(float(hi)), dtype)
        if np.isfinite(hi)
        else np.asarray(-np.inf, dtype)
    )  # < 0

    def met(a, b):
        a, b = a.astype(dtype), b.astype(dtype)
        s = a - b
        z = s - a
        e = (a - (s - z)) + (-b - z)  # a - b == s + e exactly
        neg = s < 0
        s, e = jnp.where(neg, -s, s), jnp.where(neg, -e, e)
        # s < lo: s + e < lo's neighbour above s, at most lo. s > hi: s + e > hi > tol.
        return (s < lo) | ((s == lo) & (e <= room_lo)) | ((s == hi) & (e <= room_hi))

    return met


def _inputs_reaching_output(jaxpr) -> list:
    """For each input of ``jaxpr``, whether the first output (the loss) may depend on it.

    A conservative walk back from the loss through the equations; ``stop_gradient``
    cuts the dependency, as it does for the gradient.
    """
    Var = jax.extend.core.Var
    needed = {v for v in jaxpr.outvars[:1] if isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name == "stop_gradient" or not any(v in needed for v in eqn.outvars):
            continue
        needed.update(v for v in eqn.invars if isinstance(v, Var))
    return [v in needed for v in jaxpr.invars]


class _Loss:
    """``loss_fn`` traced once into a jaxpr whose output is checked before anything runs."""

    def __init__(self, loss_fn, has_aux, params, batch):
        try:
            closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(params, *batch)
        except (TypeError, ValueError) as e:
            shapes = jax.tree_util.tree_map(lambda a: tuple(np.shape(a)), (params, batch))
            # The plain type: JAX's own subclasses (ConcretizationTypeError ...) take a tracer.
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"`loss_fn(params, *batch)` failed with params/batch shapes {shapes}: {e} "
                "Check that the batch passed to fit(state, *batch) fits the model."
            ) from e
        if has_aux and not (isinstance(shape, (tuple, list)) and len(shape) == 2):
            raise TypeError(
                f"`loss_fn` must return (loss, aux) with has_aux=True; got {shape!r}. "
                "Return a pair, or build with has_aux=False."
            )
        out = shape[0] if has_aux else shape
        if (
            not isinstance(out, jax.ShapeDtypeStruct)
            or out.shape != ()
            or not jnp.issubdtype(out.dtype, jnp.floating)
        ):
            desc = f"shape {out.shape}, dtype {out.dtype}" if hasattr(out, "shape") else repr(out)
            raise TypeError(
                f"`loss_fn` must return a floating-point scalar{' (with aux)' if has_aux else ''}; "
                f"got {desc}. Reduce it to a scalar (e.g. jnp.mean) and make it float "
                "(e.g. .astype(jnp.float32))."
            )
        n_params = len(jax.tree_util.tree_leaves(params))
        if not any(_inputs_reaching_output(closed.jaxpr)[:n_params]):
            raise ValueError(
                "`loss_fn` does not depend on `params`: every gradient would be zero and no "
                "step would change anything. Compute the loss from the params argument "
                "(not from arrays closed over) and do not wrap it in stop_gradient."
            )
        self.dtype = out.dtype
        self.aux_shape = shape[1] if has_aux else None
        _, self._in_tree = jax.tree_util.tree_flatten((params, *batch))
        self._out_tree = jax.tree_util.tree_structure(shape)
        self._fun = jax.extend.core.jaxpr_as_fun(closed)
        self.has_aux = has_aux

    def __call__(self, params, *batch):
        flat = jax.tree_util.tree_leaves((params, *batch))
        out = jax.tree_util.tree_unflatten(self._out_tree, self._fun(*flat))
        return out if self.has_aux else (out, None)


class Fit:
    """A fused fit built by `fuse`: ``init(params)`` then ``state, trace = fit(state, *batch)``."""

    def __init__(self, loss_fn, optimizer, opts, has_aux, differentiable, compiler_options=None):
        self.loss_fn, self.optimizer, self.opts = loss_fn, optimizer, opts
        self.has_aux, self.differentiable = has_aux, differentiable
        self.compiler_options = dict(compiler_options or {})
        jit_options = {"compiler_options": self.compiler_options} if self.compiler_options else {}
        self._notifier: Notifier | None = None
        self._callback_error: BaseException | None = None
        self._ints: dict[int, jax.Array] = {}  # see `_int32`
        self._fused = jax.jit(
            self._run, static_argnames=("scan_steps", "host_id", "pack", "rebuild"), **jit_options
        )
        self._muted = False  # while `_rebuild` runs: its notifications are the first run's again
        self._seconds_per_step: float | None = None  # the last notifying call's speed
        self._host_id = _jax_host.register(self._from_host) if opts.notify else None
        self._step = jax.jit(self._propose, **jit_options)

    # -- public ---------------------------------------------------------------------
    def init(self, params) -> FitState:
        """The starting `FitState` for ``params`` (the optimizer state from ``optimizer.init``)."""
        _check_params(params)
        params = jax.tree_util.tree_map(jnp.asarray, params)
        return FitState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32))

    def __call__(self, state: FitState, *batch, steps: int | None = None):
        """Run ``steps`` updates (default: the ``steps`` given to `fuse`) in one call.

        Args:
          state: a `FitState` from ``init`` or from a previous call.
          *batch: the arguments after ``params`` of ``loss_fn``; passed once per call.
          steps: updates for this call; any value up to the built ``steps`` reuses the
            compiled program.

        Returns:
          ``(state, trace)``: the new `FitState` and a `stepfuse.Trace`. With
          ``has_aux=True``, ``(state, trace, aux)`` where ``aux`` is that of the last
          evaluated step.
        """
        if not isinstance(state, FitState):
            raise TypeError(
                f"`state` must be a stepfuse.jax.FitState; got {type(state).__name__}. "
                "Make one with fit.init(params) and pass the state each call returns."
            )
        n = check_call_steps(steps, self.opts, capped=True)  # both modes: one contract
        if self.opts.mode == "stepwise":
            if _inside_a_trace():
                raise TypeError(
                    "stepfuse.jax: mode='stepwise' cannot run inside jax.jit / jax.vmap / jax.grad: "
                    "it is a Python loop that reads every step's loss on the host to decide "
                    "whether to go on. Call the stepwise fit outside the transform (one call "
                    "per model), or use mode='fused' (the default), which composes with them."
                )
            return self._run_stepwise(state, batch, n)
        leaves = jax.tree_util.tree_leaves((state, batch))
        # Inside a user's transform (also a jax.jit that closes over every input, so that no
        # argument is a tracer): its callbacks go through JAX, which re-raises their errors.
        traced = _inside_a_trace()
        # Reverse-differentiable: a scan of the built `steps`, those past `n` masked, so every
        # `steps=n` runs the same program.
        scan_steps = (
            self.opts.steps
            if (self.differentiable or (traced and _wants_reverse_mode(leaves)))
            else None
        )
        notify = self.opts.notify and not traced
        if traced and self.opts.on_nonfinite == "raise":
            warnings.warn(
                "stepfuse.jax: on_nonfinite='raise' cannot raise inside jax.jit / jax.vmap "
                "(the trace stays on the device there); check trace.stop == Stop.NONFINITE.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._callback_error = None
        with self._notify(int(state.step) if notify else None, n):
            # Outside any user transform the loop reaches the host through stepfuse's own
            # FFI target (measured on XLA:CPU: ~20 us per callback in this loop against ~100-200
            # us for jax.debug.callback); inside one, jax.debug.callback.
            # (stepfuse's target has no sharding: inputs over several devices use JAX's callback)
            host_id = self._host_id if notify and not _spans_devices(leaves) else None
            t0 = time.perf_counter()
            m, period = np.int32(n), self._period(notify)
            if not traced:
                m, period = self._int32(m), self._int32(period)
            start = state
            state, out, aux = self._fused(
                state,
                batch,
                m,
                period,
                scan_steps=scan_steps,
                host_id=host_id,
                pack=not traced,
                rebuild=traced,
            )
            if not isinstance(out, tuple):  # packed: one transfer to the host (see `_run`)
                out = np.asarray(out)
                buf = out[:-2].view(np.float32 if out.dtype == np.int32 else _FLOAT_OF[out.dtype])
                applied, stop = out[-2:].tolist()
            else:
                buf, applied, stop = out
            if notify and not traced:  # the host calls happen during the program: wait for it
                done = int(applied)
                self._notifier.done(done)
                self._seconds_per_step = (time.perf_counter() - t0) / max(done, 1)
        if self._callback_error is not None:
            raise self._callback_error
        if not traced and scan_steps is None and int(stop) == Stop.NONFINITE:
            state = self._rebuild(start, batch, int(applied), period, host_id)
        k = self.opts.record_every
        if traced or np.ndim(buf) != 1:
            trace = Trace(buf[..., : self.opts.capacity], applied, stop, k)
        else:
            trace = host_trace(np.asarray(buf), applied, stop, k)
            if self.opts.on_nonfinite == "raise":
                trace = finish(
                    trace, self.opts, int(state.step) - trace.steps, state
                )  # error.state: the new one
        return (state, trace, aux) if self.has_aux else (state, trace)

    def _rebuild(self, state: FitState, batch, good: int, period, host_id) -> FitState:
        """The state after the first ``good`` updates of a call from ``state``: after a
        refused update, the state before it.

        The fused loop applies every update and stops after a refused one (see `_run`).
        This runs the call's finite steps again through the same compiled program, its
        notifications muted: a step is one function of the loop's carry, wherever chunks
        and notifications split the loop, so it gives the first run's state bit for bit
        (tested). It costs those steps once more, in a call that stops on NONFINITE only.
        """
        self._muted = True
        try:
            new, _, _ = self._fused(
                state,
                batch,
                self._int32(good),
                period,
                scan_steps=None,
                host_id=host_id,
                pack=True,
                rebuild=False,
            )
            return jax.block_until_ready(new)  # its host calls happen while it runs
        finally:
            self._muted = False

    def _compiled_text(self, state: FitState, *batch, steps: int | None = None) -> str:
        """The HLO text of the program a plain call of ``steps`` runs, as XLA compiled it
        (for inspection: `benchmarks/jax_kernels.py`, the tests)."""
        n = np.int32(self.opts.steps if steps is None else steps)
        return (
            self._fused.lower(
                state,
                batch,
                n,
                self._period(False),
                scan_steps=None,
                host_id=None,
                pack=True,
                rebuild=False,
            )
            .compile()
            .as_text()
        )

    def _int32(self, value) -> jax.Array:
        """``value`` as an int32 array already on the device, kept per value: a NumPy
        scalar argument is transferred at every call (~6 us each on XLA:CPU here, of a
        ~50 us one-step call on the seed). Made concrete even while a user's ``jax.jit``
        is tracing the call (a kept tracer would escape its trace)."""
        value = int(value)
        array = self._ints.get(value)
        if array is None:
            if len(self._ints) >= 64:
                self._ints.clear()
            with jax.ensure_compile_time_eval():
                array = self._ints[value] = jnp.asarray(value, jnp.int32)
        return array

    # -- the fused program ----------------------------------------------------------
    def _period(self, notify: bool) -> np.int32:
        """Steps between the loop's host calls: `every`, or for a bar alone a multiple of
        it about ``_DRAW_SECONDS`` long at the previous call's speed."""
        every, speed = self.opts.every or 1, self._seconds_per_step
        if not notify or self.opts.callback is not None or not speed:
            return np.int32(every)
        return np.int32(every * max(1, min(int(_DRAW_SECONDS / (speed * every)), 2**30 // every)))

    def _notify(self, start, n):
        if not self.opts.notify or start is None:
            self._notifier = None
            return contextlib.nullcontext()
        self._notifier = Notifier(self.opts, start, n, label="stepfuse.jax")
        return self._notifier

    def _dispatch(self, packed):
        """The host side of the in-loop callback through ``jax.debug.callback``: an int32
        array of (step, hit, the loss's bits: one int for a float32 loss, two for float64),
        one row per model under vmap."""
        if self._muted:
            return
        packed = np.asarray(packed, np.int32)
        packed = packed.reshape(-1, packed.shape[-1])
        losses = np.ascontiguousarray(packed[:, 2:]).view(
            np.float32 if packed.shape[1] == 3 else np.float64
        )
        for s, h, l in zip(packed[:, 0], packed[:, 1], losses[:, 0]):
            if self._callback_error is not None:
                return
            if h:
                self._deliver(s, l)

    def _from_host(self, values):
        """The host side of the FFI path (one model, outside user transforms): the ints
        (step, hit, the loss's bits: one int for a float32 loss, two for float64)."""
        step, hit, *bits = values
        if hit and self._callback_error is None and not self._muted:
            fmt = "<f" if len(bits) == 1 else "<d"
            self._deliver(step, struct.unpack(fmt, struct.pack(f"<{len(bits)}i", *bits))[0])

    def _deliver(self, step, loss) -> None:
        """One notification.

        Called eagerly (the usual case) it goes to the `Notifier` (bar and callback); an
        exception is kept, later notifications of the call are skipped, and ``__call__``
        re-raises it once the device loop has finished (the loop does not wait for the
        host, so it runs to its end first; the caller's state is untouched since ``fit``
        is pure). Inside a user's ``jax.jit``/``jax.vmap`` only ``callback`` fires (no
        progress bar) and its exception surfaces through JAX.
        """
        if self._notifier is None:
            if self.opts.callback is not None:
                self.opts.callback(int(step), float(loss))
            return
        try:
            self._notifier(step, loss)
        except BaseException as e:  # re-raised on the host once the call returns
            self._callback_error = e

    def _propose(self, params, opt_state, batch, loss: _Loss | None = None, held=None):
        _check_opt_state(self.optimizer, params, opt_state)
        loss = loss or _Loss(self.loss_fn, self.has_aux, params, batch)
        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, *batch)
        updates, new_opt = _update(
            self.optimizer,
            grads,
            opt_state,
            params,
            _extra_args(self.optimizer, loss, value, grads, batch),
        )
        new_params = optax.apply_updates(params, updates)
        new_params = jax.tree_util.tree_map(lambda n, p: n.astype(p.dtype), new_params, params)
        # `held`: the state entries that count as finite while left unchanged (see
        # `_nonfinite_probe`), carried by the loop; computed here for a single step.
        held = _held(_flat_state(opt_state)) if held is None else held
        probe, held = _nonfinite_probe((value, grads, new_params), new_opt, held)
        return value, aux, new_params, new_opt, probe, held

    def _run(
        self,
        state: FitState,
        batch,
        n,
        period,
        *,
        scan_steps=None,
        host_id=None,
        pack=False,
        rebuild=True,
    ):
        params, opt_state, step0 = state
        opts, k, C = self.opts, self.opts.record_every, _CHUNK
        loss = _Loss(self.loss_fn, self.has_aux, params, batch)
        size = -(-opts.capacity // C) * C  # whole chunks, plus one slot for unrecorded steps
        # The last loss is carried from step to step only where it is read each step (`tol`;
        # notifications in the masked scan): one kernel less a step on XLA:CPU (2-3% on
        # the seed). The chunked loop's notifications read it back from the trace.
        keep_loss = opts.tol is not None or (opts.notify and scan_steps is not None)
        within_tol = None if opts.tol is None else _within_tol(opts.tol, loss.dtype)
        aux0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), loss.aux_shape)
        nan = jnp.array(jnp.nan, loss.dtype)
        # (step, params, opt_state, trace, last loss, the last step's non-finite probe (0 or
        # NaN), aux, the loss before the last, the state entries it may keep: see
        # `_nonfinite_probe`)
        carry = (
            jnp.int32(0),
            params,
            opt_state,
            jnp.full((size + 1,), jnp.nan, loss.dtype),
            nan,
            jnp.float32(0),
            aux0,
            nan,
            _held(_flat_state(opt_state)),
        )
        carry = _varying_like(carry, (params, opt_state, batch))

        def make_body(first, unrecorded, guarded):
            """One step; its loss goes to ``buf[i // k - first]`` or, off the record, to ``buf[unrecorded]``.

            ``guarded``: a non-finite update is not applied (the masked scan). Otherwise the
            step applies every update and the loop stops after a refused one (its test reads
            the probe); `Fit._rebuild` (or `redo`, in a traced call) then rebuilds the state
            before it. Selecting the old state at every step cost a kernel per
            optimizer-state leaf on XLA:CPU, where the selected value must be materialised
            apart from its update.
            """

            def body(c):
                i, params, opt_state, buf, prev, _, _, before, held = c
                value, aux, new_params, new_opt, probe, new_held = self._propose(
                    params, opt_state, batch, loss, held
                )
                slot = jnp.where(i % k == 0, i // k - first, unrecorded)
                buf = jax.lax.dynamic_update_index_in_dim(buf, value, slot, 0)
                ok = jnp.isfinite(probe)
                if guarded:
                    new_params, new_opt = _select(ok, (new_params, new_opt), (params, opt_state))
                # Written after the probe has read the old one (it depends on the probe): else
                # XLA copies it twice a step to update it in place.
                new_held = _select(ok, new_held, held)
                last = value if keep_loss else prev
                before = prev if opts.tol is not None else before
                return i + 1, new_params, new_opt, buf, last, probe, aux, before, new_held

            return body

        def refused(c):
            """Whether the last evaluated step was non-finite (the loop stops there)."""
            return ~jnp.isfinite(c[5])

        def applied(c):
            """Updates applied so far: every evaluated step but a refused (non-finite) last one
            (the loop stops there), so the loop needn't carry a counter."""
            return c[0] - refused(c).astype(jnp.int32)

        def converged(c):
            """Whether the last two losses met `tol` (the last update was applied: TOL).

            Read from the carried losses, at the loop's test rather than in the step: there
            XLA fuses the loss's last operation into the comparison with the one before, and
            may round that copy differently (an FMA) from the one it records, so a `tol`
            within an ulp of a recorded difference could stop a step early or late.
            """
            if opts.tol is None:
                return jnp.bool_(False)
            return within_tol(c[4], c[7])

        def live(c):
            return ~refused(c) & ~converged(c)

        def running(c):
            return (c[0] < n) & live(c)

        def last_loss(c):
            """The loss of the last evaluated step: carried, or read back from the trace
            (recorded, or else the slot for unrecorded steps; see `chunk`)."""
            if keep_loss:
                return c[4]
            j = c[0] - 1
            return c[3][jnp.where(j % k == 0, j // k, size)]

        def notify(before, c):
            """Call the host with (step, loss) if the last update reached a multiple of `every`."""
            hit = (applied(c) > applied(before)) & ((step0 + applied(c)) % period == 0)
            # Fire and forget: a callback whose result fed back into the loop would make the
            # device wait on the host (measured: ~4 ms of CPU per callback on XLA:CPU).
            # One int32 array (step, hit, the loss's bits): every argument of a host callback
            # costs ~50 us on XLA:CPU, so the values travel as one. A float64 loss keeps its
            # precision (two ints), any other is exact as a float32.
            value = last_loss(c)
            value = value if value.dtype == jnp.float64 else value.astype(jnp.float32)
            bits = jnp.ravel(jax.lax.bitcast_convert_type(value, jnp.int32))
            packed = jnp.concatenate([jnp.stack([step0 + applied(c), hit.astype(jnp.int32)]), bits])
            if host_id is not None:
                _jax_host.send(host_id, packed)
            else:
                jax.debug.callback(self._dispatch, packed)
            return c

        def chunk(c, end):
            """Run the steps, up to iteration ``end``, whose losses fill one chunk of C records.

            The losses go to a small buffer that is copied into the trace once per chunk:
            a per-step write into the whole trace buffer costs far more on XLA:CPU.
            """
            i0, big = c[0], c[3]
            first = (i0 // (C * k)) * C
            limit = jnp.minimum(end, (first + C) * k)
            small = jnp.concatenate([jax.lax.dynamic_slice(big, (first,), (C,)), big[-1:]])
            inner = jax.lax.while_loop(
                lambda c: (c[0] < limit) & live(c),
                make_body(first, C, False),
                c[:3] + (small,) + c[4:],
            )
            big = jax.lax.dynamic_update_slice(big, inner[3][:C], (first,))
            if opts.notify and not keep_loss:  # the last unrecorded loss, for `last_loss`
                big = big.at[size].set(inner[3][C])
            return inner[:3] + (big,) + inner[4:]

        def segment(c):
            """The chunks up to the next multiple of `every`, then the host callback.

            The callback sits in its own outer loop: inside the chunk loop its side effect
            made XLA copy the whole trace buffer at every chunk.
            """
            end = jnp.minimum(n, c[0] + period - (step0 + applied(c)) % period)
            new = jax.lax.while_loop(lambda c: (c[0] < end) & live(c), lambda c: chunk(c, end), c)
            return notify(c, new)

        def redo(good):
            """`Fit._rebuild` inside the program, for a call traced by a user's transform."""
            again = (
                carry[:3]
                + _varying_like((jnp.full((size + 1,), jnp.nan, loss.dtype),), carry)
                + carry[4:]
            )
            again = jax.lax.while_loop(lambda a: a[0] < good, lambda a: chunk(a, good), again)
            return again[1], again[2]

        if scan_steps is None:
            out = jax.lax.while_loop(
                running, segment if opts.notify else lambda c: chunk(c, n), carry
            )
            if rebuild:  # else the host does it (`Fit._rebuild`): this cond costs ~5 us a call
                # under vmap both branches run: no step for the models that need none
                good = jnp.where(refused(out), applied(out), 0)
                params, opt_state = jax.lax.cond(refused(out), redo, lambda _: out[1:3], good)
                out = out[:1] + (params, opt_state) + out[3:]
        else:  # reverse-differentiable: fixed length, finished steps masked
            body = make_body(0, size, True)

            def scan_body(c, _):
                new = jax.lax.cond(running(c), body, lambda c: c, c)
                return (notify(c, new) if opts.notify else new), None

            out = jax.lax.scan(scan_body, carry, None, length=scan_steps)[0]
        _, params, opt_state, buf, _, _, aux, _, _ = out
        applied = applied(out)
        stop = jnp.where(
            refused(out), Stop.NONFINITE, jnp.where(converged(out), Stop.TOL, Stop.STEPS)
        )
        ints = _INT_OF.get(np.dtype(buf.dtype))
        if pack and ints is not None:
            # For the host: the losses' bits, then applied and stop, as one integer array.
            # Each array read back is a transfer of its own (~14 us a scalar on XLA:CPU, a
            # tenth of a 1-step call on the seed).
            counts = jnp.stack([applied, jnp.int32(stop)]).astype(ints)
            return (
                FitState(params, opt_state, step0 + applied),
                jnp.concatenate([jax.lax.bitcast_convert_type(buf, ints), counts]),
                aux,
            )
        return FitState(params, opt_state, step0 + applied), (buf, applied, stop), aux

    # -- the stepwise reference -------------------------------------------------------
    def _run_stepwise(self, state: FitState, batch, n):
        held = {"params": state.params, "opt": state.opt_state, "aux": None}

        def propose():
            value, aux, new_params, new_opt, probe, _ = self._step(
                held["params"], held["opt"], batch
            )
            held["aux"] = aux
            return np.asarray(value), bool(np.isfinite(probe)), (new_params, new_opt)

        def commit(token):
            held["params"], held["opt"] = token

        start = int(state.step)
        with Notifier(self.opts, start, n, label="stepfuse.jax") as note:
            trace = run_stepwise(
                propose, commit, n, self.opts, start, note if self.opts.notify else None
            )
            note.done(trace.steps)
        new = FitState(held["params"], held["opt"], jnp.int32(start + trace.steps))
        trace = finish(trace, self.opts, start, new)
        return (new, trace, held["aux"]) if self.has_aux else (new, trace)


def fuse(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    steps: int,
    tol: float | None = None,
    record_every: int = 1,
    has_aux: bool = False,
    callback: Callable[[int, float], Any] | None = None,
    every: int | None = None,
    progress: bool = False,
    on_nonfinite: str = "stop",
    mode: str = "fused",
    differentiable: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> Fit:
    """Build a fused fit: ``steps`` optax updates of ``loss_fn`` in one compiled call.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar`` (or ``(scalar, aux)`` with
        ``has_aux=True``); a pure JAX function.
      optimizer: any ``optax.GradientTransformation`` (schedules, ``chain`` ...). A
        ``GradientTransformationExtraArgs`` gets ``value`` (the loss), ``grad`` and
        ``value_fn`` (the loss of params on this call's batch) at every step, as
        ``optax.lbfgs``, ``optax.contrib.reduce_on_plateau`` and ``optax.polyak_sgd`` need,
        and ``grad_fn`` (``optax.contrib.sam``); an ``optax.MultiSteps`` is taken as its
        ``gradient_transformation()``.
    {options}
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the call returns the aux of the
        last evaluated step as a third value.
      differentiable: run the loop as a ``lax.scan`` of the built ``steps`` iterations
        (those past a call's ``steps=n``, and finished ones, masked) so that ``jax.grad``
        can go through it in reverse mode; one program serves every ``n`` (a call costs
        the built ``steps`` iterations, masked ones cheap). Chosen automatically when ``fit`` is
        called directly under ``jax.grad``; set it when ``fit`` sits inside a
        ``jax.jit`` that is then differentiated.
      compiler_options: XLA options for the fused program and the stepwise
        reference's step (``jax.jit(..., compiler_options=...)``), e.g.
        ``{"xla_cpu_experimental_ynn_fusion_type": ""}``, which on XLA:CPU made the
        seed's perceptron ~1.7x faster a step here (see the README). Checked when
        `fuse` is called; ignored where ``fit`` is traced inside a user's ``jax.jit``
        (that ``jit``'s options apply).

    Returns:
      A `Fit`: ``state = fit.init(params)``; ``state, trace = fit(state, *batch)``.

    Example:
      >>> import jax.numpy as jnp, optax, stepfuse.jax as sf
      >>> fit = sf.fuse(lambda w, x: jnp.sum((w - x) ** 2), optax.sgd(0.1), steps=50)
      >>> state, trace = fit(fit.init(jnp.zeros(3)), jnp.ones(3))
      >>> trace.steps, round(float(state.params[0]), 4)
      (50, 1.0)
    """
    opts = check_options(steps, tol, record_every, callback, every, progress, on_nonfinite, mode)
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be callable as loss_fn(params, *batch); got {loss_fn!r} "
            f"({type(loss_fn).__name__}). Pass the function that computes the loss."
        )
    if not isinstance(optimizer, (optax.GradientTransformation, optax.MultiSteps)):
        raise TypeError(
            f"`optimizer` must be an optax.GradientTransformation; got {optimizer!r} "
            f"({type(optimizer).__module__}.{type(optimizer).__name__}). Pass e.g. optax.adam(1e-3); "
            "for Keras or torch.optim optimizers use stepfuse.tf or stepfuse.torch."
        )
    if isinstance(optimizer, optax.MultiSteps):  # a wrapper that builds its transformation
        optimizer = optimizer.gradient_transformation()
    for name, flag in (("has_aux", has_aux), ("differentiable", differentiable)):
        if not isinstance(flag, bool):
            raise TypeError(f"`{name}` must be True or False; got {flag!r}. Pass a bool.")
    return Fit(
        loss_fn, optimizer, opts, has_aux, differentiable, _check_compiler_options(compiler_options)
    )


def _check_compiler_options(options) -> dict[str, Any]:
    """``options`` as a dict XLA accepts (tried on a one-op program), or a clear error."""
    if options is None:
        return {}
    fix = (
        "Pass None or a dict of XLA option names to values, e.g. "
        '{"xla_cpu_experimental_ynn_fusion_type": ""}.'
    )
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"`compiler_options` must be a dict with str keys; got {options!r}. {fix}")
    bad = {k: v for k, v in options.items() if not isinstance(v, (str, bool, int, float))}
    if bad:
        raise TypeError(
            f"`compiler_options` values must be str, bool, int or float; got {bad!r}. {fix}"
        )
    options = dict(options)
    if options:
        if "compiler_options" not in inspect.signature(jax.jit).parameters:
            raise TypeError(
                f"`compiler_options` needs a jax whose jax.jit takes them; jax "
                f"{jax.__version__} does not. Upgrade jax, or pass None."
            )
        try:
            jax.jit(lambda x: x + 1, compiler_options=options)(np.float32(0))
        except Exception as e:  # XLA's error for an unknown name or a bad value
            raise ValueError(
                f"`compiler_options` {options!r} were refused by XLA "
                f"({jax.default_backend()}): {e}. {fix}"
            ) from e
    return options


fuse.__doc__ = fuse.__doc__.replace("    {options}", OPTIONS_DOC)
