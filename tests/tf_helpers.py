"""Shared problems and reference loops for the TensorFlow tests (TF2 and TF1 graph mode)."""

import math

import keras
import numpy as np
import tensorflow as tf
from helpers import CATALOGUES

from stepfuse.problems import SEED_LR, blobs, mlp_init, perceptron_init

tf1 = tf.compat.v1
LN2 = math.log(2.0)

OPTIMIZERS = CATALOGUES["tf2"]


def seed_data():
    return blobs(50)


def sparse_ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


class Perceptron(tf.Module):
    """The seed's 2->2 dense layer as two tf.Variables (kernel ones, bias zeros)."""

    def __init__(self, dtype=tf.float32):
        p = perceptron_init()
        self.kernel = tf.Variable(tf.cast(p["kernel"], dtype), name="kernel")
        self.bias = tf.Variable(tf.cast(p["bias"], dtype), name="bias")

    def __call__(self, x):
        return tf.matmul(x, self.kernel) + self.bias


def keras_mlp(sizes=(2, 16, 2)):
    """A small Keras MLP with weights from `mlp_init` (deterministic)."""
    layers = [keras.Input((sizes[0],))]
    for k in range(1, len(sizes)):
        layers.append(
            keras.layers.Dense(sizes[k], activation="tanh" if k < len(sizes) - 1 else None)
        )
    model = keras.Sequential(layers)
    weights = []
    for layer in mlp_init(sizes):
        weights += [layer["kernel"], layer["bias"]]
    model.set_weights(weights)
    return model


def make_problem(name):
    """``(model, variables, loss_fn)`` for "perceptron" or "mlp"."""
    model = Perceptron() if name == "perceptron" else keras_mlp()
    variables = list(model.trainable_variables)

    def loss_fn(x, y):
        return sparse_ce(y, model(x))

    return model, variables, loss_fn


def reference_steps(loss_fn, optimizer, variables, x, y, n):
    """The framework's own stepwise training: GradientTape + apply_gradients, eagerly."""
    losses = []
    for _ in range(n):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        losses.append(float(loss))
    return np.asarray(losses)


def values(variables):
    return [np.array(v.numpy()) for v in variables]


def seed_graph(steps=None, kind="fused", optimizer=None, **kw):
    """The seed in a fresh TF1 graph: ``(graph, sess, handle, x, y)``.

    ``kind``: "fused" / "stepwise" (stepfuse.tf.v1.fuse) or "copies" (N chained copies;
    then ``handle`` is ``(train_op, losses)``) or "plain" (one-step train_op).
    ``steps="placeholder"`` gives fuse an int32 placeholder (``handle.steps``) instead.
    """
    import stepfuse.tf.v1 as v1

    p = perceptron_init()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        if steps == "placeholder":
            steps = tf1.placeholder(tf.int32, [], name="steps")

        def loss_fn():
            k = tf1.get_variable("kernel", initializer=p["kernel"])
            b = tf1.get_variable("bias", initializer=p["bias"])
            return sparse_ce(y, tf.matmul(x, k) + b)

        opt = optimizer() if optimizer else tf1.train.GradientDescentOptimizer(SEED_LR)
        if kind == "copies":
            handle = v1.copies_train_op(loss_fn, opt, steps)
        elif kind == "plain":
            loss = loss_fn()
            handle = (opt.minimize(loss), loss)
        else:
            handle = v1.fuse(loss_fn, opt, steps=steps, mode=kind, **kw)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=g)
    sess.run(init)
    return g, sess, handle, x, y
