"""The math reward: +1 for a correct final answer, -1 otherwise (STAPO paper §2; docs/rewards.md).

Cheapest first: only items undecided in-process go to the sympy workers, a batch's concurrently.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

from stapo.rewards.compare import cheap_verdict
from stapo.rewards.dapo import dapo_verify
from stapo.rewards.extract import DEFAULT_TAIL_CHARS, extract_answer
from stapo.rewards.normalize import normalize_answer
from stapo.rewards.pool import WorkerPool

MODES = ("math", "dapo", "dapo_boxed")
logger = logging.getLogger("stapo.rewards")
CORRECT, WRONG = 1.0, -1.0


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown reward mode {mode!r}; valid modes: {', '.join(MODES)}")
    return mode


def ground_truth_answer(ground_truth: object) -> Optional[str]:
    """The reference answer: a bare answer, or the last ``\\boxed{}`` of a reference solution."""
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        return None
    if "\\boxed" in ground_truth or "\\fbox" in ground_truth:
        return extract_answer(ground_truth, tail_chars=None)
    return ground_truth


class MathVerifier:
    """Batch math verifier; a symbolic item runs in a sympy worker and scores -1 past ``timeout_s``; only the last
    ``tail_chars`` characters are searched (the ``dapo`` modes keep DAPO's 300). Thread-safe (docs/rewards.md)."""

    def __init__(self, mode: str = "math", timeout_s: float = 5.0, memory_mb: int = 1024,
                 num_workers: Optional[int] = None, tail_chars: Optional[int] = DEFAULT_TAIL_CHARS):
        self.mode = check_mode(mode)
        if tail_chars is not None and tail_chars <= 0:
            raise ValueError(f"tail_chars must be positive, got {tail_chars}")
        self.tail_chars = tail_chars
        self.pool = WorkerPool(num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb)
        self.failures = 0  # symbolic items of the last call that timed out or crashed (scored -1)

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the sympy workers (also done automatically at interpreter exit)."""
        self.pool.close()

    def verdicts(self, responses: Sequence[object], answers: Sequence[object]) -> list[bool]:
        """Correctness of each response against its ground-truth answer."""
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} ground-truth answers")
        if self.mode != "math":  # dapo / dapo_boxed: exact reproduction, no workers
            fallback = self.mode == "dapo_boxed"
            return [dapo_verify(r, a, boxed_fallback=fallback) for r, a in zip(responses, answers)]
        preds = [self._extract(r) for r in responses]
        return self.equivalent(preds, [ground_truth_answer(a) for a in answers])

    def _extract(self, response: object) -> Optional[str]:
        try:
            return extract_answer(response, tail_chars=self.tail_chars)
        except Exception as exc:  # noqa: BLE001 - see equivalent()
            logger.warning("reward: %s while extracting from a response; scored -1", type(exc).__name__)
            return None

    def equivalent(self, preds: Sequence[Optional[str]], gts: Sequence[Optional[str]]) -> list[bool]:
        """Math-mode equivalence of already extracted answers (None never matches)."""
        if len(preds) != len(gts):
            raise ValueError(f"got {len(preds)} predicted answers but {len(gts)} ground-truth answers")
        verdicts: list[Optional[bool]] = []
        symbolic: list[tuple[str, str]] = []
        for pred, gt in zip(preds, gts):
            try:
                pred_n, gt_n = normalize_answer(pred), normalize_answer(gt)
                verdict = cheap_verdict(pred_n, gt_n)
            except Exception as exc:  # noqa: BLE001 - one odd string must not stop training
                logger.warning("reward: %s while comparing %.80r with %.80r; scored -1",
                               type(exc).__name__, pred, gt)
                verdict = False
            if verdict is None:
                symbolic.append((pred_n, gt_n))
            verdicts.append(verdict)
        self.failures = 0
        if symbolic:
            values, errors = self.pool.run_tasks([list(pair) for pair in symbolic], default=False)
            self.failures = len(errors)
            resolved = iter(values)
            verdicts = [bool(next(resolved)) if v is None else v for v in verdicts]
        return [bool(v) for v in verdicts]

    def score(self, responses: Sequence[object], answers: Sequence[object],
              row_fields: Optional[Sequence[dict]] = None) -> list[float]:
        """+1.0 / -1.0 reward per response (the trainer's per-step call). ``row_fields`` (extra
        dataset columns) is accepted for the common scorer interface (``modes.Scorer``) and unused."""
        return [CORRECT if ok else WRONG for ok in self.verdicts(responses, answers)]

    __call__ = score


_DEFAULTS: dict[str, MathVerifier] = {}
_DEFAULTS_LOCK = threading.Lock()


def default_verifier(mode: str = "math") -> MathVerifier:
    """The shared verifier behind ``math_reward``/``verify`` (created on first use)."""
    check_mode(mode)
    with _DEFAULTS_LOCK:
        if mode not in _DEFAULTS:
            _DEFAULTS[mode] = MathVerifier(mode=mode)
        return _DEFAULTS[mode]


def verify(response: str, ground_truth: str, mode: str = "math") -> bool:
    """True if ``response``'s final answer equals ``ground_truth``."""
    return default_verifier(mode).verdicts([response], [ground_truth])[0]


def math_reward(response: str, ground_truth: str, mode: str = "math") -> float:
    """+1.0 if ``response``'s final answer equals ``ground_truth``, else -1.0 (paper §2)."""
    return CORRECT if verify(response, ground_truth, mode) else WRONG
