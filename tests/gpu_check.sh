#!/usr/bin/env bash
# The checks that need a CUDA GPU, on a machine with torch and pytest and nothing else installed
# (no venv, no editable install): every steady-state path under torch's sync debug mode, its bits
# against the CPU, and the demo on CUDA (tests/test_gpu_syncs.py, tests/test_gpu_demo.py).
# Writes the environment and the whole output to a log: gpu-check.log, or the path given.
# Usage, from anywhere: tests/gpu_check.sh [log]    (PYTHON=... to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
log="${1:-gpu-check.log}"
{
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$python" - <<'PY' || { echo "== no CUDA device: nothing to check"; exit 2; }
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
print(f"CUDA available: {torch.cuda.is_available()}, {torch.cuda.device_count()} device(s)")
sys.exit(0 if torch.cuda.is_available() else 1)
PY
    PYTHONPATH=src timeout 600 "$python" -m pytest -v -rA -p no:cacheprovider \
        tests/test_gpu_syncs.py tests/test_gpu_demo.py
    status=$?
    echo "== pytest exit status $status"
    exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
