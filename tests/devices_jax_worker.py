"""Run by tests/test_devices_jax.py in a fresh process: XLA's CPU platform must be told to
show 8 devices before JAX initialises. Prints one JSON object: for each check, the numbers
the test asserts on (largest differences, shardings kept, collectives counted, errors)."""

from __future__ import annotations

import json
import os
import re
import sys

# 8 devices in one process, or 4 in each of the two processes of `multihost`
_COUNT = 4 if len(sys.argv) > 1 else 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_COUNT}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import stepfuse as sfc  # noqa: E402
import stepfuse.jax as sf  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = RNG.integers(0, 4, 64).astype("int32")
P0 = {
    "w1": (RNG.normal(size=(6, 16)) * 0.4).astype("float32"),
    "b1": np.zeros(16, "float32"),
    "w2": (RNG.normal(size=(16, 4)) * 0.4).astype("float32"),
}


def loss_fn(p, x, y):
    logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(p, x, y):
    logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return {"loss": loss_fn(p, x, y), "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


def put(a, mesh, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def gap(a, b) -> float:
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    return float(
        max(
            (
                np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64)))
                for u, v in pairs
            ),
            default=0.0,
        )
    )


def collectives(text: str) -> dict[str, int]:
    """How many of each collective the compiled HLO holds (``-start`` of an async one)."""
    return {k: len(re.findall(rf"\b{k}(?:-start)?\(", text)) for k in COLLECTIVES}


def kept(before, after) -> bool:
    """Whether every array of ``after`` has the sharding of its counterpart in ``before``
    (scalars, e.g. the step count, aside)."""
    ok = True
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        if np.ndim(a) and isinstance(a.sharding, NamedSharding):
            ok &= b.sharding.is_equivalent_to(a.sharding, np.ndim(a))
    return bool(ok)


def compare(make_fit, placed_state, placed_batch, plain_batch, calls, **call_kw):
    """The same calls on the placed inputs and on one device with the whole batch."""
    rows = {}
    for name, state, batch in (("many", placed_state, placed_batch), ("one", None, plain_batch)):
        fit = make_fit()
        s = state(fit) if state is not None else fit.init(P0)
        traces = []
        for kw in calls:
            s, t = fit(s, *batch, **kw, **call_kw)
            traces.append(t)
        rows[name] = (fit, s, traces)
    (fm, sm, tm), (_, s1, t1) = rows["many"], rows["one"]
    start = placed_state(make_fit())
    return {
        "loss_gap": gap([t.loss for t in tm], [t.loss for t in t1]),
        "state_gap": gap((sm.params, sm.opt_state), (s1.params, s1.opt_state)),
        "steps": [t.steps for t in tm],
        "steps_one_device": [t.steps for t in t1],
        "stops": [int(t.stop) for t in tm],
        "step": int(sm.step),
        "devices": len(jax.tree_util.tree_leaves(sm.params)[0].sharding.device_set),
        "shardings_kept": kept((start.params, start.opt_state), (sm.params, sm.opt_state)),
        "compiles": fm.compiles,
        "loss_scale": float(max(np.max(np.abs(t.loss)) for t in t1)),
    }, (fm, sm, tm)


