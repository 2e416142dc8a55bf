"""stepfuse.tf.v1 (TF1 graph mode, sess.run): the seed, graph size, optimizers, stops, errors.

Every graph is built inside ``with tf.Graph().as_default():`` and run with
``tf.compat.v1.Session(graph=...)``, so eager execution stays on for the TF2 tests.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import CATALOGUES, assert_tol_stops_where_the_recorded_losses_say
from tf_helpers import LN2, seed_data, seed_graph, sparse_ce

import stepfuse.tf.v1 as v1
from stepfuse import Stop

tf1 = tf.compat.v1
XS, YS = seed_data()

V1_OPTIMIZERS = CATALOGUES["tf1"]


def feed(x, y):
    return {x: XS, y: YS}


def test_seed_three_steps_per_run_equals_one_step_runs_and_n_copies():
    g1, s1, f1, x1, y1 = seed_graph(1)
    table1 = [s1.run([f1.losses, f1.train_op], feed(x1, y1))[0][0] for _ in range(30)]
    g3, s3, f3, x3, y3 = seed_graph(3)
    runs3 = [s3.run([f3.losses, f3.train_op], feed(x3, y3))[0] for _ in range(10)]
    table3 = [r[0] for r in runs3]
    assert abs(table1[0] - LN2) < 1e-6 and abs(table3[0] - LN2) < 1e-6
    np.testing.assert_allclose(table3, table1[::3], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.concatenate(runs3), table1, rtol=0, atol=1e-6)
    # The accepted answer: N=3 chained copies of loss -> gradients -> update.
    gc, sc, (train_op, losses), xc, yc = seed_graph(3, kind="copies")
    copies = [sc.run(losses + [train_op], feed(xc, yc))[:3] for _ in range(10)]
    np.testing.assert_allclose(np.concatenate(copies), np.concatenate(runs3), rtol=0, atol=1e-6)
    for a, b in zip(s3.run(f3.var_list), sc.run(gc.get_collection("trainable_variables"))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert table1[3] < table1[0]  # it trains


def test_fetching_train_op_and_losses_runs_the_loop_once():
    g, s, f, x, y = seed_graph(3)
    losses, _, taken = s.run([f.losses, f.train_op, f.steps_taken], feed(x, y))
    gr, sr, fr, xr, yr = seed_graph(3, kind="stepwise")
    fr.run(sr, feed(xr, yr), steps=3)
    assert taken == 3 and losses.shape == (3,)
    # (jit_compile="auto" may pick XLA for one and TF's kernels for the other: their float32
    # rounding differs by an ulp or so; a loop run twice would be 3 steps off)
    for a, b in zip(s.run(f.var_list), sr.run(fr.var_list)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_packed_holds_the_losses_then_count_steps_taken_and_stop_bits():
    for steps in (3, "placeholder"):  # packed inside the XLA call / by graph ops after the loop
        g, s, f, x, y = seed_graph(steps)
        fd = feed(x, y) if steps == 3 else {**feed(x, y), f.steps: 3}
        packed, losses, taken, stop = s.run([f.packed, f.losses, f.steps_taken, f.stop], fd)
        count, taken2, stop2 = packed[-3:].view(np.int32).tolist()
        assert count == 3 and [taken, stop] == [taken2, stop2] == [3, int(Stop.STEPS)]
        np.testing.assert_array_equal(packed[:count], losses)
        trace = f.run(s, feed(x, y), steps=2)  # `run` decodes it: the loop goes on from step 3
        assert trace.steps == 2 and trace.stop == Stop.STEPS and trace.loss.shape == (2,)
        assert trace.loss[0] < losses[-1]


def test_graph_size_does_not_grow_with_steps():
    sizes = []
    for steps in (3, 300):
        g, s, f, x, y = seed_graph(steps)
        gd = g.as_graph_def()
        loop_nodes = sum(len(fn.node_def) for fn in gd.library.function)  # while-loop bodies
        sizes.append((len(g.get_operations()), len(gd.node), loop_nodes))
    assert sizes[0] == sizes[1] and sizes[0][2] > 0
    copies = [len(seed_graph(n, kind="copies")[0].get_operations()) for n in (3, 30)]
    assert copies[1] > 5 * copies[0]  # the baseline grows


def test_steps_placeholder_changes_steps_per_run_without_rebuilding():
    # One graph whose steps is an int32 placeholder, fed 1, 3, 300.
    g, s, f, x, y = seed_graph("placeholder")
    ops_before = len(g.get_operations())
    gr, sr, fr, xr, yr = seed_graph(1, kind="stepwise")
    for n in (1, 3, 300):
        losses, _ = s.run([f.losses, f.train_op], {**feed(x, y), f.steps: n})
        ref = fr.run(sr, feed(xr, yr), steps=n)
        assert losses.shape == (n,)
        np.testing.assert_allclose(losses, ref.loss, rtol=1e-6, atol=1e-7)
        for a, b in zip(s.run(f.var_list), sr.run(fr.var_list)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert len(g.get_operations()) == ops_before
    # The int form feeds its own placeholder_with_default the same way.
    g2, s2, f2, x2, y2 = seed_graph(3)
    assert f2.run(s2, feed(x2, y2), steps=5).steps == 5 and s2.run(f2.steps) == 3


def test_int_steps_up_to_the_chunk_run_one_chunk_and_others_chain_chunks():
    # An int `steps` builds one call of the XLA loop per run (no graph loop around it):
    # feeding more than its chunk fails, naming `steps`, before any variable changes.
    g, s, f, x, y = seed_graph(3, chunk=4)
    before = s.run(f.state)
    with pytest.raises(ValueError, match=r"`steps`.*at most 4.*chunk"):
        f.run(s, feed(x, y), steps=5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="at most 4"):
        s.run(f.train_op, {**feed(x, y), f.steps: 5})
    for a, b in zip(s.run(f.state), before):
        np.testing.assert_array_equal(a, b)
    assert f.max_steps == 4 and f.run(s, feed(x, y), steps=4).steps == 4
    # A tensor `steps` chains chunks of 4 inside one run: 11 steps equal the reference.
    g2, s2, f2, x2, y2 = seed_graph("placeholder", chunk=4)
    assert f2.max_steps is None
    losses, applied, _ = s2.run(
        [f2.losses, f2.steps_taken, f2.train_op], {**feed(x2, y2), f2.steps: 11}
    )
    gr, sr, fr, xr, yr = seed_graph(1, kind="stepwise")
    ref = fr.run(sr, feed(xr, yr), steps=11)
    assert applied == 11
    np.testing.assert_allclose(losses, ref.loss, rtol=1e-6, atol=1e-7)
    # An int `steps` above `chunk` chains chunks too: its default run takes all of them
    # (it was built, then every default run failed the one-chunk check).
    g3, s3, f3, x3, y3 = seed_graph(11, chunk=4)
    trace = f3.run(s3, feed(x3, y3))
    assert f3.max_steps is None and trace.steps == 11
    np.testing.assert_allclose(trace.loss, ref.loss, rtol=1e-6, atol=1e-7)
    assert s3.run(f3.steps_taken, feed(x3, y3)) == 11  # a bare sess.run too


@pytest.mark.parametrize("record_every", [1, 3])
def test_xla_losses_gathered_in_small_chunks_equal_the_plain_graph_loops(record_every):
    # 100 steps cross several of the XLA loop's small loss buffers; chunks of 13 chained
    # by a tensor `steps` start them at odd step indices; without XLA a TensorArray.
    runs = []
    for steps, kw in ((100, {}), ("placeholder", {"chunk": 13}), (100, {"jit_compile": False})):
        g, s, f, x, y = seed_graph(steps, record_every=record_every, **kw)
        fed = {**feed(x, y), f.steps: 100}
        losses, applied, _ = s.run([f.losses, f.steps_taken, f.train_op], fed)
        runs.append((losses, applied, s.run(f.state)))
    (one, a1, v1), (chained, a2, v2), (plain, a3, v3) = runs
    assert a1 == a2 == a3 == 100 and len(one) == len(plain) == -(-100 // record_every)
    np.testing.assert_array_equal(one, chained)
    np.testing.assert_allclose(one, plain, rtol=1e-6, atol=1e-7)
    for a, b, c in zip(v1, v2, v3):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)


def _keras_or_variable_graph(opt_fn, kind, steps, use_keras):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2])
        y = tf1.placeholder(tf.int32, [None])
        if use_keras:
            # Named: the state's order follows the variables' names, which Keras would
            # otherwise number from a process-wide counter (other tests' layers shift it).
            hidden = keras.layers.Dense(
                8,
                activation="tanh",
                kernel_initializer=keras.initializers.GlorotUniform(seed=0),
                name="hidden",
            )
            out = keras.layers.Dense(2, kernel_initializer="ones", name="out")
            tf1.set_random_seed(0)

            def loss_fn():
                return sparse_ce(y, out(hidden(x)))
        else:

            def loss_fn():
                k = tf1.get_variable("k", initializer=tf.constant([[1.0, 0.5], [-0.5, 1.0]]))
                b = tf1.get_variable("b", initializer=tf.zeros([2]))
                return sparse_ce(y, tf.matmul(x, k) + b)

        f = v1.fuse(loss_fn, opt_fn(), steps=steps, mode=kind)
        init = tf1.global_variables_initializer()
    s = tf1.Session(graph=g)
    s.run(init)
    return g, s, f, x, y


@pytest.mark.parametrize(
    "steps, jit",
    [(50, True), (50, False), ("placeholder", True)],
    ids=["int-xla", "int-noxla", "tensor"],
)
def test_loss_fetched_with_the_loop_is_the_loss_before_the_run(steps, jit):
    """As ``sess.run([loss, optimizer.minimize(loss)])``: ``fused.loss`` fetched in the
    loop's run is the loss before its updates (it was read at a race with the loop, ~half
    the runs mid-loop)."""
    g, s, f, x, y = seed_graph(steps, jit_compile=jit)
    fed = feed(x, y)
    if steps == "placeholder":
        fed[f.steps] = 50
    for _ in range(12):
        before = s.run(f.loss, fed)
        loss, losses, _ = s.run([f.loss, f.losses, f.train_op], fed)
        assert loss == before and len(losses) == 50 and losses[-1] < losses[0]
        np.testing.assert_allclose(losses[0], loss, rtol=1e-6)


# Every optimizer on Keras layers; on tf.get_variable CI runs GradientDescent's, the others
# with --runslow (the same slots on other variables).
@pytest.mark.parametrize(
    "opt, use_keras",
    [
        pytest.param(o, False, id=f"{o}-get_variable", marks=() if o == "gd" else pytest.mark.slow)
        for o in V1_OPTIMIZERS
    ]
    + [pytest.param(o, True, id=f"{o}-keras_layers") for o in V1_OPTIMIZERS],
)
def test_optimizers_with_slots_match_the_stepwise_reference(opt, use_keras):
    g, s, f, x, y = _keras_or_variable_graph(V1_OPTIMIZERS[opt], "fused", 4, use_keras)
    gr, sr, fr, xr, yr = _keras_or_variable_graph(V1_OPTIMIZERS[opt], "stepwise", 4, use_keras)
    if use_keras:  # same random initial weights in both graphs
        with gr.as_default():
            sr.run([a.assign(b) for a, b in zip(fr.var_list, s.run(f.var_list))])
    losses = np.concatenate([f.run(s, feed(x, y), steps=n).loss for n in (4, 1, 3)])
    ref = fr.run(sr, feed(xr, yr), steps=8)
    np.testing.assert_allclose(losses, ref.loss, rtol=1e-6, atol=1e-7)
    assert losses.dtype == ref.loss.dtype == np.float32  # the loss's, in both modes
    assert len(f.state) == len(fr.state)
    assert (len(f.state) > len(f.var_list)) == (opt != "gd")  # slots live outside the loop
    for a, b in zip(s.run(f.state), sr.run(fr.state)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_tol_stops_early_like_the_stepwise_oracle():
    g, s, f, x, y = seed_graph(
        2000, tol=1e-5, optimizer=lambda: tf1.train.GradientDescentOptimizer(0.5)
    )
    gr, sr, fr, xr, yr = seed_graph(
        2000, kind="stepwise", tol=1e-5, optimizer=lambda: tf1.train.GradientDescentOptimizer(0.5)
    )
    trace, ref = f.run(s, feed(x, y)), fr.run(sr, feed(xr, yr))
    assert trace.stop == ref.stop == Stop.TOL and 1 < trace.steps == ref.steps < 2000
    np.testing.assert_allclose(trace.loss, ref.loss, rtol=1e-6, atol=1e-7)


def float64_seed_run(optimizer, steps, steps_kind="int", **kw):
    """The seed in float64 (a fresh graph): one ``run`` of ``v1.fuse(..., steps, **kw)``,
    ``steps`` an int or, for ``steps_kind="tensor"``, a tensor of that value."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float64, [None, 2])
        y = tf1.placeholder(tf.int32, [None])
        if steps_kind == "tensor":
            steps = tf1.placeholder_with_default(steps, [])

        def loss_fn():
            k = tf1.get_variable(
                "kernel", initializer=tf.ones((2, 2), tf.float64), dtype=tf.float64
            )
            b = tf1.get_variable("bias", initializer=tf.zeros((2,), tf.float64), dtype=tf.float64)
            return sparse_ce(y, tf.matmul(x, k) + b)

        f = v1.fuse(loss_fn, optimizer, steps=steps, **kw)
        init = tf1.global_variables_initializer()
    with tf1.Session(graph=g) as s:
        s.run(init)
        return f.run(s, {x: XS.astype(np.float64), y: YS})


