"""The fused program: a call's steps in one compiled ``lax.while_loop``.

Each step moves the shared bookkeeping (`stepfuse._core.loop.Flow`) with the shared
functions over JAX arrays (`OPS`): where its loss is recorded, when ``tol`` is met,
whether the step was finite, why the loop stopped and how many updates it applied are
those of every other loop. What is JAX's own is how the steps are laid out:

- chunks: the losses go to a small buffer of `CHUNK` records that is copied into the
  trace once per chunk (a per-step write into the whole trace buffer costs far more on
  XLA:CPU);
- segments: with notifications, the chunks up to the next multiple of the call's
  ``period`` and then one host call, in an outer loop of their own;
- no select per step: the loop applies every update and stops after a refused one;
  the state before it is rebuilt by running the finite steps again (`Fit._rebuild` on
  the host, `_Loop.rebuilt` inside a user's transform);
- the masked scan: for reverse-mode ``jax.grad``, a fixed-length ``lax.scan`` whose
  finished steps are skipped by a ``cond`` and whose refused update is not applied;
- data streams (`_data.Streams`): each step picks its minibatch from the call's stacked
  batches or resident dataset; a shuffled dataset's permutation is carried and refreshed
  at the start of a chunk, which ends at the epoch boundary (per step in the masked scan);
- evaluation (`_eval`): with ``eval_fn``, the chunks run in a loop of their own up to the
  next multiple of ``eval_every``, then a ``cond`` evaluates if an update reached it (per
  step in the masked scan). The steps' loop is the same with or without it, and a fit
  without ``eval_fn`` compiles the program it did before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._core import Options, ceil_div
from .._core.loop import (
    Flow,
    Met,
    advance,
    applied,
    record_slot,
    refused,
    running,
    stop_code,
    within_tol,
)
from . import _host
from ._checks import Loss, check_dtypes_kept
from ._data import Streams
from ._eval import EvalBuffers, Evaluation, evaluate
from ._ops import OPS, select
from ._probe import Plan, flat_state, held, unseen
from ._state import FitState
from ._step import plan, propose
from ._transforms import varying_like

__all__ = ["CHUNK", "Carry", "run", "unpack"]

# A float32/float64 loss buffer travels to the host as the integers of its bits (`run`).
INT_OF: dict[np.dtype, type] = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}
FLOAT_OF: dict[np.dtype, type] = {np.dtype(np.int32): np.float32, np.dtype(np.int64): np.float64}
CHUNK = 32  # losses kept on the side before each copy into the trace (see `_Loop.chunk`)


class Carry(NamedTuple):
    """What the fused loop carries from step to step.

    Attributes:
      flow: the shared bookkeeping: steps evaluated, the last step's finite probe, and
        the last two losses where they are read each step (``last`` for ``tol`` and the
        masked scan's notifications, ``before`` for ``tol``; else None, not carried:
        the chunked loop's notifications read the last loss back from the trace, one
        kernel less a step on XLA:CPU).
      params, opt_state: the current parameters and optimizer state.
      buf: recorded losses: whole chunks of slots, then one slot for unrecorded steps.
      aux: the aux of the last evaluated step (None without ``has_aux``).
      kept: the optimizer- and model-state entries that may stay non-finite
        (`_probe.held`).
      model_state: the model's state with ``has_state`` (None otherwise, not carried).
      feed: the shuffled data streams' epochs and permutations (`_data.Streams`; None
        without one, not carried).
      evals: the evaluations' buffers (`_eval.EvalBuffers`) with ``eval_fn``; None
        otherwise, and never carried by the steps' own loop (`_Loop.chunk`).
      exact: with a lazy check (`_probe.Plan`), whether every step checks every value (a
        bool scalar: the call was asked to, or its state started with a NaN/inf); None
        otherwise, not carried.
    """

    flow: Flow
    params: Any
    opt_state: Any
    buf: jax.Array
    aux: Any
    kept: jax.Array
    model_state: Any = None
    feed: Any = None
    evals: EvalBuffers | None = None
    exact: Any = None


class _Loop:
    """The pieces of one traced fused loop, over the constants of the call being traced."""

    def __init__(
        self,
        opts: Options,
        optimizer: optax.GradientTransformation,
        loss: Loss,
        dispatch: Callable[[jax.Array], None],
        batch: tuple,
        step0: jax.Array,
        n: jax.Array,
        period: jax.Array,
        host_id: int | None,
        scanned: bool,
        evaluation: Evaluation | None = None,
        eval_batch: tuple = (),
        exact: Any = None,
    ):
        self.opts, self.k = opts, opts.record_every
        self.exact = exact  # the call's request to check every value at every step
        self.evaluation, self.eval_batch = evaluation, eval_batch
        # (as an int32: a larger eval_every is never reached by the int32 step count)
        self.eval_every = min(opts.eval_every or 1, 2**31 - 1)
        self.optimizer, self.loss, self.dispatch, self.batch = optimizer, loss, dispatch, batch
        self.step0, self.n, self.period, self.host_id = step0, n, period, host_id
        self.streams = Streams(batch)
        self.size = ceil_div(opts.capacity, CHUNK) * CHUNK  # whole chunks (+1 slot: `Carry.buf`)
        self.keep_loss = opts.tol is not None or (opts.notify and scanned)
        self.met: Met | None = None if opts.tol is None else within_tol(OPS, opts.tol, loss.dtype)
        self.plan: Plan | None = None  # what the finite check may leave unread (`start`)

    def start(self, params: Any, opt_state: Any, model_state: Any) -> Carry:
        nan = jnp.array(jnp.nan, self.loss.dtype)
        flow = Flow(
            jnp.int32(0),
            jnp.float32(0),
            nan if self.keep_loss else None,
            nan if self.opts.tol is not None else None,
        )
        aux0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.loss.aux_shape)
        check_dtypes_kept(self.optimizer, params, opt_state)  # (a plain loop would promote)
        kept = held(flat_state((opt_state, model_state)))
        feed = self.streams.start(self.step0)
        evals = None if self.evaluation is None else self.evaluation.start(self.opts.eval_capacity)
        # A lazy check only where the loop can run every step of a call again (not in the
        # masked scan, whose refused update is never applied).
        self.plan = plan(
            self.optimizer,
            self.loss,
            params,
            opt_state,
            self.streams.sample(self.batch),
            model_state,
            lazy=self.exact is not None,
        )
        exact = None
        if self.plan.lazy:
            # every step checks every value if asked to, or if the state holds a NaN/inf
            # (an entry kept so: `_probe.nonfinite_probe`)
            exact = jnp.logical_or(self.exact, jnp.any(jnp.logical_not(jnp.isnan(kept))))
        carry = Carry(
            flow, params, opt_state, self.fresh_buf(), aux0, kept, model_state, feed, evals, exact
        )
        return varying_like(carry, (params, opt_state, model_state, self.batch))

    def fresh_buf(self) -> jax.Array:
        return jnp.full((self.size + 1,), jnp.nan, self.loss.dtype)

    def running(self, c: Carry, n: Any) -> Any:
        return running(OPS, c.flow, n, self.met)

    def body(
        self, first: Any, unrecorded: Any, guarded: bool, refresh: bool = False
    ) -> Callable[[Carry], Carry]:
        """One step; its loss goes to ``buf[i // k - first]`` or, off the record, to
        ``buf[unrecorded]``. Its minibatch is the call's step ``i``'s (`_data.Streams`;
        ``refresh``: the step itself refreshes the carried permutations, else the chunk).

        ``guarded``: a non-finite update is not applied (the masked scan). Otherwise the
        step applies every update and the loop stops after a refused one (its test reads
        the probe); the state before it is rebuilt afterwards. Selecting the old state at
        every step cost a kernel per optimizer-state leaf on XLA:CPU, where the selected
        value must be materialised apart from its update.
        """

        def body(c: Carry) -> Carry:
            t = self.step0 + c.flow.i
            feed = self.streams.refresh(c.feed, t) if refresh else c.feed
            args = self.streams.pick(self.batch, feed, c.flow.i, t)
            value, aux, new_params, new_opt, probe, new_kept, new_state = propose(
                self.optimizer,
                self.loss,
                c.params,
                c.opt_state,
                args,
                c.kept,
                c.model_state,
                self.plan,
                None if guarded else c.exact,
            )
            slot = record_slot(c.flow.i, self.k, first, unrecorded, OPS)
            buf = jax.lax.dynamic_update_index_in_dim(c.buf, value, slot, 0)
            flow = advance(c.flow, value, probe)
            ok = OPS.logical_not(refused(OPS, flow))
            if guarded:
                new_params, new_opt, new_state = select(
                    ok, (new_params, new_opt, new_state), (c.params, c.opt_state, c.model_state)
                )
            # Written after the probe has read the old one (it depends on the probe): else
            # XLA copies it twice a step to update it in place. (A lazy check selects it
            # itself, where it checks every value: `_probe.nonfinite_probe`.)
            if guarded or self.plan is None or not self.plan.lazy:
                new_kept = select(ok, new_kept, c.kept)
            return Carry(
                flow, new_params, new_opt, buf, aux, new_kept, new_state, feed, c.evals, c.exact
            )

        return body

    def last_loss(self, c: Carry) -> Any:
        """The loss of the last evaluated step: carried, or read back from the trace
        (recorded, or else the slot for unrecorded steps; see `chunk`)."""
        if self.keep_loss:
            return c.flow.last
        return c.buf[record_slot(c.flow.i - 1, self.k, 0, self.size, OPS)]

    def unseen(self, c: Carry) -> Any:
        """Whether a value the loop checks lazily holds a NaN/inf (`_probe.unseen`): then
        some step the loop ran was non-finite, and the call runs again with every step
        checked (`rebuilt`, `Fit.__call__`). False where every step checks every value."""
        if c.exact is None:
            return jnp.bool_(False)
        return jnp.logical_and(jnp.logical_not(c.exact), unseen(self.plan, c.params, c.opt_state))

    def notify(self, before: Carry, c: Carry) -> Carry:
        """Call the host with (step, loss) if the last update reached a multiple of the
        call's period; not after a step whose NaN/inf the loop has not checked yet: the
        segment checks the lazily checked values first, and stops the loop if they hold
        one (the call runs again to find the step)."""
        done = applied(OPS, c.flow)
        hit = (done > applied(OPS, before.flow)) & ((self.step0 + done) % self.period == 0)
        if c.exact is not None:
            bad = self.unseen(c)
            hit = hit & jnp.logical_not(bad)
            c = c._replace(flow=c.flow._replace(probe=jnp.where(bad, jnp.nan, c.flow.probe)))
        # Fire and forget: a callback whose result fed back into the loop would make the
        # device wait on the host. One int32 array (step, hit, the loss's bits): every
        # argument of a host callback has a cost of its own on XLA:CPU, so the values
        # travel as one. A float64 loss keeps its precision (two ints), any other is exact
        # as a float32.
        value = self.last_loss(c)
        value = value if value.dtype == jnp.float64 else value.astype(jnp.float32)
        bits = jnp.ravel(jax.lax.bitcast_convert_type(value, jnp.int32))
        packed = jnp.concatenate([jnp.stack([self.step0 + done, OPS.to_int(hit)]), bits])
        if self.host_id is not None:
            _host.send(self.host_id, packed)
        else:
            jax.debug.callback(self.dispatch, packed)
        return c

    def chunk(self, c: Carry, end: Any) -> Carry:
        """Run the steps, up to iteration ``end``, whose losses fill one chunk of records.

        The losses go to a small buffer that is copied into the trace once per chunk:
        a per-step write into the whole trace buffer costs far more on XLA:CPU. With a
        shuffled data stream the chunk starts with its epoch's permutation and ends at the
        epoch boundary.
        """
        big = c.buf
        first = (c.flow.i // (CHUNK * self.k)) * CHUNK
        limit = jnp.minimum(end, (first + CHUNK) * self.k)
        if self.streams.shuffled:
            t = self.step0 + c.flow.i
            c = c._replace(feed=self.streams.refresh(c.feed, t))
            limit = jnp.minimum(limit, c.flow.i + self.streams.room(t))
        small = jnp.concatenate([jax.lax.dynamic_slice(big, (first,), (CHUNK,)), big[-1:]])
        inner = jax.lax.while_loop(
            lambda c: self.running(c, limit),
            self.body(first, CHUNK, False),
            c._replace(buf=small, evals=None),  # the evaluations' buffers stay out here
        )
        big = jax.lax.dynamic_update_slice(big, inner.buf[:CHUNK], (first,))
        if self.opts.notify and not self.keep_loss:  # the last unrecorded loss, for `last_loss`
            big = big.at[self.size].set(inner.buf[CHUNK])
        return inner._replace(buf=big, evals=c.evals)

    def evaluate(self, before: Carry, c: Carry) -> Carry:
        """``c`` with one more evaluation if the updates since ``before`` brought the fit's
        step count to a multiple of ``eval_every`` (`_eval.evaluate`)."""
        assert self.evaluation is not None and c.evals is not None
        done = applied(OPS, c.flow)
        evals = evaluate(
            self.evaluation,
            self.eval_every,
            c.evals,
            self.step0 + done,
            done > applied(OPS, before.flow),
            c.params,
            c.model_state,
            self.eval_batch,
        )
        return c._replace(evals=evals)

    def advance(self, c: Carry, end: Any) -> Carry:
        """One iteration of a loop of chunks up to iteration ``end``: a chunk; with
        ``eval_fn``, the chunks up to the next multiple of ``eval_every`` (or ``end``),
        then the evaluation if an update reached it.

        A segment ends at the iteration whose step count is the next multiple (``i + k -
        step % k``, written so that no int32 overflows), so no update past it runs before
        the evaluation; a refused update ends the loop short of it, and only an applied one
        moves the step count, so the parameters evaluated are always an applied update's.
        """
        if self.evaluation is None:
            return self.chunk(c, end)
        k = self.eval_every
        ahead = k - (self.step0 + applied(OPS, c.flow)) % k
        stop = c.flow.i + jnp.minimum(end - c.flow.i, ahead)
        new = jax.lax.while_loop(lambda c: self.running(c, stop), lambda c: self.chunk(c, stop), c)
        return self.evaluate(c, new)

    def segment(self, c: Carry) -> Carry:
        """The chunks up to the next multiple of the period, then the host callback.

        The callback sits in its own outer loop: inside the chunk loop its side effect
        made XLA copy the whole trace buffer at every chunk. The segment ends at the
        iteration whose step count is the next multiple of the period (``i +
        next_multiple(step, period) - step``), written with ``%``: ``step + period`` could
        overflow int32 for a step count near 2**31.
        """
        end = jnp.minimum(
            self.n, c.flow.i + self.period - (self.step0 + applied(OPS, c.flow)) % self.period
        )
        new = jax.lax.while_loop(lambda c: self.running(c, end), lambda c: self.advance(c, end), c)
        return self.notify(c, new)

    def fused(self, carry: Carry, n: Any = None, notify: bool = True) -> Carry:
        """The call's steps (``n``: the call's), chunks, in segments when the loop
        notifies the host (``notify=False``: never)."""
        n = self.n if n is None else n
        if self.opts.notify and notify:
            step = self.segment
        else:
            step = lambda c: self.advance(c, n)  # noqa: E731
        return jax.lax.while_loop(lambda c: self.running(c, n), step, carry)

    def rebuilt(self, carry: Carry, out: Carry) -> Carry:
        """``out`` as `Fit.__call__` makes it on the host, inside the program: for a call
        traced by a user's transform.

        Two passes of one loop over the call's steps from its start (one more copy of
        the step in the program, whatever happened): if a lazily checked value went
        non-finite (`unseen`), the call again with every step checked (its notifications
        were sent already), which stops at the first bad step; then, after a refused
        update, the state before it (`Fit._rebuild`). Under vmap the loop runs while any
        model needs a pass, no step for the others.
        """
        first = jnp.where(self.unseen(out), 0, jnp.where(refused(OPS, out.flow), 1, 2))
        fresh = carry._replace(buf=varying_like(self.fresh_buf(), carry))
        if fresh.exact is not None:
            fresh = fresh._replace(exact=jnp.ones_like(fresh.exact))

        def one_pass(state: tuple[Any, Carry]) -> tuple[Any, Carry]:
            stage, res = state
            n = jnp.where(stage == 0, self.n, jnp.where(stage == 1, applied(OPS, res.flow), 0))
            run = jax.lax.while_loop(
                lambda c: self.running(c, n), lambda c: self.advance(c, n), fresh
            )
            kept = res._replace(
                params=run.params, opt_state=run.opt_state, model_state=run.model_state
            )
            new = select(stage == 0, run, kept)
            after = jnp.where(stage == 0, jnp.where(refused(OPS, run.flow), 1, 2), 2)
            return after, new

        return jax.lax.while_loop(lambda s: s[0] < 2, one_pass, (first, out))[1]

    def scanned(self, carry: Carry, length: int) -> Carry:
        """Reverse-differentiable: ``length`` iterations, those past the call's end or its
        stop skipped, a refused update not applied."""
        body = self.body(0, self.size, True, refresh=True)

        def scan_body(c: Carry, _: Any) -> tuple[Carry, None]:
            new = jax.lax.cond(self.running(c, self.n), body, lambda c: c, c)
            if self.evaluation is not None:  # a refused update is not applied here
                new = self.evaluate(c, new)
            return (self.notify(c, new) if self.opts.notify else new), None

        return jax.lax.scan(scan_body, carry, None, length=length)[0]

    def result(self, out: Carry, pack: bool) -> tuple[FitState, Any, Any, Any]:
        done = applied(OPS, out.flow)
        stop = stop_code(OPS, out.flow, self.met)
        state = FitState(out.params, out.opt_state, self.step0 + done, out.model_state)
        again = OPS.to_int(self.unseen(out))
        ints = INT_OF.get(np.dtype(out.buf.dtype))
        if pack and ints is not None:
            # For the host: the losses' bits, then applied, stop and whether the call must
            # run again checking every step, as one integer array (each array read back
            # is a transfer of its own).
            counts = jnp.stack([done, jnp.int32(stop), again]).astype(ints)
            return (
                state,
                jnp.concatenate([jax.lax.bitcast_convert_type(out.buf, ints), counts]),
                out.aux,
                out.evals,
            )
        return state, (out.buf, done, stop, again), out.aux, out.evals


def run(
    opts: Options,
    optimizer: optax.GradientTransformation,
    loss: Loss,
    dispatch: Callable[[jax.Array], None],
    state: FitState,
    batch: tuple,
    n: jax.Array,
    period: jax.Array,
    *,
    scan_steps: int | None,
    host_id: int | None,
    pack: bool,
    rebuild: bool,
    evaluation: Evaluation | None = None,
    eval_batch: tuple = (),
    exact: Any = False,
) -> tuple[FitState, Any, Any, Any]:
    """The fused program of a call of ``n`` steps from ``state``, traced: ``(state, out,
    aux, evals)``, ``out`` the losses' bits then applied, the stop code and whether a
    lazily checked value went non-finite (the call must run again with ``exact``) as one
    integer array (``pack``), else ``(losses, applied, stop, again)``; ``evals`` the
    `_eval.EvalBuffers` of ``evaluation`` (``eval_fn`` traced for ``eval_batch``), None
    without one.

    ``scan_steps``: run the masked scan of that many iterations; ``host_id``: notify
    through stepfuse's FFI target (else ``jax.debug.callback`` to ``dispatch``);
    ``rebuild``: rebuild the state before a refused update inside the program (and run
    the call again where it must); ``exact`` (a bool, traced): check every value at every
    step (`_probe.Plan`).
    """
    loop = _Loop(
        opts,
        optimizer,
        loss,
        dispatch,
        batch,
        state.step,
        n,
        period,
        host_id,
        scan_steps is not None,
        evaluation,
        eval_batch,
        None if scan_steps is not None else exact,
    )
    carry = loop.start(state.params, state.opt_state, state.model_state)
    if scan_steps is not None:
        out = loop.scanned(carry, scan_steps)
    else:
        out = loop.fused(carry)
        if rebuild:  # else the host does it (`Fit._rebuild`): this cond costs time every call
            out = loop.rebuilt(carry, out)
    return loop.result(out, pack)


def unpack(out: Any) -> tuple[Any, Any, Any, Any]:
    """``(losses, applied, stop, again)`` from what `run` returned: read back to the host
    in one transfer when packed."""
    if isinstance(out, tuple):
        return out
    out = np.asarray(out)
    buf = out[:-3].view(np.float32 if out.dtype == np.int32 else FLOAT_OF[out.dtype])
    applied, stop, again = out[-3:].tolist()
    return buf, applied, stop, again
