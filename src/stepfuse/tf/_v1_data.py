"""Data streams for the TF1 loop (``stepfuse.tf.v1.fuse(..., data=...)``).

- `stepfuse.Batches` of graph tensors (placeholders), or a tuple of them: stacked
  minibatches fed once per ``sess.run``; step ``i`` of the run calls ``loss_fn(xs[i],
  ys[i])``. A leading length known only from the feed is checked by ``run``
  (`stepfuse.Batches.check_fed`), before anything runs.
- `stepfuse.Epochs` of NumPy arrays: a resident dataset. Its arrays go into the graph once,
  as non-trainable variables (`Epochs.placed`, one set per graph) whose initializer reads
  the host arrays through a ``tf.numpy_function``: the GraphDef holds no copy of the data
  (a constant would, and a GraphDef is limited to 2 GB), and every ``sess.run`` reads the
  variables in place. The fit's global step ``t`` (the loop's step variable, which a
  ``tf.compat.v1.train.Saver`` checkpoint holds) picks rows ``order(t //
  steps_per_epoch)[(t % steps_per_epoch) * batch_size : ... + batch_size]``.

The epoch's order is the shared one (`stepfuse._core.data.epoch_keys` over the TF integer
ops of `stepfuse.tf._data`, and one stable ``argsort``), computed on the device only when
the epoch changes. In the fused loop the step's index in the run and a shuffled dataset's
order and epoch are loop variables (`carry_in`, `each`, `carry_out`: read from their
variables once per launch of the compiled loop, written back once after it); a step's
rows are a ``tf.gather`` of a fixed-size range of the order. The stepwise mode feeds the
index (``Batches``) or reads the step variable and the cached order (``Epochs``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from .._core.data import Batches, Epochs, epoch_keys
from .._core.options import Described, a_type
from ._checks import _fail
from ._data import _INTS

tf1 = tf.compat.v1

__all__ = ["V1Data"]


def _resource_variable(value: Any, name: str) -> Any:
    """A non-trainable resource variable, created outside any loop or function."""
    with tf1.init_scope():
        return tf1.Variable(value, trainable=False, use_resource=True, name=name)


def _host_array(a: Any, j: int) -> np.ndarray:
    if tf.is_symbolic_tensor(a) or isinstance(a, tf.Variable):
        _fail(
            TypeError,
            f"data (Epochs array {j})",
            a,
            "a NumPy array (the dataset, put into the graph once)",
            "Pass the dataset as NumPy arrays, e.g. sf.Epochs(x_train, y_train, "
            "batch_size=32); to feed minibatches at every run, use sf.Batches(xs_ph, ys_ph).",
        )
    host = np.asarray(a)
    if host.dtype.kind not in "biuf":
        _fail(
            TypeError,
            f"data (Epochs array {j})",
            Described(f"an array of dtype {host.dtype}", a),
            "an array of numbers or booleans",
            "Convert it to a numeric NumPy array first.",
        )
    return host


def _place(host: np.ndarray) -> Any:
    """``host`` as a graph variable whose initializer copies it in (no GraphDef constant)."""
    dtype = tf.as_dtype(host.dtype)
    with tf1.init_scope():
        value = tf.numpy_function(lambda: host, [], dtype, name="stepfuse_dataset_value")
        value.set_shape(host.shape)
    return _resource_variable(value, "stepfuse_dataset")


class V1Data:
    """A fit's ``data``: its arrays in the graph, and each step's minibatch from them.

    Attributes:
      arrays: the stacked graph tensors (``Batches``) or the dataset's variables
        (``Epochs``).
      epochs: the `stepfuse.Epochs`, or None for stacked minibatches.
      index: the stepwise mode's placeholder for the step's index in the run (``Batches``).
    """

    def __init__(self, data: Any, steps: Any) -> None:
        self.epochs: Epochs | None = None
        self.batches: Batches | None = None
        self.index: Any = None
        self.order: Any = None  # a shuffled dataset's cached order and its epoch (-1: none)
        self.order_epoch: Any = None
        if isinstance(data, Epochs):
            self.epochs = data
            for j, a in enumerate(data.arrays):
                _host_array(a, j)
            graph = tf1.get_default_graph()  # (one set of dataset variables per graph)
            self.arrays = data.placed(("tf1", graph), lambda a: _place(np.asarray(a)))
            if data.shuffle:
                self.order = _resource_variable(
                    tf.zeros([data.rows], tf.int64), "stepfuse_epoch_order"
                )
                self.order_epoch = _resource_variable(
                    tf.constant(-1, tf.int64), "stepfuse_epoch_order_epoch"
                )
            return
        arrays = data.arrays if isinstance(data, Batches) else data
        if (
            not isinstance(arrays, (tuple, list))
            or not arrays
            or not all(isinstance(a, tf.Tensor) and a.shape.rank != 0 for a in arrays)
        ):
            _fail(
                TypeError,
                "data",
                Described(a_type(data), data),
                "None, one stepfuse.Batches of graph tensors (placeholders), e.g. "
                "sf.Batches(xs_ph, ys_ph) (leading axis None allowed), a tuple of such "
                "placeholders, or one stepfuse.Epochs of NumPy arrays",
                "Stack the minibatches along a leading axis and feed them once per run "
                "through placeholders (one Batches holds them all), or pass the dataset as "
                "sf.Epochs(x, y, batch_size=...).",
            )
        self.batches = data if isinstance(data, Batches) else Batches(*arrays)
        self.arrays = tuple(arrays)
        n = self.batches.n
        if isinstance(steps, int) and n is not None and n < steps:
            raise ValueError(
                f"`data` holds {n} stacked minibatches but `steps` is {steps}: its leading "
                f"axis must be at least the run's steps. Pass steps={n}, or stack more."
            )

    @property
    def needs_step(self) -> bool:
        """Whether a step's minibatch depends on the fit's global step (``Epochs``)."""
        return self.epochs is not None

    # -- the rows of a step -------------------------------------------------------------

    def _span(self, t: Any) -> tuple[Any, Any]:
        """``(epoch, positions)`` of global step ``t``: the epoch and the fixed-size range
        of its order that the step's rows are."""
        e = self.epochs
        assert e is not None
        epoch = t // e.steps_per_epoch
        start = (t % e.steps_per_epoch) * e.batch_size
        return epoch, start + tf.range(e.batch_size, dtype=tf.int64)

    def _order_of(self, epoch: Any) -> Any:
        """The order of ``epoch``, computed on the device (the shared hash, one argsort)."""
        e = self.epochs
        assert e is not None
        keys = epoch_keys(_INTS, epoch % 2**32, tf.range(e.rows, dtype=tf.int64), e.seed)
        return tf.cast(tf.argsort(keys, stable=True), tf.int64)

    # -- the fused loop -----------------------------------------------------------------

    def carry_in(self) -> tuple[Any, ...]:
        """The loop variables this stream adds: a shuffled dataset's order and epoch."""
        if self.order is None:
            return ()
        return (self.order.read_value(), self.order_epoch.read_value())

    def carry_out(self, carried: tuple[Any, ...]) -> list[Any]:
        """Write the loop's final order back (a run in the same epoch sorts nothing)."""
        if self.order is None:
            return []
        order, epoch = carried
        return [self.order.assign(order), self.order_epoch.assign(epoch)]

    def each(self, i: Any, t: Any, carried: tuple[Any, ...]) -> tuple[list[Any], tuple]:
        """``(loss_fn's arguments, carried after)`` at the step of index ``i`` in the run
        and global step ``t`` (int64)."""
        if self.epochs is None:
            return [tf.gather(a, i) for a in self.arrays], ()
        epoch, span = self._span(t)
        if self.order is None:
            return [tf.gather(a, span) for a in self.arrays], ()
        held, current = carried
        order = tf.cond(
            tf.equal(current, epoch), lambda: tf.identity(held), lambda: self._order_of(epoch)
        )
        rows = tf.gather(order, span)
        return [tf.gather(a, rows) for a in self.arrays], (order, epoch)

    # -- outside the fused loop ---------------------------------------------------------

    def first(self, t: Any) -> list[Any]:
        """The arguments of the graph's ``loss`` (built outside the loop): entry 0 of a
        stack, or the minibatch of global step ``t``. Its variable reads are plain reads
        (the fused loop waits for them), its order is computed only when it is fetched."""
        if self.epochs is None:
            return [a[0] for a in self.arrays]
        epoch, span = self._span(t)
        rows = span if self.order is None else tf.gather(self._order_of(epoch), span)
        return [tf.gather(a.read_value(), rows) for a in self.arrays]

    def stepwise(self, t: Any) -> list[Any]:
        """The arguments of the stepwise mode's step: entry ``index`` (fed) of a stack, or
        the minibatch of global step ``t`` (the order cached in its variables)."""
        if self.epochs is None:
            self.index = tf1.placeholder_with_default(np.int64(0), [], name="stepfuse_data_index")
            return [tf.gather(a, self.index) for a in self.arrays]
        epoch, span = self._span(t)
        if self.order is None:
            return [tf.gather(a, span) for a in self.arrays]
        order = tf.cond(
            tf.equal(self.order_epoch.read_value(), epoch),
            self.order.read_value,
            lambda: self._order_of(epoch),
        )
        with tf.control_dependencies([order]):  # (after the cond's reads)
            cache = [self.order.assign(order), self.order_epoch.assign(epoch)]
        with tf.control_dependencies(cache):
            rows = tf.gather(order, span)
        return [tf.gather(a, rows) for a in self.arrays]

    def fed_checks(self, n: Any) -> list[Any]:
        """Graph asserts that the stacked minibatches hold at least the run's ``n`` steps
        (a fed ``steps`` too, so known lengths are checked as well), all of one length: a
        bare ``sess.run(fused.train_op)`` is checked too (`check_feed` checks a
        `Fused.run`'s feed first, on the host)."""
        if self.batches is None:
            return []
        leads = [tf.shape(a, out_type=tf.int32)[0] for a in self.arrays]
        ok = tf.reduce_all(tf.stack([(d >= n) & tf.equal(d, leads[0]) for d in leads]))
        text = (
            "stepfuse.tf.v1: the stacked minibatches fed for `data` must all hold at least "
            "`steps` minibatches (one per step), and as many each. Leading lengths, then steps:"
        )
        return [tf.debugging.Assert(ok, [text, *leads, n])]

    def check_feed(self, feed: dict, n: int) -> None:
        """A ValueError naming the array if the fed stacks' leading lengths differ or hold
        fewer minibatches than the run's ``n`` steps (`stepfuse.Batches.check_fed`)."""
        if self.batches is None:
            return
        lengths: list[int | None] = []
        names: list[str] = []
        for j, a in enumerate(self.arrays):
            value = feed.get(a)
            if value is None:
                lead = a.shape[0] if a.shape.rank else None
                lengths.append(None if lead is None else int(lead))
                names.append(f"data[{j}] ({a.name})")
            else:
                lengths.append(int(np.shape(value)[0]) if np.ndim(value) else 0)
                names.append(f"feed_dict[{a.name}]")
        self.batches.check_fed(lengths, n, names)