# With --runslow (24 s of a CI run: four graphs of 60 float64 steps). CI keeps TF1's tol
# in the conformance suite and test_float64_losses_stay_float64_and_tol_compares_them.
@pytest.mark.slow
@pytest.mark.parametrize("steps_kind", ["int", "tensor"])
def test_tol_at_the_last_bit_stops_where_the_recorded_losses_say(steps_kind):
    """float64, whose comparison XLA could round apart from the recorded loss; a tensor
    `steps` runs chunks of 7 steps, so the tols also fall across chunk boundaries."""

    def run(tol):
        return float64_seed_run(
            tf1.train.AdamOptimizer(0.05),
            60,
            steps_kind,
            tol=tol,
            chunk=None if steps_kind == "int" else 7,
        )

    # one difference (three tols, a graph each: TF1 builds are slow); index 20 is the chunk
    # boundary of a tensor `steps` (chunks of 7)
    assert_tol_stops_where_the_recorded_losses_say(run, run(None).loss, at=(20,))


@pytest.mark.parametrize("steps_kind", ["int", "tensor"])
def test_float64_losses_stay_float64_and_tol_compares_them(steps_kind):
    """As in TF2: losses 5e-8 apart, tol=1e-8, 20 steps; the plain sess.run loop and the
    stepwise reference run all 20 (a float32 trace stopped after 3)."""

    def graph(kind):
        return float64_seed_run(
            tf1.train.GradientDescentOptimizer(1e-6), 20, steps_kind, tol=1e-8, mode=kind
        )

    trace, ref = graph("fused"), graph("stepwise")
    assert trace.stop == ref.stop == Stop.STEPS and trace.steps == ref.steps == 20
    assert trace.loss.dtype == np.float64 and np.all(np.abs(np.diff(trace.loss)) > 1e-8)
    np.testing.assert_allclose(trace.loss, ref.loss, rtol=1e-12)


