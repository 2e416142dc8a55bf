"""stepfuse.tf.v1 on TF1 code as its users write it: collections, a loss built outside
``loss_fn``, and what a loss's forward pass assigns.

- ``tf1.losses.*`` with ``tf1.losses.get_total_loss()`` inside ``loss_fn``, and an
  ``UPDATE_OPS`` dependency inside it: fused and stepwise equal the plain ``minimize``
  loop (the first, variable-creating call of ``loss_fn`` had left its loss and update op in
  the collections, counted twice or run once more per run).
- A loss read from a tensor built before ``fuse`` from the trained variables (the seed's
  ``logits``, ``fuse(lambda: loss)``) is refused naming it: inside the loop it kept its
  value from the start of the run, so every step applied the first step's gradient.
- The ``jit_compile="auto"`` trial undoes what the forward pass assigns (a moving mean, a
  counter), not only the trained state.
"""

import numpy as np
import pytest
import tensorflow as tf
from tf_helpers import seed_data

import stepfuse.tf.v1 as v1

tf1 = tf.compat.v1
XS, YS = seed_data()
STEPS = 3


def run(build, fused, mode="fused", jit_compile=False, runs=2):
    """``build(x, y) -> loss_fn`` in a new graph; the losses of ``runs`` runs of STEPS
    steps (fused) or of STEPS * runs plain ``minimize`` steps, and the global variables."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, (None, 2))
        y = tf1.placeholder(tf.int32, (None,))
        loss_fn = build(x, y)
        opt = tf1.train.GradientDescentOptimizer(0.5)
        if fused:
            f = v1.fuse(loss_fn, opt, steps=STEPS, mode=mode, jit_compile=jit_compile)
        else:
            loss = loss_fn()
            op = opt.minimize(loss)
        init = tf1.global_variables_initializer()
        variables = [v for v in tf1.global_variables() if v.name.startswith("m/")]
    with tf1.Session(graph=graph) as sess:
        sess.run(init)
        feed = {x: XS, y: YS}
        if fused:
            losses = np.concatenate([f.run(sess, feed).loss for _ in range(runs)])
        else:
            losses = np.array([sess.run([loss, op], feed)[0] for _ in range(STEPS * runs)])
        values = {v.name: sess.run(v) for v in variables}
    return losses, values


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-6, atol=1e-7, err_msg=name)


def total_loss(x, y):
    with tf1.variable_scope("m"):
        tf1.get_variable("kernel", initializer=tf.ones((2, 2)))

    def loss_fn():
        with tf1.variable_scope("m", reuse=tf1.AUTO_REUSE):
            k = tf1.get_variable("kernel", initializer=tf.ones((2, 2)))
        tf1.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, k))  # to LOSSES
        return tf1.losses.get_total_loss()

    return loss_fn


def update_ops(x, y):
    with tf1.variable_scope("m"):
        tf1.get_variable("kernel", initializer=tf.ones((2, 2)))
        tf1.get_variable("calls", initializer=0.0, trainable=False)
        tf1.get_variable("mean", initializer=tf.zeros(2), trainable=False)

    def loss_fn():
        with tf1.variable_scope("m", reuse=True):
            k, calls = tf1.get_variable("kernel"), tf1.get_variable("calls")
            mean = tf1.get_variable("mean")
        h = tf.matmul(x, k)
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, calls.assign_add(1.0))
        tf1.add_to_collection(
            tf1.GraphKeys.UPDATE_OPS, mean.assign(0.9 * mean + 0.1 * tf.reduce_mean(h, 0))
        )
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h)
            )
            return tf.identity(loss)

    return loss_fn


@pytest.mark.parametrize("build", [total_loss, update_ops], ids=["get_total_loss", "UPDATE_OPS"])
@pytest.mark.parametrize("mode", ["fused", "stepwise"])
def test_collections_filled_in_loss_fn_count_once_per_step(build, mode):
    want = run(build, fused=False)
    got = run(build, fused=True, mode=mode)
    assert_same(got, want)
    if build is update_ops:
        assert want[1]["m/calls:0"] == STEPS * 2


def test_the_auto_trial_undoes_what_the_forward_pass_assigns():
    want = run(update_ops, fused=False)
    got = run(update_ops, fused=True, jit_compile="auto")
    assert_same(got, want)


def logits_built_before(x, y):
    with tf1.variable_scope("m"):
        k = tf1.get_variable("kernel", initializer=tf.ones((2, 2)))
    logits = tf.matmul(x, k)  # as the seed's code builds it, once
    return lambda: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    )


def loss_built_before(x, y):
    loss = logits_built_before(x, y)()
    return lambda: loss


@pytest.mark.parametrize("build", [logits_built_before, loss_built_before])
def test_a_loss_read_from_tensors_built_before_fuse_is_refused(build):
    with pytest.raises(ValueError, match=r"`loss_fn` .*reads \['(MatMul|Mean):0'\].*Move"):
        run(build, fused=True)
    # stepwise runs one step per sess.run: the tensor is computed afresh at each
    assert_same(run(build, fused=True, mode="stepwise"), run(build, fused=False))


def dropout(x, y):
    with tf1.variable_scope("m"):
        tf1.get_variable("kernel", initializer=tf.ones((2, 8)) * 0.5)
        tf1.get_variable("out", initializer=tf.ones((8, 2)) * 0.1)

    def loss_fn():
        with tf1.variable_scope("m", reuse=True):
            k, out = tf1.get_variable("kernel"), tf1.get_variable("out")
        h = tf1.nn.dropout(tf.tanh(tf.matmul(x, k)), rate=0.3, seed=5)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(h, out))
        )

    return loss_fn


@pytest.mark.parametrize("jit_compile", ["auto", True])
def test_a_loss_that_draws_random_numbers_runs_on_tensorflows_kernels(jit_compile):
    # XLA draws other masks than TensorFlow's kernels from the same seed, and the "auto"
    # trial used up draws of the plain loop's: both trained otherwise, without a word.
    with pytest.warns(RuntimeWarning, match=r"draws random numbers \(ops: RandomUniform"):
        got = run(dropout, fused=True, jit_compile=jit_compile)
    assert_same(got, run(dropout, fused=False))


def test_a_new_session_gets_the_kept_loop_for_bare_runs():
    # The "auto" choice is a variable the bare `train_op` reads; it starts at XLA. A second
    # session (or one initialised again) ran the XLA loop, which fails on Momentum's sparse
    # update, even after `run` there.
    graph = tf.Graph()
    with graph.as_default():
        ids = tf1.placeholder(tf.int32, (None,))
        table = tf1.get_variable("table", initializer=tf.ones((5, 2)))

        def loss_fn():
            return tf.reduce_sum(tf.gather(table, ids) ** 2)

        f = v1.fuse(loss_fn, tf1.train.MomentumOptimizer(0.1, 0.9), steps=2)
        init = tf1.global_variables_initializer()
    feed = {ids: np.array([0, 2, 2])}
    with tf1.Session(graph=graph) as first:
        first.run(init)
        f.run(first, feed)
        assert f.plan["xla"] is False, f.plan
        first.run(f.train_op, feed)
        first.run(init)  # the choice variable back at its initial value: decide writes it
        f.decide(first)
        first.run(f.train_op, feed)
    with tf1.Session(graph=graph) as second:
        second.run(init)
        f.run(second, feed)
        second.run(f.train_op, feed)
        np.testing.assert_allclose(second.run(table)[1], [1.0, 1.0])  # (not read: untouched)


def test_the_auto_trial_runs_outside_a_monitored_sessions_hooks():
    """In a MonitoredTrainingSession, `run`'s first call times both loops: its hooks saw
    each trial run (a CheckpointSaverHook saved mid-trial, and a StopAtStepHook whose last
    step fell inside the trial stopped it and the call raised). They see the run alone."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, (None, 2))
        y = tf1.placeholder(tf.int32, (None,))
        loss_fn = total_loss(x, y)
        step = tf1.train.get_or_create_global_step()
        f = v1.fuse(loss_fn, tf1.train.GradientDescentOptimizer(0.5), steps=STEPS, global_step=step)

        class Seen(tf1.train.SessionRunHook):
            steps: list = []

            def before_run(self, run_context):
                return tf1.train.SessionRunArgs(step)

            def after_run(self, run_context, run_values):
                self.steps.append(int(run_values.results))

        seen = Seen()
        hooks = [tf1.train.StopAtStepHook(last_step=1), seen]
        with tf1.train.MonitoredTrainingSession(hooks=hooks, log_step_count_steps=None) as ms:
            losses = f.run(ms, {x: XS, y: YS}).loss
            assert ms.should_stop()
    want = run(total_loss, fused=False, runs=1)[0]
    np.testing.assert_allclose(losses, want, rtol=1e-6, atol=1e-7)
    assert len(seen.steps) == 1 and f.plan["xla"] is not None, (seen.steps, f.plan)
