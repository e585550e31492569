"""Reward scorers: one interface for the math verifier and user reward functions (docs/grpo_options.md).
``FunctionScorer`` runs in the verifier's killable workers, so a hung function costs at most ``timeout_s``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Optional, Protocol

from stapo.rewards.pool import WorkerPool
from stapo.rewards.user_function import call_function, parse_function_spec

__all__ = ["CallableScorer", "FunctionScorer", "Scorer"]

logger = logging.getLogger("stapo.rewards")


class Scorer(Protocol):
    failures: int

    def score(self, responses: Sequence[object], ground_truths: Sequence[object],
              row_fields: Optional[Sequence[dict]] = None) -> list[float]: ...

    def close(self) -> None: ...


def _check_batch(responses, ground_truths, row_fields) -> list[dict]:
    if len(responses) != len(ground_truths):
        raise ValueError(f"got {len(responses)} responses but {len(ground_truths)} ground-truth answers")
    if row_fields is None:
        return [{} for _ in responses]
    if len(row_fields) != len(responses):
        raise ValueError(f"got {len(responses)} responses but {len(row_fields)} row_fields")
    return [dict(f) for f in row_fields]


def _report(name: str, failures: dict[int, str], total: int, failure_value: float) -> None:
    if failures:
        first = failures[min(failures)]
        logger.warning("reward function %s failed on %d of %d items (scored %g); first error: %s",
                       name, len(failures), total, failure_value, first)


class FunctionScorer:
    """``reward.function`` in killable workers: ``timeout_s`` per item, or per call when ``batched``. Loaded
    when built, so a wrong name fails at once with a ValueError."""

    def __init__(self, spec: str, *, batched: bool = False, timeout_s: float = 5.0, failure_value: float = -1.0,
                 num_workers: Optional[int] = None, memory_mb: int = 0, startup_timeout_s: float = 120.0):
        parse_function_spec(spec)
        if not math.isfinite(failure_value):
            raise ValueError(f"reward.failure_value must be finite, got {failure_value}")
        self.spec, self.batched, self.failure_value, self.failures = spec, batched, float(failure_value), 0
        self.pool = WorkerPool(num_workers=1 if batched else num_workers, timeout_s=timeout_s, memory_mb=memory_mb,
                               startup_timeout_s=startup_timeout_s, function=spec, batched=batched)
        self.pool.warmup()
        if self.pool.startup_error is not None or not self.pool.pids():
            self.pool.close()
            why = self.pool.startup_error or f"no worker started within {startup_timeout_s:g} s"
            raise ValueError(f"reward.function {spec!r} could not be loaded: {why}")

    def score(self, responses: Sequence[object], ground_truths: Sequence[object],
              row_fields: Optional[Sequence[dict]] = None) -> list[float]:
        fields = _check_batch(responses, ground_truths, row_fields)
        n, bad = len(responses), self.failure_value
        if self.batched:
            values, errors = self.pool.run_tasks([[list(responses), list(ground_truths), fields]], default=None)
            errors = {i: errors[0] for i in range(n)} if errors else {}
            rewards = [bad] * n if errors else [float(v) for v in values[0]] if n else []
        else:
            payloads = [[r, g, f] for r, g, f in zip(responses, ground_truths, fields)]
            values, errors = self.pool.run_tasks(payloads, default=None)
            rewards = [bad if i in errors else float(v) for i, v in enumerate(values)]
        self.failures = len(errors)
        _report(self.spec, errors, n, bad)
        return rewards

    __call__ = score

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "FunctionScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CallableScorer:
    """An in-process ``fn(response, ground_truth, **fields) -> float``; a raising call scores
    ``failure_value`` (no time limit: use ``reward.function`` for code that may hang)."""

    def __init__(self, fn: Callable[..., float], failure_value: float = -1.0):
        self.fn, self.failure_value, self.failures = fn, float(failure_value), 0
        self.name = getattr(fn, "__qualname__", repr(fn))

    def score(self, responses: Sequence[object], ground_truths: Sequence[object],
              row_fields: Optional[Sequence[dict]] = None) -> list[float]:
        fields = _check_batch(responses, ground_truths, row_fields)
        rewards, errors = [], {}
        for i, (r, g, f) in enumerate(zip(responses, ground_truths, fields)):
            try:
                rewards.append(call_function(self.fn, False, [r, g, f]))
            except Exception as exc:  # noqa: BLE001 - one bad item must not stop training
                errors[i] = f"{type(exc).__name__}: {exc}"
                rewards.append(self.failure_value)
        self.failures = len(errors)
        _report(self.name, errors, len(rewards), self.failure_value)
        return rewards

    __call__ = score

    def close(self) -> None:
        pass
