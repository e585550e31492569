"""bench/vllm_generate.py: without a GPU or vLLM it says why and exits 2 (it never fakes a number)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_exits_with_a_clear_message_without_gpu_or_vllm():
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        pytest.skip("a GPU and vLLM are here: the benchmark would run for real")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_generate.py")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "needs a CUDA GPU and vLLM" in proc.stderr and "nothing measured" in proc.stderr
