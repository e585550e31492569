#!/usr/bin/env bash
# One GPU window: install check, bench/gpu_step.py at the Qwen3-0.6B and 1.7B shapes (real vocabulary, sdpa vs
# auto, ZeRO-1 and 3), pytest -m gpu, a 3-step colocated `stapo train` with vLLM; each part under its own time
# budget (<= 9 minutes in all), results as one Markdown table + JSON under $OUT (docs/gpu.md, "One GPU window").
#   bash bench/gpu_window.sh --plan                 # the parts and their budgets (runs nothing; any machine)
#   bash bench/gpu_window.sh                        # on the GPU machine, from the checkout
#   bash bench/gpu_window.sh --budget train=200 --skip install
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/_gpu_window.py "$@"