def _quadratic_graph(kind, lr, start, steps):
    g = tf.Graph()
    with g.as_default():

        def loss_fn():
            w = tf1.get_variable("w", initializer=tf.constant(start))
            return tf.reduce_sum(w * w)

        f = v1.fuse(loss_fn, tf1.train.MomentumOptimizer(lr, 0.5), steps=steps, mode=kind)
        init = tf1.global_variables_initializer()
    s = tf1.Session(graph=g)
    s.run(init)
    return s, f


@pytest.mark.parametrize(
    "lr, start", [(10.0, [1.0, -2.0]), (1e30, [1e9, 1e9])], ids=["loss_inf", "update_inf"]
)
def test_nonfinite_stops_without_applying(lr, start):
    s, f = _quadratic_graph("fused", lr, start, 100)
    sr, fr = _quadratic_graph("stepwise", lr, start, 100)
    trace, ref = f.run(s), fr.run(sr)
    assert trace.stop == ref.stop == Stop.NONFINITE and trace.steps == ref.steps < 100
    # XLA (fused) vs plain graph ops (stepwise): float32 rounding differs by ~3e-7 relative.
    np.testing.assert_allclose(trace.loss, ref.loss, rtol=1e-6)
    for a, b in zip(s.run(f.state), sr.run(fr.state)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        assert np.all(np.isfinite(a))
    if lr == 1e30:
        assert trace.steps == 0
        np.testing.assert_array_equal(s.run(f.var_list[0]), start)


# -- bad input ------------------------------------------------------------------------------


def test_eager_mode_is_rejected_with_the_fix():
    with pytest.raises(RuntimeError, match="tf.Graph\\(\\).as_default"):
        v1.fuse(lambda: tf.constant(1.0), tf1.train.GradientDescentOptimizer(0.1), steps=3)


def _build_in_graph(loss_fn, optimizer=None, **kw):
    with tf.Graph().as_default():
        return v1.fuse(loss_fn(), optimizer or tf1.train.GradientDescentOptimizer(0.1), **kw)


def _w():
    return tf1.get_variable("w", initializer=tf.constant([1.0, 2.0]))


@pytest.mark.parametrize(
    "case, name",
    [
        ("keras_optimizer", "optimizer"),
        ("vector_loss", "loss_fn"),
        ("int_loss", "loss_fn"),
        ("no_gradient", "loss_fn"),
        ("empty_var_list", "var_list"),
        ("int_var", "var_list"),
        ("steps_zero", "steps"),
        ("steps_float_tensor", "steps"),
        ("tol", "tol"),
    ],
)
def test_bad_input_names_the_argument(case, name):
    with tf.Graph().as_default():
        opt = tf1.train.GradientDescentOptimizer(0.1)
        kw = {"steps": 3}
        loss = lambda: tf.reduce_sum(_w() ** 2)  # noqa: E731
        if case == "keras_optimizer":
            opt = keras.optimizers.SGD(0.1)
        elif case == "vector_loss":
            loss = lambda: _w() ** 2  # noqa: E731
        elif case == "int_loss":
            loss = lambda: tf.cast(tf.reduce_sum(_w()), tf.int32)  # noqa: E731
        elif case == "no_gradient":
            v = tf1.get_variable("v", initializer=tf.constant([3.0]))
            w = _w()
            kw["var_list"] = [v]  # (with w too, v is left alone, as minimize leaves it)
            loss = lambda: tf.reduce_sum(w**2)  # noqa: E731  (never reads v)
        elif case == "empty_var_list":
            kw["var_list"] = []
        elif case == "int_var":
            kw["var_list"] = [tf1.get_variable("i", initializer=tf.constant([1]), dtype=tf.int32)]
        elif case == "steps_zero":
            kw["steps"] = 0
        elif case == "steps_float_tensor":
            kw["steps"] = tf1.placeholder(tf.float32, [])
        elif case == "tol":
            kw["tol"] = -1.0
        with pytest.raises((TypeError, ValueError), match=f"`{name}`") as err:
            v1.fuse(loss, opt, **kw)
    assert "got" in str(err.value)


def test_small_n_benchmark_script_times_every_contender(capsys, benchmark_script):
    # benchmarks/tf1_small_n.py, on its smallest settings: it runs and reports each row.
    script = benchmark_script("tf1_small_n")
    script.main(["--steps", "2", "--instances", "1", "--rounds", "1", "--runs", "1"])
    out = capsys.readouterr().out
    for row in (
        "stepfuse",
        "N copies (seed answer)",
        "sess.run of a constant",
        "stepfuse / N copies:",
    ):
        assert row in out


def test_var_list_none_trains_the_variables_the_loss_reads_as_minimize_does():
    """Two models in one graph, each fused with var_list=None: each trains its own
    variables, as optimizer.minimize(loss) does (the first was refused: no gradient
    reaches the second model's variables)."""

    def build(kind):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 2])
            y = tf1.placeholder(tf.int32, [None])
            out = {}
            for name in ("a", "b"):
                k = tf1.get_variable(
                    f"k_{name}", initializer=tf.constant([[1.0, 0.5], [-0.5, 1.0]])
                )
                loss_fn = lambda k=k: sparse_ce(y, tf.matmul(x, k))  # noqa: E731
                opt = tf1.train.MomentumOptimizer(0.1 if name == "a" else 0.3, 0.9)
                if kind == "fused":
                    out[name] = (v1.fuse(loss_fn, opt, steps=4), k)
                else:
                    loss = loss_fn()
                    out[name] = ((opt.minimize(loss), loss), k)
            init = tf1.global_variables_initializer()
        s = tf1.Session(graph=g)
        s.run(init)
        return s, out, {x: XS, y: YS}

    s, fused, fd = build("fused")
    r, plain, rd = build("plain")
    for name in ("a", "b"):
        f, k = fused[name]
        assert [v.name for v in f.var_list] == [k.name]
        losses = f.run(s, fd).loss
        (op, loss), rk = plain[name]
        ref = [r.run([loss, op], rd)[0] for _ in range(4)]
        np.testing.assert_allclose(losses, ref, rtol=1e-6)
        np.testing.assert_allclose(s.run(k), r.run(rk), rtol=1e-6)


