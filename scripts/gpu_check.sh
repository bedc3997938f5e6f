#!/usr/bin/env bash
# The one prepared run for a machine with an NVIDIA GPU (issue 12): the CUDA tests, then the
# forward pass of the default architecture (SmolLM2-135M's shapes) with random weights drawn
# on the machine (the real GGUF file need not be there), decode with CUDA graphs off and on.
# Needs only the repository and its venv; no network. Prints everything; each JSON line is one
# configuration's figures for docs/benchmarks.md ("graph_*" fields: the same steps replayed
# from a CUDA graph; "graph_tokens_equal_eager" must be true).
# Usage: scripts/gpu_check.sh [python]   (default: .venv/bin/python, else python3)
# About 3 minutes on an H100-class GPU, most of it the tests and the first CUDA context.
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
  timeout 300 "$PY" -m benchmarks.engine.bench_random_weights --device cuda --batches 1,16,64 \
    --steps 32 --cuda-graphs $args || status=1
done
exit $status