def data_parallel() -> dict:
    DATA = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    GRID = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    out: dict = {}
    replicated = P()

    def fit12():
        return sf.fuse(loss_fn, optax.adam(0.05), steps=12)

    def state_on(mesh, specs=None):
        def make(fit):
            return fit.init(
                {k: put(a, mesh, (specs or {}).get(k, replicated)) for k, a in P0.items()}
            )

        return make

    xd, yd = put(X, DATA, P("data")), put(Y, DATA, P("data"))
    row, (fit, state, _) = compare(fit12, state_on(DATA), (xd, yd), (X, Y), [{}, {"steps": 5}])
    row["collectives"] = collectives(fit._compiled_text(state, xd, yd))
    one = fit12()
    row["collectives_one_device"] = collectives(one._compiled_text(one.init(P0), X, Y))
    out["fixed"] = row

    xs, ys = X.reshape(4, 16, 6), Y.reshape(4, 16)
    placed = sfc.Batches(put(xs, DATA, P(None, "data")), put(ys, DATA, P(None, "data")))
    row, (fit, state, _) = compare(
        lambda: sf.fuse(loss_fn, optax.adam(0.05), steps=4),
        state_on(DATA),
        (placed,),
        (sfc.Batches(xs, ys),),
        [{}],
    )
    row["collectives"] = collectives(fit._compiled_text(state, placed))
    out["batches"] = row

    # 64 rows, 16 a step: two calls of 6 steps cross epoch boundaries (a new order each)
    epochs = sfc.Epochs(xd, yd, batch_size=16, shuffle=True, seed=3)
    row, (fit, state, _) = compare(
        fit12,
        state_on(DATA),
        (epochs,),
        (sfc.Epochs(X, Y, batch_size=16, shuffle=True, seed=3),),
        [{"steps": 6}, {"steps": 6}],
    )
    text = fit._compiled_text(state, epochs)
    row["collectives"] = collectives(text)
    # each device's first layer multiplies its 2 of the minibatch's 16 rows
    row["per_device_rows"] = sorted(set(re.findall(r"f32\[(\d+),16\]\{1,0\} dot\(", text)))
    out["epochs"] = row

    # FSDP-style: parameters and optimizer state split over the 4 devices of "fsdp", the
    # batch over all 8 devices of the 2 x 4 grid
    specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}
    both = P(("data", "fsdp"))
    xg, yg = put(X, GRID, both), put(Y, GRID, both)
    row, (fit, state, _) = compare(fit12, state_on(GRID, specs), (xg, yg), (X, Y), [{}])
    row["collectives"] = collectives(fit._compiled_text(state, xg, yg))
    row["param_specs"] = {k: str(v.sharding.spec) for k, v in state.params.items()}
    out["fsdp"] = row

    # notifications, records and evaluation inside the loop on sharded inputs
    notes: dict[str, list] = {"many": [], "one": []}
    which = {"now": "many"}

    def noted():
        return sf.fuse(
            loss_fn,
            optax.adam(0.05),
            steps=12,
            record_every=2,
            callback=lambda step, loss: notes[which["now"]].append((step, float(loss))),
            every=3,
            eval_fn=accuracy,
            eval_every=4,
        )

    rows = {}
    for name, state, batch, ev in (
        ("many", state_on(DATA)(noted()), (xd, yd), (xd[:32], yd[:32])),
        ("one", None, (X, Y), (X[:32], Y[:32])),
    ):
        which["now"] = name
        fit = noted()
        s = state if state is not None else fit.init(P0)
        s, t = fit(s, *batch, eval_batch=ev)
        rows[name] = (s, t)
    (sm, tm), (s1, t1) = rows["many"], rows["one"]
    out["options"] = {
        "notes": [s for s, _ in notes["many"]],
        "notes_one_device": [s for s, _ in notes["one"]],
        "note_gap": gap([v for _, v in notes["many"]], [v for _, v in notes["one"]]),
        "loss_gap": gap(tm.loss, t1.loss),
        "state_gap": gap(sm.params, s1.params),
        "records": len(tm.loss),
        "eval_steps": [int(s) for s in tm.eval.step],
        "eval_gap": gap(tm.eval["loss"], t1.eval["loss"]),
        "shardings_kept": kept(state_on(DATA)(noted()).params, sm.params),
    }

    # a minibatch the dataset's split cannot split: refused before anything runs
    fit = fit12()
    state = state_on(DATA)(fit)
    before = jax.tree_util.tree_map(np.asarray, state)
    error = None
    try:
        fit(state, sfc.Epochs(xd, yd, batch_size=12, shuffle=True, seed=3))
    except ValueError as e:
        error = str(e)
    out["uneven"] = {
        "error": error,
        "compiles": fit.compiles,
        "unchanged": gap(before, jax.tree_util.tree_map(np.asarray, state)),
        "step": int(state.step),
    }
    return out


def guide() -> dict:
    """docs/guides/jax.md's data-parallel example, then its FSDP one, as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "jax.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    dp = next(b for b in blocks if 'Mesh(np.array(jax.devices()), ("data",))' in b and "def " in b)
    fsdp = next(b for b in blocks if "grid = Mesh" in b)
    scope: dict = {}
    exec(compile(dp, "jax.md (data parallel)", "exec"), scope)
    first = scope["trace"]
    exec(compile(fsdp, "jax.md (FSDP)", "exec"), scope)
    w1 = scope["state"].params["w1"]
    return {
        "steps": [first.steps, scope["trace"].steps],
        "w1_shards": len({str(s.index) for s in w1.addressable_shards}),
    }


def multihost(pid: int, port: int) -> dict:
    """Process ``pid`` of two, each with 4 of the mesh's 8 devices and its half of the
    batch, after ``jax.distributed.initialize`` (CPU collectives through gloo)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    half = slice(pid * 32, (pid + 1) * 32)
    x = jax.make_array_from_process_local_data(rows, X[half])
    y = jax.make_array_from_process_local_data(rows, Y[half])
    notes: list = []
    fit = sf.fuse(
        loss_fn, optax.adam(0.05), steps=12, callback=lambda s, v: notes.append(s), every=4
    )
    state, trace = fit(fit.init({k: put(a, mesh, P()) for k, a in P0.items()}), x, y)
    one = sf.fuse(loss_fn, optax.adam(0.05), steps=12)
    s1, t1 = one(one.init(P0), X, Y)
    local = {k: np.asarray(v.addressable_data(0)) for k, v in state.params.items()}
    return {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "steps": trace.steps,
        "notes": notes,
        "loss_gap": gap(trace.loss, t1.loss),
        "state_gap": gap(local, s1.params),
        "step": int(state.step.addressable_data(0)),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1:  # multihost PID PORT
        print(json.dumps(multihost(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
    else:
        print(json.dumps({"devices": jax.device_count(), **data_parallel(), "guide": guide()}))
