"""Bad input to the TF2 (`stepfuse.tf`) and TF1 (`stepfuse.tf.v1`) backends, as tables.

Every case raises a TypeError/ValueError whose message names the argument (in
backquotes), shows the value received ("got ...") and says how to fix it, and leaves
the variables and the optimizer untouched (checked after every case). The checks
happen before any update runs: at ``fuse`` time for options, optimizer and
variables, while tracing the first call for the loss and the batch.

Documented exceptions to "TypeError/ValueError naming the argument":

* TF1, eager mode: ``RuntimeError`` saying how to enter graph mode (not an argument);
* TF1, a batch that does not fit: TF's own ``ValueError`` from ``sess.run`` naming the
  placeholder (``Cannot feed value of shape (50, 1) for Tensor x:0 ...``);
* a callback that raises: *its* exception reaches the caller unchanged; the variables
  and optimizer are those of the last completed step (`test_raising_callback_*`).
* TF1 has no ``callback`` / ``every`` / ``progress`` options (not in the v1 API), and
  accepts a non-trainable variable named explicitly in ``var_list`` (TF1 optimizers do).
"""

import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import stepfuse.tf as sf
import stepfuse.tf.v1 as v1
from stepfuse import Batches
from stepfuse.problems import blobs, perceptron_init

tf1 = tf.compat.v1
X, Y = blobs()
FIX_WORDS = ("Pass", "Build", "Use", "use", "return", "cast", "reduce", "read", "Check", "choose")


def ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


class World:
    """The seed perceptron's variables, an SGD-with-momentum optimizer and the loss."""

    def __init__(self):
        p = perceptron_init()
        self.k, self.b = (
            tf.Variable(p["kernel"], name="kernel"),
            tf.Variable(p["bias"], name="bias"),
        )
        self.vars = [self.k, self.b]
        self.opt = keras.optimizers.SGD(0.1, momentum=0.9)
        self.before = [v.numpy().copy() for v in self.vars]

    def loss(self, x, y):
        return ce(y, tf.matmul(x, self.k) + self.b)

    def fit(self, loss=None, variables=None, optimizer="default", **kw):
        kw.setdefault("steps", 3)
        return sf.fuse(
            loss or self.loss,
            self.opt if optimizer == "default" else optimizer,
            self.vars if variables is None else variables,
            **kw,
        )

    def unchanged(self):
        for v, b in zip(self.vars, self.before):
            np.testing.assert_array_equal(v.numpy(), b)
        assert int(self.opt.iterations) == 0
        for v in self.opt.variables:
            if "momentum" in v.name:
                assert not np.any(v.numpy())


def _other_framework_optimizers():
    cases = []
    try:
        import optax

        cases += [("optax.sgd", optax.sgd(0.1)), ("optax.adam factory", optax.adam)]
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        cases.append(
            ("torch.optim.SGD", torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))
        )
    except ImportError:  # pragma: no cover
        pass

    class OptaxLike:  # init/update, like an optax GradientTransformation
        def init(self, params):
            return ()

        def update(self, grads, state, params=None):
            return grads, state

    return cases + [
        ("optax-like dummy", OptaxLike()),
        ("tf1 GradientDescent", tf1.train.GradientDescentOptimizer(0.1)),
        ("string", "sgd"),
        ("none", None),
    ]


def _loss(case):
    def f(w: World):
        return {
            "vector": lambda x, y: tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, tf.matmul(x, w.k) + w.b
            ),
            "integer": lambda x, y: tf.cast(w.loss(x, y) * 100, tf.int32),
            "string": lambda x, y: "loss",
            "none": lambda x, y: None,
            "reads_no_variable": lambda x, y: ce(y, tf.matmul(x, tf.stop_gradient(w.k))),
            "numpy_read": lambda x, y: ce(y, tf.matmul(x, w.k.numpy()) + w.b),
            "pair": lambda x, y: (w.loss(x, y), tf.reduce_mean(x)),  # (loss, aux)
            "new_variable": lambda x, y: ce(y, tf.matmul(x, tf.Variable(tf.ones((2, 2))))) + w.b[0],
        }[case]

    return f


