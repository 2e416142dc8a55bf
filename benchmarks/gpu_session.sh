#!/usr/bin/env bash
# Everything stepfuse checks on a CUDA GPU, in one command (GPU machines are lent briefly):
# the CUDA tests of tests/test_torch.py, then benchmarks/gpu_check.py (equivalence, speed
# against eager, build time). Logs and the JSON summary go to $OUT (default /tmp/stepfuse_gpu).
# Runs from the repository root with the machine's own python3 and torch; nothing installed.
set -u
OUT=${OUT:-/tmp/stepfuse_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
timeout "${TEST_S:-270}" python3 -m pytest -q -p no:cacheprovider tests/test_torch.py -k "cuda or graph_path" 2>&1 \
    | tee "$OUT/pytest.log" | tail -40
timeout "${CHECK_S:-250}" python3 benchmarks/gpu_check.py --require-cuda --json "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.log"