def test_a_keras_layer_made_inside_loss_fn_gets_the_fix():
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 2])
        y = tf1.placeholder(tf.int32, [None])

        def new_layer_each_call():
            return sparse_ce(y, keras.layers.Dense(2)(x))

        with pytest.raises(ValueError, match="make them once before fuse, outside loss_fn") as e:
            v1.fuse(new_layer_each_call, tf1.train.GradientDescentOptimizer(0.1), steps=3)
        assert "new_layer_each_call" in str(e.value) and "guarded" not in str(e.value)


@pytest.mark.parametrize("kind", ["fused", "stepwise"])
def test_global_step_counts_applied_updates_and_drives_a_callable_schedule(kind):
    """As minimize(loss, global_step=gs): each applied update increments it, and a learning
    rate given as a callable of it decays at every step of a run (fuse had no global_step)."""

    def build(how):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(tf.float32, [None, 2])
            y = tf1.placeholder(tf.int32, [None])
            k = tf1.get_variable("k", initializer=tf.constant([[1.0, 0.5], [-0.5, 1.0]]))
            gs = tf1.train.get_or_create_global_step()
            opt = tf1.train.GradientDescentOptimizer(
                lambda: tf1.train.exponential_decay(0.5, gs, 1, 0.5)
            )
            loss_fn = lambda: sparse_ce(y, tf.matmul(x, k))  # noqa: E731
            if how == "plain":
                loss = loss_fn()
                handle = (opt.minimize(loss, global_step=gs), loss)
            else:
                handle = v1.fuse(loss_fn, opt, steps=4, global_step=gs, mode=how)
            init = tf1.global_variables_initializer()
        s = tf1.Session(graph=g)
        s.run(init)
        return s, handle, k, gs, {x: XS, y: YS}

    s, f, k, gs, fd = build(kind)
    losses = np.concatenate([f.run(s, fd, steps=n).loss for n in (3, 1)])
    r, (op, loss), rk, rgs, rd = build("plain")
    ref = [r.run([loss, op], rd)[0] for _ in range(4)]
    np.testing.assert_allclose(losses, ref, rtol=1e-6)
    np.testing.assert_allclose(s.run(k), r.run(rk), rtol=1e-6)
    assert s.run(gs) == r.run(rgs) == 4