def _distributed():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    return strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((X, Y)).batch(10)
    )


def _call(w, build_kw=None, batch=(X, Y), **call_kw):
    fit = w.fit(**(build_kw or {}))
    return fit(*batch, **call_kw)


# (id, action(world), regex the message must match)
TF2_CASES = [
    *[
        (f"steps={v!r}", lambda w, v=v: w.fit(steps=v), "`steps`")
        for v in (0, -1, 1.5, True, "3", None)
    ],
    *[(f"call steps={v!r}", lambda w, v=v: _call(w, steps=v), "`steps`") for v in (0, 2.0, "2")],
    *[(f"tol={v!r}", lambda w, v=v: w.fit(tol=v), "`tol`") for v in (-1.0, math.nan, "1e-3", True)],
    *[
        (f"record_every={v!r}", lambda w, v=v: w.fit(record_every=v), "`record_every`")
        for v in (0, 2.5, None)
    ],
    ("every=0", lambda w: w.fit(every=0, callback=print), "`every`"),
    ("every without callback", lambda w: w.fit(every=5), "`every`"),
    ("callback not callable", lambda w: w.fit(callback="print"), "`callback`"),
    ("progress='yes'", lambda w: w.fit(progress="yes"), "`progress`"),
    ("on_nonfinite='ignore'", lambda w: w.fit(on_nonfinite="ignore"), "`on_nonfinite`"),
    ("mode='eager'", lambda w: w.fit(mode="eager"), "`mode`"),
    ("jit_compile='yes'", lambda w: w.fit(jit_compile="yes"), "`jit_compile`"),
    ("loss_fn not callable", lambda w: w.fit(loss=3.0), "`loss_fn`"),
    *[
        (
            f"loss {c} ({m})",
            lambda w, c=c, m=m: _call(w, {"loss": _loss(c)(w), "mode": m}),
            "`loss_fn`",
        )
        for c in ("vector", "integer", "string", "none", "reads_no_variable", "numpy_read")
        for m in ("fused", "stepwise")
    ],
    # (told to reduce "a tensor of shape (2,)"; and a new variable blamed `batch`)
    ("loss (loss, aux)", lambda w: _call(w, {"loss": _loss("pair")(w)}), r"tuple of 2.*has_aux"),
    (
        "loss makes a variable",
        lambda w: _call(w, {"loss": _loss("new_variable")(w)}),
        r"^`loss_fn` must create no variables.*Build it once before fuse",
    ),
    *[
        (f"batch {c} ({m})", lambda w, b=b, m=m: _call(w, {"mode": m}, batch=b), "`batch`")
        for c, b in (
            ("x has 1 feature", (X[:, :1], Y)),
            ("float labels", (X, Y.astype(np.float32))),
            ("missing y", (X,)),
            ("extra argument", (X, Y, Y)),
        )
        for m in ("fused", "stepwise")
    ],
    (
        "batch a tf.data.Dataset",
        lambda w: _call(w, batch=(tf.data.Dataset.from_tensor_slices((X, Y)).batch(10),)),
        r"`batch`.*tf.data.Dataset.*iter\(dataset\)",
    ),
    *[
        (
            f"batch a strategy's distributed {what}",
            lambda w, wrap=wrap: _call(w, batch=(wrap(_distributed()),)),
            r"`batch`.*experimental_distribute_dataset.*iter\(dataset\)",
        )
        for what, wrap in (("dataset", lambda d: d), ("iterator", iter))
    ],
    *[
        (f"optimizer {name}", lambda w, o=o: w.fit(optimizer=o), "`optimizer`")
        for name, o in _other_framework_optimizers()
    ],
    (
        "optimizer LossScaleOptimizer",
        lambda w: w.fit(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))),
        "`optimizer`.*LossScaleOptimizer",
    ),
    ("variables empty", lambda w: w.fit(variables=[]), "`variables`"),
    (
        "variables not trainable",
        lambda w: w.fit(variables=[tf.Variable([1.0], trainable=False)]),
        "`variables`",
    ),
    ("variables int32", lambda w: w.fit(variables=[tf.Variable([1, 2])]), "`variables`"),
    ("variables float tensor", lambda w: w.fit(variables=[tf.constant([1.0])]), "`variables`"),
    ("variables numpy", lambda w: w.fit(variables=np.ones(2, np.float32)), "`variables`"),
    ("variables None", lambda w: w.fit(variables=None or "kernel"), "`variables`"),
    ("variables duplicated", lambda w: w.fit(variables=[w.k, w.k]), "`variables`"),
    (
        "variables unbuilt model",
        lambda w: w.fit(variables=keras.Sequential([keras.layers.Dense(2)])),
        "`variables`",
    ),
]


