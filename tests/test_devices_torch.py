"""torch over several ranks: two gloo processes on 127.0.0.1 run fused fits whose gradients
are averaged over the ranks at every step, inside the compiled program.

The ranks run this file as a script (``python tests/test_devices_torch.py worker OUT``,
with the environment variables torchrun sets); each writes what it saw to ``OUT``, and the
tests compare the two ranks with each other, with a single-process loop over the whole
batch, and with a plain ``DistributedDataParallel`` loop the workers run on the same
shards. A hang fails the test (the workers' process group times out after 120 s, the
subprocess after 900 s). Compiles: two programs per rank (a plain model over `Batches`, a
DDP model with BatchNorm over `Epochs`); the torchrun smoke run compiles one more.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
STEPS = 6  # stacked minibatches per rank
ROWS = 4  # rows of a rank's minibatch


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set: ``STEPS`` minibatches of ``WORLD * ROWS`` rows (4 features, 3
    classes); rank r's shard of minibatch i is rows ``r * ROWS : (r + 1) * ROWS``."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, WORLD * ROWS, 4, generator=g)
    y = torch.randint(0, 3, (STEPS, WORLD * ROWS), generator=g)
    return x, y


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[:, rank * ROWS : (rank + 1) * ROWS].contiguous()


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    # no bias before the BatchNorm: its gradient would be rounding noise, which Adam
    # turns into steps of about lr in directions any other rounding flips
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 3),
    )


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


CLIP = 0.5  # clips every step here: the average must come before the clipping


def rolled(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` with entry ``k`` first: a `Batches` of the same shape whose entry 0 is ``k``."""
    return torch.cat([t[k:], t[:k]])


# -- the worker (one rank) --------------------------------------------------------------