def test_a_learning_rate_tensor_of_the_global_step_is_named_as_read_once_per_run():
    with tf.Graph().as_default():
        gs = tf1.train.get_or_create_global_step()
        w = tf1.get_variable("w", initializer=tf.ones([2]))
        opt = tf1.train.GradientDescentOptimizer(tf1.train.exponential_decay(0.5, gs, 1, 0.5))
        with pytest.warns(
            RuntimeWarning, match="learning_rate is a tensor computed from a variable"
        ) as caught:
            v1.fuse(lambda: tf.reduce_sum(w**2), opt, steps=3, global_step=gs)
        # one warning, not one per attribute holding the rate (it was said twice)
        said = [w for w in caught if "is a tensor computed" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in said]
        with pytest.raises(TypeError, match="`global_step`"):
            v1.fuse(lambda: tf.reduce_sum(w**2), opt, steps=3, global_step=3)


@pytest.mark.parametrize(
    "case", ["callable after minimize", "adagrad_da after minimize", "stepwise"]
)
def test_no_read_once_warning_where_every_step_reads_the_hyper_parameters(case):
    """An optimizer's own per-step tensors, left on it by the user's earlier ``minimize``
    (a callable's learning rate, AdagradDA's global step), are made again by each step of
    the loop; a stepwise run is one step per run: neither reads a value once per run."""
    with tf.Graph().as_default():
        gs = tf1.train.get_or_create_global_step()
        w = tf1.get_variable("w", initializer=tf.ones([2]))
        loss_fn = lambda: tf.reduce_sum(w**2)  # noqa: E731
        mode = "fused"
        if case == "callable after minimize":
            opt = tf1.train.GradientDescentOptimizer(
                lambda: tf1.train.exponential_decay(0.5, gs, 1, 0.5)
            )
        elif case == "adagrad_da after minimize":
            opt = tf1.train.AdagradDAOptimizer(0.1, global_step=gs)
        else:
            opt = tf1.train.GradientDescentOptimizer(tf1.train.exponential_decay(0.5, gs, 1, 0.5))
            mode = "stepwise"
        if mode == "fused":
            opt.minimize(loss_fn(), global_step=gs)  # the user's own train op, as in the seed
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            v1.fuse(loss_fn, opt, steps=3, global_step=gs, mode=mode)