@pytest.mark.parametrize("case, action, pattern", TF2_CASES, ids=[c[0] for c in TF2_CASES])
def test_tf2_bad_input_names_argument_and_changes_nothing(case, action, pattern):
    w = World()
    with pytest.raises((TypeError, ValueError), match=pattern) as err:
        action(w)
    msg = str(err.value)
    assert "got" in msg and any(word in msg for word in FIX_WORDS), msg
    w.unchanged()


def test_tf2_fit_called_inside_a_tf_function_says_so_and_changes_nothing():
    w = World()
    fit = w.fit()
    with pytest.raises(RuntimeError, match="call the fit eagerly"):
        tf.function(lambda x, y: fit(x, y).steps)(X, Y)
    w.unchanged()
    assert fit(X, Y).steps == 3  # still usable


def test_tf1_reference_variables_are_refused_with_the_fix():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2])
        y = tf1.placeholder(tf.int32, [None])

        def loss():  # reference variables, as after tf.compat.v1.disable_v2_behavior()
            k = tf1.get_variable("kernel", initializer=P["kernel"], use_resource=False)
            b = tf1.get_variable("bias", initializer=P["bias"], use_resource=False)
            return ce(y, tf.matmul(x, k) + b)

        with pytest.raises(
            TypeError,
            match=r"`var_list`.*got None \(NoneType\).*"
            r"reference variable.*enable_resource_variables",
        ):
            v1.fuse(loss, tf1.train.GradientDescentOptimizer(0.1), steps=3)


def test_tf1_loss_fn_that_cannot_take_the_data_is_named_before_any_graph_is_built():
    """loss_fn() without data, loss_fn(*minibatch) with it: a mismatch names loss_fn (the
    user's own function, not a wrapper), the cause and the fix, and builds nothing."""
    g = tf.Graph()
    with g.as_default():
        w = tf1.get_variable("w", initializer=tf.ones(3))
        before = len(g.get_operations())
        cases = [
            (lambda a: tf.reduce_sum(w * a), None, r"no arguments.*'a'.*data=stepfuse"),
            (
                lambda a, b: tf.reduce_sum(w * a),
                Batches(np.ones((4, 3), np.float32)),
                r"loss_fn\(\*minibatch\) with the 1 arrays.*'b'.*one parameter per array",
            ),
        ]
        for loss_fn, data, match in cases:
            with pytest.raises(TypeError, match=f"`loss_fn`.*{match}") as e:
                v1.fuse(loss_fn, tf1.train.GradientDescentOptimizer(0.1), steps=2, data=data)
            assert repr(loss_fn) in str(e.value)
        assert len(g.get_operations()) == before

        def vector():
            return w * 2.0

        with pytest.raises(ValueError, match="`loss_fn` must be .*scalar") as e:
            v1.fuse(vector, tf1.train.GradientDescentOptimizer(0.1), steps=2)
        assert "vector" in str(e.value)


