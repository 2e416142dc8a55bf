"""One short, prepared check of stepfuse.torch's CUDA-graph path, for a session with a CUDA GPU.

Checks, on the seed perceptron (SGD lr 0.01) and the benchmark MLP 2-64-64-2 on 1,024
points (SGD with momentum, and Adam):

1. equivalence: the fused fit (CUDA graph of one chunk, replayed) gives the losses and
   parameters of ``opt.zero_grad(); loss.backward(); opt.step()`` on CUDA within 1e-5
   (relative), over calls of 3, 1 and 4 steps, with one capture (``fit.compiles == 1``);
2. speed: us/step of one fused call of ``--steps`` steps vs the eager loop, and the ratio
   (target >= 20x on the seed problem, where per-step launch overhead dominates).

Prints a table and a JSON summary (also written to ``--json``); exits 1 if any check
fails, 0 when all pass. Without CUDA it prints "no CUDA" and exits 0 (or 2 with
``--require-cuda``). Expected runtime on one GPU: well under a minute.

Run:  python benchmarks/gpu_check.py [--steps 2000] [--json gpu_check.json] [--require-cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

TARGET_RATIO = 20.0
RTOL, ATOL = 1e-5, 1e-6
CALLS = (3, 1, 4)


def build(size, opt_name, device):
    from stepfuse.bench.problems import problem
    from stepfuse.bench.torch import MLP

    layers, xn, yn = problem(size)
    model = MLP(layers).to(device)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    elif opt_name == "sgd_momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.001)
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


def timed(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def check(size, opt_name, steps, device="cuda"):
    import stepfuse.torch as sf

    out = {"problem": size, "optimizer": opt_name, "failures": []}
    model, opt, x, y = build(size, opt_name, device)
    fit = sf.fuse(lambda a, b: F.cross_entropy(model(a), b), opt, steps=max(steps, 4), chunk=4)
    out["mode"], out["fallback_reason"] = fit.mode, fit.fallback_reason
    if fit.mode != "fused":
        out["failures"].append(f"fell back to stepwise: {fit.fallback_reason}")
    losses = np.concatenate([fit(x, y, steps=n).loss for n in CALLS])
    ref_model, ref_opt, _, _ = build(size, opt_name, device)
    ref = eager_steps(ref_model, ref_opt, x, y, sum(CALLS))
    out["max_loss_rel_diff"] = float(np.max(np.abs(losses - ref) / np.maximum(np.abs(ref), 1e-30)))
    out["max_param_rel_diff"] = max(
        float(((p - q).abs() / q.abs().clamp_min(1e-30)).max())
        for p, q in zip(model.parameters(), ref_model.parameters()))
    try:
        np.testing.assert_allclose(losses, ref, rtol=RTOL, atol=ATOL)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        out["failures"].append(f"not equivalent to loss.backward(); opt.step(): {str(e).splitlines()[0]}")
    out["compiles"] = fit.compiles
    if fit.compiles != 1:
        out["failures"].append(f"{fit.compiles} captures, expected 1")
    # speed: one fused call of `steps` vs the eager loop (same problem, continuing training)
    t_fused = timed(lambda: fit(x, y, steps=steps))
    eager_n = min(steps, 1000)
    t_eager = timed(lambda: eager_steps(ref_model, ref_opt, x, y, eager_n))
    out["fused_us_per_step"] = 1e6 * t_fused / steps
    out["eager_us_per_step"] = 1e6 * t_eager / eager_n
    out["ratio"] = out["eager_us_per_step"] / out["fused_us_per_step"]
    out["compiles_after_timing"] = fit.compiles
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps of the timed fused call")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--require-cuda", action="store_true", help="exit 2 (not 0) when there is no CUDA")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        msg = (f"no CUDA: torch {torch.__version__} sees no CUDA device "
               f"(torch.version.cuda={torch.version.cuda}); the CUDA-graph checks were not run.")
        print(msg)
        summary = {"cuda": False, "message": msg, "ok": None}
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return 2 if args.require_cuda else 0

    results = [check("seed", "sgd", args.steps), check("mlp", "sgd_momentum", args.steps),
               check("mlp", "adam", args.steps)]
    seed = results[0]
    if seed["ratio"] < TARGET_RATIO:
        seed["failures"].append(f"seed speed-up {seed['ratio']:.1f}x < target {TARGET_RATIO:.0f}x")
    for r in results:
        print(f"{r['problem']:5s} {r['optimizer']:13s} mode={r['mode']} compiles={r['compiles']} "
              f"loss rel diff {r['max_loss_rel_diff']:.1e} param rel diff {r['max_param_rel_diff']:.1e}  "
              f"fused {r['fused_us_per_step']:.2f} us/step  eager {r['eager_us_per_step']:.2f} us/step  "
              f"ratio {r['ratio']:.1f}x  {'OK' if not r['failures'] else 'FAILED: ' + '; '.join(r['failures'])}")
    ok = all(not r["failures"] for r in results)
    summary = {"cuda": True, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "steps": args.steps, "target_ratio": TARGET_RATIO, "ok": ok, "results": results}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
