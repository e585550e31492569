"""bench/head_gemm.py compares two CUDA GEMMs: on a machine without CUDA it says so and exits 2, not 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU lane runs the bench itself")
def test_without_cuda_the_bench_refuses_with_its_reason():
    proc = subprocess.run([sys.executable, "bench/head_gemm.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "needs a CUDA GPU: on CPU both paths are the fp32 GEMM" in proc.stderr