@pytest.mark.parametrize(
    "kind, steps",
    [("fused", 5), ("fused", "placeholder"), ("stepwise", 5)],
    ids=["int", "tensor", "stepwise"],
)
def test_callback_every_k_updates_with_global_step_numbers_across_runs(kind, steps):
    """callback/every as in the other backends (TF1 had none): the host is called between
    chunks of the compiled loop, numbered over runs, bare sess.run included."""
    got = []
    g, s, f, x, y = seed_graph(
        steps, kind=kind, callback=lambda step, loss: got.append((step, loss)), every=2
    )
    fed = feed(x, y)
    losses = []
    for n in (5, 3):
        if steps == "placeholder":
            fed[f.steps] = n
            losses.append(f.run(s, fed).loss)
        else:
            losses.append(f.run(s, fed, steps=n).loss)
    losses = np.concatenate(losses)
    assert [step for step, _ in got] == [2, 4, 6, 8] and f.step == 8
    # each notification carries the loss of the update that reached its step
    np.testing.assert_allclose([loss for _, loss in got], losses[[1, 3, 5, 7]], rtol=1e-6)
    if kind == "fused":
        s.run(f.train_op, fed)  # a bare sess.run: the numbering goes on in the graph
        assert [step for step, _ in got][4:] == [10] + ([12] if steps == 5 else [])


