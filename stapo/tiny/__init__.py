"""Tiny-model toolkit: an offline Qwen3-architecture model, tokenizer and arithmetic task.

Used by the README demo (``stapo train`` with no arguments) and by tests: everything is built
locally in seconds on a CPU, deterministically, and cached under ``$STAPO_CACHE`` (else
``~/.cache/stapo``)::

    from stapo.tiny import build_tiny_model, arithmetic_problems, warm_start
    model_dir = warm_start(build_tiny_model())

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