@pytest.mark.parametrize("steps_kind", ["int", "tensor"])
def test_tf1_steps_fed_below_one_fail_the_run_and_change_nothing(steps_kind):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2])
        y = tf1.placeholder(tf.int32, [None])
        steps = 3 if steps_kind == "int" else tf1.placeholder(tf.int32, [])

        def loss():
            k = tf1.get_variable("kernel", initializer=P["kernel"])
            b = tf1.get_variable("bias", initializer=P["bias"])
            return ce(y, tf.matmul(x, k) + b)

        fused = v1.fuse(loss, tf1.train.MomentumOptimizer(0.1, 0.9), steps=steps)
        init = tf1.global_variables_initializer()
    with tf1.Session(graph=g) as sess:
        sess.run(init)
        before = sess.run(fused.state)
        for bad in (0, -5):
            with pytest.raises(tf.errors.InvalidArgumentError, match="at least 1"):
                sess.run(fused.train_op, {x: X, y: Y, fused.steps: bad})
        for a, b in zip(sess.run(fused.state), before):
            np.testing.assert_array_equal(a, b)


def test_tf2_batch_error_carries_tf_message_and_shapes():
    w = World()
    with pytest.raises(ValueError, match=r"`batch`.*float32\[50, 1\].*Dimensions must be equal"):
        w.fit()(X[:, :1], Y)
    w.unchanged()


class Boom(Exception):
    pass


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_raising_callback_reaches_caller_state_at_last_completed_step(mode):
    w = World()

    def callback(step, loss):
        if step == 6:
            raise Boom(f"callback failed at step {step}")

    fit = w.fit(steps=10, every=3, callback=callback, mode=mode)
    with pytest.raises(Boom, match="step 6"):
        fit(X, Y)
    assert fit.step == 6 and int(w.opt.iterations) == 6
    # The oracle: the same optimizer stepped eagerly 6 times, in float32 and in float64.
    # XLA's fused kernels round otherwise than eager ops (FMA on some CPUs), so where the
    # two float32 runs differ, fused must be no further from float64 than eager is (x3).
    refs = {}
    for dtype in (np.float32, np.float64):
        ref = World()
        if dtype == np.float64:
            ref.k, ref.b = (tf.Variable(v.numpy().astype(dtype)) for v in ref.vars)
            ref.vars = [ref.k, ref.b]
        for _ in range(6):
            with tf.GradientTape() as tape:
                loss = ref.loss(tf.constant(X.astype(dtype)), tf.constant(Y))
            ref.opt.apply_gradients(zip(tape.gradient(loss, ref.vars), ref.vars))
        refs[dtype] = [v.numpy().astype(np.float64) for v in ref.vars + list(ref.opt.variables)]
    got = [v.numpy().astype(np.float64) for v in w.vars + list(w.opt.variables)]
    for a, b, c in zip(got, refs[np.float32], refs[np.float64]):
        assert a.shape == b.shape == c.shape
        if not np.allclose(a, b, rtol=1e-6, atol=1e-7):
            fused_err, eager_err = np.abs(a - c).max(), np.abs(b - c).max()
            assert fused_err <= 3 * eager_err + 1e-7, (fused_err, eager_err)
    # The fit keeps working from there.
    fit2 = sf.fuse(w.loss, w.opt, w.vars, steps=2)
    assert fit2(X, Y).steps == 2 and int(w.opt.iterations) == 8


# -- TF1 graph mode ------------------------------------------------------------------------

P = perceptron_init()