def _worker(out: Path) -> None:
    import datetime
    import time

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import stepfuse as sf
    import stepfuse.torch as sft

    t0 = time.time()

    def mark(what):
        print(f"{time.time() - t0:7.1f} s  {what}", flush=True)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    res: dict = {}
    x, y = data()
    xs, ys = shard(x, rank), shard(y, rank)
    zeros = torch.zeros(STEPS)

    def save_error(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test reads the class and message
            res[name] = [type(e).__name__, str(e)]
        else:
            res[name] = None

    # A plain model, the loss plus a per-step constant `c` (an inf on one rank only makes
    # that rank's loss inf with finite gradients), over stacked minibatches.
    model = mlp()
    opt = sgd(model)
    seen: list = []
    fit = sft.fuse(
        lambda x, y, c: F.cross_entropy(model(x), y) + c,
        opt,
        steps=4,
        chunk=1,  # a step an iteration: the fewest collectives to compile
        model=model,
        clip_grad_norm=CLIP,
        callback=lambda step, loss: seen.append([step, loss]),
        every=2,
    )
    mark("start")
    t1 = fit(sf.Batches(xs, ys, zeros))
    mark("plain fit compiled and ran")
    t2 = fit(sf.Batches(rolled(xs, 4), rolled(ys, 4), zeros), steps=2)
    res["plain"] = {
        "params": [p.detach().clone() for p in model.parameters()],
        "loss": [t1.loss.tolist(), t2.loss.tolist()],
        "stop": [int(t1.stop), int(t2.stop)],
        "mode": fit.mode,
        "reason": fit.fallback_reason,
        "compiles": fit.compiles,
        "direct": fit.plan["direct_call"],
        "callback": seen,
    }
    before = [p.detach().clone() for p in model.parameters()]
    state = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    save_error("mismatch", lambda: fit(sf.Batches(xs, ys, zeros), steps=3 if rank == 0 else 2))
    res["mismatch_unchanged"] = all(
        torch.equal(a, p) for a, p in zip(before, model.parameters())
    ) and all(
        torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(state, model.parameters())
    )
    bad = xs[..., :3] if rank == 1 else xs  # a batch loss_fn cannot take, on rank 1 only
    save_error("one_rank_error", lambda: fit(sf.Batches(bad, ys, zeros), steps=2))
    c = zeros.clone()
    if rank == 1:
        c[1] = float("inf")
    t3 = fit(sf.Batches(rolled(xs, 2), rolled(ys, 2), c), steps=3)
    res["nonfinite"] = {
        "stop": int(t3.stop),
        "steps": t3.steps,
        "loss": t3.loss.tolist(),
        "params": [p.detach().clone() for p in model.parameters()],
        "fit.step": fit.step,
        "compiles": fit.compiles,
    }

    # The same steps in a plain DDP loop (loss.backward(); step()) on the same shards.
    ref = mlp()
    ddp_ref = DDP(ref)
    ropt = sgd(ref)
    losses = []
    for i in range(STEPS):
        ropt.zero_grad()
        loss = F.cross_entropy(ddp_ref(xs[i]), ys[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ropt.step()
        losses.append(loss.item())
    res["plain_ddp_loop"] = {
        "params": [p.detach().clone() for p in ref.parameters()],
        "loss": losses,
    }

    # A DDP model with BatchNorm (its buffers broadcast from rank 0 before each forward),
    # Adam, a shuffled resident shard per rank; two calls crossing epochs.
    xe, ye = xs.reshape(-1, 4)[: 2 * ROWS], ys.reshape(-1)[: 2 * ROWS]  # 2 steps an epoch
    net = bn_net()
    ddp = DDP(net)
    aopt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    epochs = sf.Epochs(xe, ye, batch_size=ROWS, shuffle=True, seed=3)
    dfit = sft.fuse(lambda x, y: F.cross_entropy(ddp(x), y), aopt, steps=3, chunk=2)
    mark("plain scenarios done")
    d1, d2 = dfit(epochs), dfit(epochs)
    mark("ddp fit compiled and ran")
    with ddp.no_sync():  # a plain loop there averages nothing: refused, before anything
        save_error("no_sync", lambda: dfit(epochs))
    res["ddp"] = {
        "params": [p.detach().clone() for p in net.parameters()],
        "buffers": [b.detach().clone() for b in net.buffers()],
        "loss": d1.loss.tolist() + d2.loss.tolist(),
        "mode": dfit.mode,
        "reason": dfit.fallback_reason,
        "compiles": dfit.compiles,
        "direct": dfit.plan["direct_call"],
        "step": dfit.step,
    }
    net2 = bn_net()
    ddp2 = DDP(net2)
    aopt2 = torch.optim.Adam(ddp2.parameters(), lr=0.01)
    losses = []
    for t in range(6):
        rows = torch.from_numpy(epochs.order(t // 2))[(t % 2) * ROWS : (t % 2 + 1) * ROWS]
        aopt2.zero_grad()
        loss = F.cross_entropy(ddp2(xe[rows]), ye[rows])
        loss.backward()
        aopt2.step()
        losses.append(loss.item())
    res["ddp_loop"] = {
        "params": [p.detach().clone() for p in net2.parameters()],
        "buffers": [b.detach().clone() for b in net2.buffers()],
        "loss": losses,
    }

    # tol over several ranks is refused before anything is built.
    tmodel = mlp()
    tfit = sft.fuse(lambda x, y: F.cross_entropy(tmodel(x), y), sgd(tmodel), steps=2, tol=1e-3)
    save_error("tol", lambda: tfit(xs[0], ys[0]))
    res["tol_compiles"] = tfit.compiles
    mark("done")
    torch.save(res, out / f"rank{rank}.pt")
    dist.destroy_process_group()


# -- the tests ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the two ranks saw (`_worker`)."""
    out = tmp_path_factory.mktemp("ranks")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(out)],
            env=_env(r, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-6000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _close(a, b, rtol=1e-6, atol=1e-7) -> None:
    for u, v in zip(a, b):
        torch.testing.assert_close(torch.as_tensor(u), torch.as_tensor(v), rtol=rtol, atol=atol)


def _whole_batch_loop(steps: int) -> tuple[list[torch.Tensor], list[list[float]]]:
    """One process, the whole minibatch of every step, the mean loss: the parameters and
    each rank's own loss (its shard's, at the same parameters) at every step."""
    import torch.nn.functional as F

    x, y = data()
    model = mlp()
    opt = sgd(model)
    local: list[list[float]] = [[] for _ in range(WORLD)]
    for i in range(steps):
        with torch.no_grad():
            for r in range(WORLD):
                xr, yr = shard(x, r)[i], shard(y, r)[i]
                local[r].append(F.cross_entropy(model(xr), yr).item())
        opt.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return [p.detach() for p in model.parameters()], local


def test_fused_on_every_rank(ranks):
    for r in ranks:
        assert r["plain"]["mode"] == "fused", r["plain"]["reason"]
        assert r["ddp"]["mode"] == "fused", r["ddp"]["reason"]
        assert r["plain"]["compiles"] == 1
        assert r["ddp"]["compiles"] == 1
        # calls after the first run the compiled code directly, collectives included
        assert r["plain"]["direct"] and r["ddp"]["direct"]


def test_parameters_identical_on_every_rank(ranks):
    for key in ("plain", "ddp", "nonfinite"):
        for a, b in zip(ranks[0][key]["params"], ranks[1][key]["params"]):
            assert torch.equal(a, b), key


def test_equals_one_process_over_the_whole_batch(ranks):
    params, local = _whole_batch_loop(STEPS)
    for r, got in enumerate(ranks):
        _close(got["plain"]["params"], params)
        assert got["plain"]["stop"] == [0, 0]
        # each rank's trace holds its own shard's loss, as a plain DDP loop prints it
        _close(got["plain"]["loss"][0] + got["plain"]["loss"][1], local[r])
    assert not torch.allclose(torch.tensor(local[0]), torch.tensor(local[1]))


def test_equals_a_plain_ddp_loop(ranks):
    for got in ranks:
        _close(got["plain"]["params"], got["plain_ddp_loop"]["params"])
        _close(got["plain"]["loss"][0] + got["plain"]["loss"][1], got["plain_ddp_loop"]["loss"])
        # BatchNorm: rank 0's statistics broadcast before each forward, then this rank's
        # batch; Adam; a shuffled shard over three epochs
        _close(got["ddp"]["params"], got["ddp_loop"]["params"])
        _close(got["ddp"]["buffers"], got["ddp_loop"]["buffers"])
        _close(got["ddp"]["loss"], got["ddp_loop"]["loss"])
        assert got["ddp"]["step"] == 6
    # each rank's buffers end with its own last batch's statistics, as in the DDP loop
    assert not torch.equal(ranks[0]["ddp"]["buffers"][0], ranks[1]["ddp"]["buffers"][0])


def test_callbacks_fire_on_every_rank_with_its_own_loss(ranks):
    for got in ranks:
        steps = [s for s, _ in got["plain"]["callback"]]
        assert steps == [2, 4, 6]
        losses = got["plain"]["loss"][0] + got["plain"]["loss"][1]
        for s, loss in got["plain"]["callback"]:
            assert loss == pytest.approx(losses[s - 1], rel=1e-6)


def test_mismatched_steps_raise_on_every_rank_and_change_nothing(ranks):
    for got in ranks:
        cls, msg = got["mismatch"]
        assert cls == "ValueError"
        assert "`steps` differs between the ranks" in msg
        assert "rank 0: 3, rank 1: 2" in msg
        assert got["mismatch_unchanged"]


def test_a_call_inside_ddps_no_sync_is_refused_and_changes_nothing(ranks):
    for got in ranks:
        cls, msg = got["no_sync"]
        assert cls == "ValueError" and "inside DistributedDataParallel.no_sync()" in msg
        assert got["ddp"]["step"] == 6  # (read after the refused call)


def test_an_error_on_one_rank_reaches_the_others(ranks):
    cls, msg = ranks[1]["one_rank_error"]
    assert cls == "BatchError"
    cls0, msg0 = ranks[0]["one_rank_error"]
    assert cls0 == "RankError"
    assert "rank 1" in msg0 and "BatchError" in msg0


def test_a_nonfinite_loss_on_one_rank_stops_every_rank_at_that_step(ranks):
    import stepfuse as sf

    for r, got in enumerate(ranks):
        nf = got["nonfinite"]
        assert nf["stop"] == int(sf.Stop.NONFINITE)
        assert nf["steps"] == 1
        assert nf["fit.step"] == STEPS + 1
        assert nf["compiles"] == 1  # the mismatched and failed calls built nothing
        # rank 1's own loss was inf at that step; rank 0's was finite
        assert (nf["loss"][1] == float("inf")) == (r == 1)


def test_tol_is_refused_over_several_ranks(ranks):
    for got in ranks:
        cls, msg = got["tol"]
        assert cls == "ValueError" and msg.startswith("`tol` must be None")
        assert got["tol_compiles"] == 0


# -- torchrun: the guide's example ------------------------------------------------------------


def _guide_example() -> str:
    text = (ROOT / "docs" / "guides" / "torch.md").read_text()
    section = text.split("## Several devices", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


@pytest.mark.slow  # two more processes compiling (about a minute of CI)
def test_the_guide_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_guide_example())
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(WORLD),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(script),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-6000:]
    # the ranks share torchrun's stdout: their lines may run into each other
    lines = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", got.stdout)]
    assert sorted(ln["rank"] for ln in lines) == list(range(WORLD))
    assert all(ln["mode"] == "fused" and ln["steps"] == 100 for ln in lines)
    assert lines[0]["weight"] == lines[1]["weight"]


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(Path(sys.argv[2]))
