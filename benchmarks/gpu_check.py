"""One short, prepared check of stepfuse.torch's CUDA-graph path, for a session with a CUDA GPU.

On the seed perceptron (SGD lr 0.01) and the benchmark MLP 2-64-64-2 on 1,024 points
(SGD with momentum, and Adam):

1. equivalence: the fused fit (a compiled chunk of steps captured in CUDA graphs and
   replayed) gives the losses, parameters and optimizer state of
   ``opt.zero_grad(); loss.backward(); opt.step()`` on the same device within 1e-5
   (relative), over calls of 3, 1 and 4 steps, with one compile (``fit.compiles == 1``)
   and without falling back to eager kernels or to the stepwise mode;
2. speed: us/step of fused calls of N = 1,000 and 10,000 steps against the eager loop
   (target: at least 20x on the seed problem), and the build time (compile + capture);
3. variants side by side: ``chunk=8`` on the seed, and the eager chunk captured as it
   is (what runs where inductor cannot compile the model) on the seed and with Adam.

Prints a table and a JSON summary (also written to ``--json``); exits 1 if a check
fails, 0 when all pass. Without CUDA it prints "no CUDA" and exits 0 (2 with
``--require-cuda``). ``--device cpu`` runs the same script on the CPU's compiled path,
to try the script itself on a machine without a GPU (no target applies there).

Run:  python benchmarks/gpu_check.py [--json gpu_check.json] [--require-cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

TARGET_RATIO = 20.0
RTOL, ATOL = 1e-5, 1e-6
CALLS = (3, 1, 4)
EAGER_STEPS = 300
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.001),
}


def build(size, opt_name, device):
    from stepfuse.bench.problems import problem
    from stepfuse.bench.torch import MLP

    layers, xn, yn = problem(size)
    model = MLP(layers).to(device)
    opt = OPTIMIZERS[opt_name](model.parameters())
    x, y = torch.from_numpy(xn).to(device), torch.from_numpy(yn).long().to(device)
    return model, opt, x, y


def eager_steps(model, opt, x, y, n):
    losses = []
    for _ in range(n):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).cpu().numpy() if losses else np.zeros(0)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30))) if a.size else 0.0


def check(size, opt_name, device, steps=(1000, 10000), chunk=None, eager_chunk=False):
    import stepfuse.torch as sf

    name = (
        f"{size}/{opt_name}"
        + (f"/chunk={chunk}" if chunk else "")
        + ("/eager-capture" if eager_chunk else "")
    )
    out = {"name": name, "failures": []}
    model, opt, x, y = build(size, opt_name, device)
    kw = {"chunk": chunk} if chunk else {}
    fit = sf.fuse(lambda a, b: F.cross_entropy(model(a), b), opt, steps=max(steps), **kw)
    patch = contextlib.nullcontext()
    if eager_chunk:

        def no_compile(self, fn, kind, inductor_options):
            raise RuntimeError("eager capture asked for")

        patch = mock.patch.object(sf.FusedFit, "_compile", no_compile)
    sync(device)
    t0 = time.perf_counter()
    with patch:
        first = fit(x, y, steps=CALLS[0])
    sync(device)
    out["build_s"] = time.perf_counter() - t0
    losses = np.concatenate([first.loss] + [fit(x, y, steps=n).loss for n in CALLS[1:]])
    out["mode"], out["fallback_reason"] = fit.mode, fit.fallback_reason
    program = fit._program
    out["fused_kernels"] = getattr(program, "fused_kernels", None)
    out["compile_error"] = getattr(program, "compile_error", None)
    if fit.mode != "fused":
        out["failures"].append(f"fell back to stepwise: {fit.fallback_reason}")
    elif device == "cuda" and out["fused_kernels"] != (not eager_chunk):
        out["failures"].append(f"fused_kernels={out['fused_kernels']} ({out['compile_error']})")
    ref_model, ref_opt, _, _ = build(size, opt_name, device)
    ref = eager_steps(ref_model, ref_opt, x, y, sum(CALLS))
    out["loss_rel_diff"] = rel(losses, ref)
    out["param_rel_diff"] = max(
        rel(p.detach().cpu(), q.detach().cpu())
        for p, q in zip(model.parameters(), ref_model.parameters())
    )
    states = [
        (opt.state[p], ref_opt.state[q]) for p, q in zip(model.parameters(), ref_model.parameters())
    ]
    out["state_rel_diff"] = max(
        [rel(a[k].cpu(), b[k].cpu()) for a, b in states for k in b] or [0.0]
    )
    try:
        np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
        for a, b in states:
            for k in b:
                torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        out["failures"].append(
            f"not equivalent to loss.backward(); opt.step(): {str(e).splitlines()[0]}"
        )
    if fit.compiles != 1:
        out["failures"].append(f"{fit.compiles} compiles, expected 1")
    for n in steps:  # continuing the training
        out[f"fused_us_{n}"] = 1e6 * timed(lambda: fit(x, y, steps=n), device) / n
    out["eager_us"] = (
        1e6
        * timed(lambda: eager_steps(ref_model, ref_opt, x, y, EAGER_STEPS), device)
        / EAGER_STEPS
    )
    out["ratio"] = out["eager_us"] / out[f"fused_us_{max(steps)}"]
    out["compiles"] = fit.compiles
    if fit.compiles != 1:
        out["failures"].append(f"{fit.compiles} compiles after timing, expected 1")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument(
        "--require-cuda", action="store_true", help="exit 2 (not 0) when there is no CUDA"
    )
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: try this script on the CPU's compiled path (no GPU checks)",
    )
    ap.add_argument(
        "--steps", type=int, nargs="+", default=[1000, 10000], help="N of the timed fused calls"
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        msg = (
            f"no CUDA: torch {torch.__version__} sees no CUDA device "
            f"(torch.version.cuda={torch.version.cuda}); the CUDA-graph checks were not run."
        )
        print(msg)
        summary = {"cuda": False, "message": msg, "ok": None}
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return 2 if args.require_cuda else 0

    runs = [
        ("seed", "sgd", {}),
        ("mlp", "sgd_momentum", {}),
        ("mlp", "adam", {}),
        ("seed", "sgd", {"chunk": 8}),
    ]
    if args.device == "cuda":  # the eager capture exists on CUDA only
        runs += [("seed", "sgd", {"eager_chunk": True}), ("mlp", "adam", {"eager_chunk": True})]
    results = []
    for size, opt_name, kw in runs:
        try:
            r = check(size, opt_name, args.device, steps=args.steps, **kw)
        except Exception as e:  # noqa: BLE001 - report it and go on with the other checks
            r = {"name": f"{size}/{opt_name}/{kw}", "failures": [f"{type(e).__name__}: {e}"]}
        results.append(r)
        print(json.dumps(r), flush=True)
    seed = results[0]
    if args.device == "cuda" and seed.get("ratio", 0) < TARGET_RATIO:
        seed["failures"].append(
            f"seed speed-up {seed.get('ratio', 0):.1f}x < target {TARGET_RATIO:.0f}x"
        )
    n1, n2 = min(args.steps), max(args.steps)
    print(
        f"\n{'check':28s} {'build s':>8s} {'N=' + str(n1):>9s} {'N=' + str(n2):>9s} {'eager':>8s} "
        f"{'ratio':>7s}  loss/param/state rel diff   (us/step)"
    )
    for r in results:
        if "ratio" not in r:
            print(f"{r['name']:28s} FAILED: {'; '.join(r['failures'])}")
            continue
        print(
            f"{r['name']:28s} {r['build_s']:8.1f} {r[f'fused_us_{n1}']:9.2f} {r[f'fused_us_{n2}']:9.2f} "
            f"{r['eager_us']:8.1f} {r['ratio']:6.1f}x  {r['loss_rel_diff']:.1e} {r['param_rel_diff']:.1e} "
            f"{r['state_rel_diff']:.1e}  {'OK' if not r['failures'] else 'FAILED: ' + '; '.join(r['failures'])}"
        )
    ok = all(not r["failures"] for r in results)
    summary = {
        "cuda": args.device == "cuda",
        "torch": torch.__version__,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "target_ratio": TARGET_RATIO,
        "ok": ok,
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