def _v1(case):
    """Build a TF1 graph with the bad input ``case``; returns (graph, sess-or-None, fused)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")

        def k():
            with tf1.variable_scope(tf1.get_variable_scope(), reuse=tf1.AUTO_REUSE):
                return tf1.get_variable("kernel", initializer=P["kernel"])

        def b():
            with tf1.variable_scope(tf1.get_variable_scope(), reuse=tf1.AUTO_REUSE):
                return tf1.get_variable("bias", initializer=P["bias"])

        def loss():
            return ce(y, tf.matmul(x, k()) + b())

        kw, opt = {"steps": 3}, tf1.train.GradientDescentOptimizer(0.1)
        kind, _, value = case.partition("=")
        if kind in ("steps", "tol", "record_every", "mode", "jit_compile", "on_nonfinite", "chunk"):
            kw[kind] = eval(value)  # noqa: S307 - literals of this table only
        elif kind == "steps_tensor":
            kw["steps"] = {
                "float": tf1.placeholder(tf.float32, []),
                "vector": tf1.placeholder(tf.int32, [2]),
            }[value]
        elif kind == "optimizer":
            opt = dict(_other_framework_optimizers() + [("keras SGD", keras.optimizers.SGD(0.1))])[
                value
            ]
        elif kind == "loss":
            loss = {
                "not callable": 3.0,
                "vector": lambda: tf.nn.sparse_softmax_cross_entropy_with_logits(
                    y, tf.matmul(x, k()) + b()
                ),
                "integer": lambda: tf.cast(ce(y, tf.matmul(x, k()) + b()) * 100, tf.int32),
                "none": lambda: None,
                "bias_unused": lambda: (
                    ce(y, tf.matmul(x, k())) + 0 * tf.reduce_sum(tf.stop_gradient(b()))
                ),
            }[value]
            if value == "bias_unused":  # asked for by name, alone: no gradient reaches it
                kw["var_list"] = [b()]  # (beside the kernel it is left alone, as minimize does)
        elif kind == "var_list":
            kw["var_list"] = {
                "empty": lambda: [],
                "string": lambda: "kernel",
                "int": lambda: [
                    tf1.get_variable("i", initializer=tf.constant([1]), dtype=tf.int32)
                ],
                "tensor": lambda: [tf.constant([1.0])],
            }[value]()
        v1.fuse(loss, opt, **kw)


V1_CASES = [
    *[(f"steps={v}", "`steps`") for v in ("0", "-2", "1.5", "True", "'3'")],
    ("steps_tensor=float", "`steps`"),
    ("steps_tensor=vector", "`steps`"),
    *[(f"tol={v}", "`tol`") for v in ("-1.0", "float('nan')", "'x'")],
    *[(f"record_every={v}", "`record_every`") for v in ("0", "1.5")],
    ("mode='eager'", "`mode`"),
    ("jit_compile='yes'", "`jit_compile`"),
    ("on_nonfinite='ignore'", "`on_nonfinite`"),
    ("chunk=0", "`chunk`"),
    *[
        (f"optimizer={name}", "`optimizer`")
        for name, _ in _other_framework_optimizers()
        if name != "tf1 GradientDescent"
    ],
    ("optimizer=keras SGD", "`optimizer`"),
    *[
        (f"loss={c}", "`loss_fn`")
        for c in ("not callable", "vector", "integer", "none", "bias_unused")
    ],
    *[(f"var_list={c}", "`var_list`") for c in ("empty", "string", "int", "tensor")],
]


@pytest.mark.parametrize("case, pattern", V1_CASES, ids=[c[0] for c in V1_CASES])
def test_tf1_bad_input_names_the_argument(case, pattern):
    with pytest.raises((TypeError, ValueError), match=pattern) as err:
        _v1(case)
    msg = str(err.value)
    assert "got" in msg and any(word in msg for word in FIX_WORDS), msg


def _v1_seed(**kw):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")

        def loss():
            k = tf1.get_variable("kernel", initializer=P["kernel"])
            b = tf1.get_variable("bias", initializer=P["bias"])
            return ce(y, tf.matmul(x, k) + b)

        fused = v1.fuse(loss, tf1.train.MomentumOptimizer(0.1, 0.9), steps=3, **kw)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=g)
    sess.run(init)
    return sess, fused, x, y


@pytest.mark.parametrize("mode", ["fused", "stepwise"])
@pytest.mark.parametrize(
    "case", ["x has 1 feature", "labels 2-D", "steps=0 at run", "steps=1.5 at run"]
)
def test_tf1_bad_feed_or_run_steps_changes_nothing(case, mode):
    sess, fused, x, y = _v1_seed(mode=mode)
    before = sess.run(fused.state)
    feed, kw, pattern = {x: X, y: Y}, {}, "`steps`"
    if case == "x has 1 feature":
        feed, pattern = {x: X[:, :1], y: Y}, r"Cannot feed value of shape \(50, 1\) for Tensor x:0"
    elif case == "labels 2-D":
        feed, pattern = (
            {x: X, y: Y[:, None]},
            r"Cannot feed value of shape \(50, 1\) for Tensor y:0",
        )
    else:
        kw["steps"] = 0 if "=0" in case else 1.5
    with pytest.raises((TypeError, ValueError), match=pattern):
        fused.run(sess, feed, **kw)
    for a, b in zip(sess.run(fused.state), before):
        np.testing.assert_array_equal(a, b)
    assert fused.run(sess, {x: X, y: Y}).steps == 3  # still usable


def test_tf1_eager_mode_is_a_runtime_error_with_the_fix():
    with pytest.raises(RuntimeError, match=r"tf.Graph\(\).as_default"):
        v1.fuse(lambda: tf.constant(1.0), tf1.train.GradientDescentOptimizer(0.1), steps=3)


def test_case_count():
    # 2 + 4 + 4*2 + 1 + 1 table-external cases: batch message, callback x2, feeds x8, eager.
    n = len(TF2_CASES) + len(V1_CASES) + 1 + 2 + 8 + 1
    print(f"bad-input cases: TF2 table {len(TF2_CASES)}, TF1 table {len(V1_CASES)}, total {n}")
    assert len(TF2_CASES) >= 50 and len(V1_CASES) >= 25


def test_an_optimizer_built_for_another_model_is_named_at_fuse():
    """Keras would say "Unknown variable" only at the first update, inside the loop."""
    models = [keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]) for _ in range(2)]
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build(models[0].trainable_variables)
    slots = [v.numpy() for v in optimizer.variables]
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be .*built for these variables.*not for \[.*kernel.*"
        r"Create a new optimizer",
    ):
        sf.fuse(lambda x: tf.reduce_sum(models[1](x)), optimizer, models[1], steps=2)
    assert len(optimizer.variables) == len(slots)
    fit = sf.fuse(lambda x: tf.reduce_sum(models[0](x) ** 2), optimizer, models[0], steps=2)
    assert fit(tf.ones((4, 3))).steps == 2  # the model it was built for


def test_python_lists_as_arrays_get_a_short_error_with_the_fix():
    """``fit(x.tolist(), y.tolist())``: a list is a structure (as tf.function reads it), so
    loss_fn gets scalars; the error says so briefly rather than listing every scalar."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fit = sf.fuse(lambda x, y: ce(y, model(x)), keras.optimizers.SGD(0.1), model, steps=2)
    with pytest.raises(ValueError, match=r"`batch` must fit loss_fn") as e:
        fit(X.tolist(), Y.tolist())
    text = str(e.value)
    assert f"a list of {X.size} scalars" in text and "np.asarray" in text
    assert len(text) < 2000, len(text)


def test_a_python_generator_of_batches_is_told_how_to_stream_it():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fit = sf.fuse(lambda x, y: ce(y, model(x)), keras.optimizers.SGD(0.1), model, steps=2)
    before = [v.numpy() for v in model.weights]
    batches = ((X, Y) for _ in range(4))
    with pytest.raises(TypeError, match=r"(?s)generator.*Dataset\.from_generator"):
        fit(batches)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.weights))


def test_a_list_of_variables_is_described_briefly_naming_the_culprit_by_path():
    # Its repr (every value of every variable) made a 14,000-character message.
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(64), keras.layers.BatchNormalization()]
    )
    with pytest.raises(ValueError, match=r"moving_mean' has trainable=False") as err:
        sf.fuse(lambda: 0.0, keras.optimizers.SGD(0.1), model.weights, steps=2)
    msg = str(err.value)
    assert len(msg) < 500 and "got a list of 6 items" in msg, msg
    assert re.search(r"/batch_normalization(_\d+)?/moving_mean'", msg), msg  # (its path)
