#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU: the CUDA tests, then the engine's forward pass on
# the default architecture with random weights (the real GGUF file need not be there).
# Prints everything; the JSON lines are the figures for docs/BENCHMARKS.md.
# Usage: scripts/gpu_check.sh [python]   (default: .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
"$PY" -m pytest -q tests/test_cuda.py -rs
status=$?
for args in "--dtype bfloat16 --quantization none" "--dtype bfloat16 --quantization int8" \
            "--dtype float16 --quantization int4" "--dtype float32 --quantization none"; do
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_random_weights.py --device cuda --batches 1,16,64 --steps 32 $args
done
exit $status
