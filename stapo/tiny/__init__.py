"""Tiny-model toolkit: an offline Qwen3-architecture model, tokenizer and arithmetic task (docs/demo.md).

Built locally in seconds on a CPU, deterministically, and cached under ``$STAPO_CACHE`` (else ``~/.cache/stapo``).

May import: ``stapo.data`` and the rest below it (docs/index.md, "Layout").
"""

from stapo.tiny.model import TinySpec, build_tiny_model
from stapo.tiny.task import CHAT_INSTRUCTION, ArithmeticProblem, arithmetic_problems
from stapo.tiny.tokenizer import build_tiny_tokenizer
from stapo.tiny.warmstart import warm_start

__all__ = [
    "CHAT_INSTRUCTION",
    "ArithmeticProblem",
    "TinySpec",
    "arithmetic_problems",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "warm_start",
]
