"""Rollout engines: prompts (token ids) -> `Rollout` (docs/rollout.md).

    from stapo.rollout import HFEngine, VLLMEngine, Rollout, SamplingParams

`HFEngine` runs a transformers model (CPU or GPU); `VLLMEngine` runs vLLM colocated in the training
process and imports vllm only when constructed. Both report the log-probability of each sampled
token under the processed sampling distribution (temperature, top-k, top-p).

May import: ``stapo.losses``, ``stapo.registry`` and the rest below them (docs/index.md, "Layout");
only this folder imports vllm, lazily.
"""

from stapo.rollout.batch import Rollout
from stapo.rollout.engine import RolloutEngine
from stapo.rollout.hf_engine import HFEngine
from stapo.rollout.registry import EngineOptions, available_engines, build_engine, register_engine
from stapo.rollout.sampling import SamplingParams
from stapo.rollout.vllm_engine import VLLMEngine

__all__ = ["EngineOptions", "HFEngine", "Rollout", "RolloutEngine", "SamplingParams", "VLLMEngine",
           "available_engines", "build_engine", "register_engine"]
