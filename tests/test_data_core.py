"""The data streams' shared core (`stepfuse._core.data`): validation, the epochs' orders,
stacking an iterable, and the split of a call's arguments. The backends' loops over
streams are tested in tests/test_data_<backend>.py."""

from __future__ import annotations

import numpy as np
import pytest

import stepfuse as sf
from stepfuse._core.data import NUMPY_INTS, Feed, Slot, epoch_keys, feed_of, rows_of_keys


def test_root_exports_the_streams():
    assert sf.Batches is not None and sf.Epochs is not None
    assert {"Batches", "Epochs"} <= set(sf.__all__)


@pytest.mark.parametrize("backend", ["jax", "tf", "torch"])
def test_each_backend_package_exports_the_same_streams(backend):
    module = pytest.importorskip(f"stepfuse.{backend}")
    assert (module.Batches, module.Epochs) == (sf.Batches, sf.Epochs)
    assert {"Batches", "Epochs"} <= set(module.__all__)


def test_order_is_a_permutation_that_changes_with_epoch_and_seed():
    data = sf.Epochs(np.zeros((1000, 3)), batch_size=10, seed=3)
    orders = [data.order(e) for e in range(4)]
    for o in orders:
        assert o.dtype == np.int64
        assert np.array_equal(np.sort(o), np.arange(1000))
    assert all(not np.array_equal(orders[0], o) for o in orders[1:])
    other = sf.Epochs(np.zeros((1000, 3)), batch_size=10, seed=4)
    assert not np.array_equal(other.order(0), orders[0])
    # stateless: the same order whenever asked, by a new object too
    again = sf.Epochs(np.ones((1000, 3)), batch_size=7, seed=3)
    assert np.array_equal(again.order(2), orders[2])


def test_order_looks_shuffled():
    """Not a statistics test: rows keep no trace of their index (a broken mixer that
    leaves the order near the identity, or reverses it, fails this)."""
    o = sf.Epochs(np.zeros(4096), batch_size=1).order(0)
    r = np.corrcoef(np.arange(4096), o)[0, 1]
    assert abs(r) < 0.1, r
    first_half = (o[:2048] < 2048).mean()
    assert 0.4 < first_half < 0.6, first_half


def test_keys_are_distinct_so_the_sort_is_unique():
    keys = epoch_keys(NUMPY_INTS, np.int64(5), np.arange(100_000, dtype=np.int64), seed=2**63 + 1)
    assert len(np.unique(keys)) == 100_000
    assert keys.min() >= 0 and keys.max() < 2**32


def test_no_shuffle_is_the_identity():
    data = sf.Epochs(np.arange(10), batch_size=3, shuffle=False)
    assert np.array_equal(data.order(7), np.arange(10))
    assert data.steps_per_epoch == 3
    assert np.array_equal(data.indices(4), [3, 4, 5])  # epoch 1, second batch