@pytest.mark.parametrize("kind", ["fused", "stepwise"])
def test_a_callback_that_raises_stops_the_run_with_its_error(kind):
    def stop_at_4(step, loss):
        if step == 4:
            raise KeyboardInterrupt("enough")

    g, s, f, x, y = seed_graph(6, kind=kind, callback=stop_at_4, every=2)
    with pytest.raises(KeyboardInterrupt, match="enough"):
        f.run(s, feed(x, y))
    assert f.step == 4
    ref_g, ref_s, ref_f, rx, ry = seed_graph(4, kind=kind)
    ref_f.run(ref_s, feed(rx, ry))
    for a, b in zip(s.run(f.var_list), ref_s.run(ref_f.var_list)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_callback_numbering_survives_a_callback_error_in_a_bare_sess_run():
    """The graph's step count grows with each chunk, before its notification: a callback
    that raises inside a bare sess.run leaves it right (it was not advanced)."""
    got = []

    def boom_at_3(step, loss):
        got.append(step)
        if step == 3 and len(got) == 3:
            raise KeyError("boom")

    g, s, f, x, y = seed_graph(5, callback=boom_at_3, every=1)
    with pytest.raises(tf.errors.OpError):
        s.run(f.train_op, feed(x, y))
    assert s.run(f.counter) == 3
    f.run(s, feed(x, y), steps=2)
    assert got == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("given", [False, True], ids=["var_list=None", "var_list given"])
def test_variables_no_gradient_reaches_are_left_alone_as_minimize_leaves_them(given):
    # var_list=None: a variable read through stop_gradient. A given var_list holding a
    # variable the loss never reads was refused (naming an internal lambda): minimize skips it.
    def build(kind):
        g = tf.Graph()
        with g.as_default():
            w = tf1.get_variable("w", initializer=tf.constant([3.0, -1.0]))
            b = tf1.get_variable("b", initializer=tf.constant(2.0))
            if given:
                var_list, loss_fn = [w, b], lambda: tf.reduce_sum(w**2)
            else:
                var_list, loss_fn = None, lambda: tf.reduce_sum((w - tf.stop_gradient(b)) ** 2)
            opt = tf1.train.AdamOptimizer(0.1)
            if kind == "plain":
                loss = loss_fn()
                handle = (opt.minimize(loss, var_list=var_list), loss)
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    handle = v1.fuse(loss_fn, opt, steps=3, var_list=var_list, mode=kind)
                said = [str(m.message) for m in caught if "no gradient reaches" in str(m.message)]
                assert len(said) == given and all("['b:0']" in m for m in said), said
            init = tf1.global_variables_initializer()
        s = tf1.Session(graph=g)
        s.run(init)
        return s, handle, (w, b)

    r, (op, loss), (rw, _) = build("plain")
    ref = [r.run([loss, op])[0] for _ in range(3)]
    for kind in ("fused", "stepwise"):
        s, f, (w, b) = build(kind)
        assert [v.name for v in f.var_list] == ["w:0"]
        np.testing.assert_allclose(f.run(s).loss, ref, rtol=1e-6)
        np.testing.assert_allclose(s.run(w), r.run(rw), rtol=1e-6)
        assert s.run(b) == 2.0
