"""Rollout engines and the drivers over them: prompts (token ids) -> `Rollout` (docs/rollout.md).

May import: ``stapo.serve``, ``stapo.sync``, ``stapo.distributed`` and the rest below them (docs/index.md,
"Layout"); only ``vllm_engine`` and ``stapo.serve.worker_extension`` import vllm, lazily.
"""

from stapo.rollout.batch import Rollout
from stapo.rollout.drivers import Generation, generate
from stapo.rollout.engine import RolloutEngine, Segment, SegmentRequest
from stapo.rollout.episodes import ToolEpisodes
from stapo.rollout.hf_engine import HFEngine
from stapo.rollout.registry import EngineOptions, build_engine, register_engine
from stapo.rollout.sampling import SamplingParams
from stapo.rollout.vllm_engine import VLLMEngine

__all__ = ["EngineOptions", "Generation", "HFEngine", "Rollout", "RolloutEngine", "SamplingParams", "Segment",
           "SegmentRequest", "ToolEpisodes", "VLLMEngine", "build_engine", "generate", "register_engine"]