def test_indices_and_batch_follow_the_documented_formula():
    x, y = np.arange(20.0).reshape(10, 2), np.arange(10)
    data = sf.Epochs(x, y, batch_size=4, seed=9)
    assert data.steps_per_epoch == 2  # full batches only: 2 rows of each epoch are left out
    for t in range(7):
        e, at = divmod(t, 2)
        rows = data.order(e)[at * 4 : at * 4 + 4]
        assert np.array_equal(data.indices(t), rows)
        bx, by = data.batch(t)
        assert np.array_equal(bx, x[rows]) and np.array_equal(by, y[rows])


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((), {"batch_size": 1}, "at least one array"),
        ((np.zeros(5),), {"batch_size": 0}, "batch_size"),
        ((np.zeros(5),), {"batch_size": -2}, "batch_size"),
        ((np.zeros(5),), {"batch_size": 6}, "batch_size"),
        ((np.zeros(5),), {"batch_size": 2.0}, "batch_size"),
        ((np.zeros(5), np.zeros(4)), {"batch_size": 2}, "same leading length"),
        (([1, 2, 3],), {"batch_size": 1}, r"Epochs\(\*arrays\)\[0\]"),
        ((np.float32(3.0),), {"batch_size": 1}, "leading axis"),
        ((np.zeros(5),), {"batch_size": 2, "seed": -1}, "seed"),
        ((np.zeros(5),), {"batch_size": 2, "shuffle": 1}, "shuffle"),
        # arrays of no numbers passed the checks, then failed in each framework's converter
        ((np.array([1.0, "a"], dtype=object),), {"batch_size": 1}, r"\[0\]` .*dtype object"),
        ((np.zeros(4), np.array(list("abcd"))), {"batch_size": 2}, r"\[1\]` .*dtype <U1"),
        ((np.zeros(2, dtype=[("a", "f4")]),), {"batch_size": 1}, r"dtype \[\('a', '<f4'\)\]"),
        ((np.array(["2020-01-01"] * 2, dtype="M8[D]"),), {"batch_size": 1}, "datetime64"),
    ],
)
def test_epochs_refuses_bad_input(args, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sf.Epochs(*args, **kwargs)


@pytest.mark.parametrize(
    "args, match",
    [
        ((), "at least one array"),
        ((np.zeros((3, 2)), np.zeros((4, 2))), "same leading length"),
        ((np.zeros((3, 2)), "text"), r"Batches\(\*arrays\)\[1\]"),
        ((np.float64(1.0),), "leading axis"),
        (({"x": np.zeros((3, 2))},), r"a dict \(dict\)\. Pass its arrays .*sorted key order"),
        ((np.zeros((3, 2), dtype=object),), r"numbers or booleans.*np\.unique"),
    ],
)
def test_batches_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        sf.Batches(*args)


def test_from_iterable_stacks_the_next_n():
    items = [(np.full((2, 3), k), np.array([k, k])) for k in range(10)]
    it = iter(items)
    b = sf.Batches.from_iterable(it, 4)
    assert b.n == 4 and b.arrays[0].shape == (4, 2, 3) and b.arrays[1].shape == (4, 2)
    assert np.array_equal(b.arrays[1][:, 0], [0, 1, 2, 3])
    nxt = sf.Batches.from_iterable(it, 4)  # the next four, from the same iterator
    assert np.array_equal(nxt.arrays[1][:, 0], [4, 5, 6, 7])
    single = sf.Batches.from_iterable((np.ones(3) * k for k in range(3)), 3)
    assert len(single.arrays) == 1 and single.arrays[0].shape == (3, 3)


def test_from_iterable_takes_dicts_in_sorted_key_order():
    items = [{"y": np.full(2, k), "x": np.full((2, 3), -k)} for k in range(5)]
    b = sf.Batches.from_iterable(items, 3)
    assert [a.shape for a in b.arrays] == [(3, 2, 3), (3, 2)]  # x, then y
    assert np.array_equal(b.arrays[1][:, 0], [0, 1, 2]) and b.arrays[0][2, 0, 0] == -2


@pytest.mark.parametrize(
    "items, match",
    [
        (
            [{"x": np.ones(2)}, {"y": np.ones(2)}],
            r"batch 1 is a dict with keys \['y'\], batch 0 was a dict with keys \['x'\]",
        ),
        ([{"x": np.ones(2)}, (np.ones(2),)], r"batch 1 is a tuple of 1, batch 0 was a dict"),
        ([np.ones(2), {"x": np.ones(2)}], r"batch 1 is a dict .*batch 0 was one array"),
        ([{0: np.ones(2)}, {0: np.ones(2)}], "string keys"),
        ([{"x": np.ones(2)}, {"x": np.ones(3)}], r"batch 1, key 'x' has shape \(3,\)"),
        ([{"x": "a"}, {"x": "b"}], r"iterable \(batch 0, key 'x'\)"),
    ],
    ids=["other-keys", "dict-then-tuple", "array-then-dict", "int-keys", "partial", "not-array"],
)
def test_from_iterable_refuses_mixed_dict_batches(items, match):
    with pytest.raises(ValueError, match=match):
        sf.Batches.from_iterable(items, 2)


def test_from_iterable_refuses_short_ragged_and_partial():
    with pytest.raises(ValueError, match="ran out after 2 batches"):
        sf.Batches.from_iterable([np.ones(2), np.ones(2)], 3)
    with pytest.raises(ValueError, match="shape"):
        sf.Batches.from_iterable([np.ones(2), np.ones(3)], 2)  # a last partial batch
    with pytest.raises(ValueError, match="batch 1 is a tuple of 1, batch 0 was a tuple of 2"):
        sf.Batches.from_iterable([(np.ones(2), np.ones(2)), (np.ones(2),)], 2)
    with pytest.raises(ValueError, match="`n`"):
        sf.Batches.from_iterable([np.ones(2)], 0)
    with pytest.raises(TypeError, match="iterable"):
        sf.Batches.from_iterable(5, 1)


def test_streams_take_numbers_of_every_dtype():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in (bool, np.uint8, np.int64, np.float16, np.complex64, ml_dtypes.bfloat16):
        assert sf.Epochs(np.ones((4, 2), dtype), batch_size=2).rows == 4
        assert sf.Batches(np.ones((3, 2), dtype)).n == 3


def test_feed_splits_streams_and_fixed_arguments():
    xs, ys, w = np.zeros((6, 2, 3)), np.zeros((6, 2)), np.ones(3)
    data = sf.Epochs(np.zeros((10, 3)), np.zeros(10), batch_size=5, seed=1)
    feed = feed_of((sf.Batches(xs, ys), w, data))
    assert feed.slots == (
        Slot("batches", 2),
        Slot("fixed"),
        Slot("epochs", 2, 5, 2, True, 1),
    )
    assert len(feed.arrays) == 5 and feed.streams and feed.epochs == (2,)
    assert feed.batches == 6
    hash(feed.slots)  # a compiled program is specialised to it
    feed.check_steps(6)
    with pytest.raises(ValueError, match="holds 6 minibatches but the call runs 7"):
        feed.check_steps(7)
    picked = feed.pick(
        feed.arrays,
        take=lambda a: ("take", a.shape),
        rows=lambda k: ("rows", k),
        gather=lambda a, r: ("gather", a.shape, r),
    )
    assert picked == (
        ("take", (6, 2, 3)),
        ("take", (6, 2)),
        w,
        ("gather", (10, 3), ("rows", 0)),
        ("gather", (10,), ("rows", 0)),
    )
    two = feed_of((sf.Batches(xs), sf.Batches(ys[:4]), w))  # the message named neither
    with pytest.raises(ValueError, match=r"^The call's argument 1 \(of 2 `Batches`\): .* holds 4"):
        two.check_steps(5)
    plain = feed_of((xs, w))
    assert not plain.streams and plain.batches is None
    plain.check_steps(10**6)
    assert isinstance(plain, Feed)


def test_placed_puts_each_array_once_per_key():
    data = sf.Epochs(np.zeros(4), np.ones(4), batch_size=2)
    calls = []

    def put(a):
        calls.append(a)
        return a + 1

    first = data.placed(("cpu",), put)
    again = data.placed(("cpu",), put)
    assert first is again and len(calls) == 2
    data.placed(("other",), put)
    assert len(calls) == 4


def test_the_guides_example_runs():
    """The Python block of docs/guides/data.md, as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "guides" / "data.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/guides/data.md", "exec"), {})


def test_jax_runs_streams():
    """The JAX backend takes both streams (tested in depth in tests/test_data_jax.py)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax

    import stepfuse.jax as sfj

    fit = sfj.fuse(lambda p, x: jnp.sum(p * x), optax.sgd(0.1), steps=2)
    state, trace = fit(fit.init(jnp.ones(2)), sf.Batches(np.array([[1.0, 0.0], [0.0, 2.0]])))
    np.testing.assert_allclose(trace.loss, [1.0, 2.0], rtol=1e-6)  # x0 . p, x1 . p
    np.testing.assert_allclose(state.params, [0.9, 0.8], rtol=1e-6)
    data = sf.Epochs(np.eye(2, dtype=np.float32), batch_size=1, seed=0)
    state, trace = fit(state, data)
    assert fit.mode == "fused" and int(state.step) == 4 and trace.steps == 2


@pytest.mark.parametrize(
    ("rows", "seed", "epoch"), [(44, 7, 0), (8192, 0, 5), (1000, 2**40 + 3, 123456), (3, 1, 2**33)]
)
def test_rows_of_keys_inverts_epoch_keys(rows: int, seed: int, epoch: int) -> None:
    # The JAX loop sorts the keys alone and maps them back to their rows (`rows_of_keys`):
    # on the sorted keys that must be exactly `Epochs.order`.
    e = np.int64(epoch % 2**32)
    with np.errstate(over="ignore"):
        keys = epoch_keys(NUMPY_INTS, e, np.arange(rows, dtype=np.int64), seed)
        back = rows_of_keys(NUMPY_INTS, e, keys, seed)
        order = rows_of_keys(NUMPY_INTS, e, np.sort(keys), seed)
    np.testing.assert_array_equal(back, np.arange(rows))
    data = sf.Epochs(np.zeros((rows, 1)), batch_size=1, seed=seed)
    np.testing.assert_array_equal(order, data.order(epoch))


def test_messages_name_what_is_wrong() -> None:
    """A negative step names `step` (not the epoch it maps to); an empty dataset says so;
    a Batches of no minibatches is not told to run steps=0; type names take their article."""
    data = sf.Epochs(np.zeros((8, 2)), batch_size=4)
    for bad in (lambda: data.indices(-1), lambda: data.batch(-3)):
        with pytest.raises(ValueError, match=r"^`step` must be an int >= 0; got -"):
            bad()
    with pytest.raises(ValueError, match=r"at least one row; got arrays of 0 rows"):
        sf.Epochs(np.zeros((0, 2)), batch_size=1)
    with pytest.raises(ValueError, match=r"holds 0 minibatches .* steps\. Stack 3 minibatches\.$"):
        feed_of([sf.Batches(np.zeros((0, 2)))]).check_steps(3)
    with pytest.raises(ValueError, match=r"batch 1 is an int, batch 0 was a tuple of 1"):
        sf.Batches.from_iterable([(np.zeros(2),), 5], 2)
