"""Accuracy metrics of sampled evaluation: avg@N and unbiased pass@k (pure functions; docs/evaluation.md).

STAPO §5.1 reports avg@N; pass@k is Chen et al. (2021)'s unbiased 1 - C(n-c, k) / C(n, k), averaged over
problems, so pass@1 equals avg@N exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["avg_at_n", "correct_counts", "mean_pass_at_k", "pass_at_k", "pass_at_k_per_problem"]


def _as_matrix(correct) -> np.ndarray:
    matrix = np.asarray(correct, dtype=bool)
    if matrix.ndim != 2 or matrix.shape[1] < 1:
        raise ValueError(f"correct must be a (problems, samples) matrix with >= 1 sample, got shape {matrix.shape}")
    return matrix


def correct_counts(correct) -> np.ndarray:
    """`correct (P, N)` bool -> `(P,)` int: correct samples per problem."""
    return _as_matrix(correct).sum(axis=1)


def avg_at_n(correct) -> float:
    """Mean correctness over all samples, `correct (P, N)` bool -> float (NaN, not 0, for P = 0)."""
    matrix = _as_matrix(correct)
    return float(matrix.mean()) if matrix.size else float("nan")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem, 1 - C(n-c, k) / C(n, k) (:func:`pass_at_k_per_problem`)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return float(pass_at_k_per_problem([c], n, k)[0])


def pass_at_k_per_problem(counts: Sequence[int] | np.ndarray, n: int, k: int) -> np.ndarray:
    """`counts (P,)` correct samples per problem (of `n` each) -> `(P,)` float64 pass@k."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 1:
        raise ValueError(f"counts must be 1-D (one count per problem), got shape {counts.shape}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if ((counts < 0) | (counts > n)).any():
        raise ValueError(f"correct counts must lie in [0, {n}], got {counts.min()}..{counts.max()}")
    # 1 - prod_{i=n-c+1..n} (1 - k/i): factor (1 - k/i) for i in 1..n, kept where i > n - c.
    i = np.arange(1, n + 1, dtype=np.float64)  # (n,)
    factors = np.where(i[None, :] > (n - counts)[:, None], 1.0 - k / i[None, :], 1.0)  # (P, n)
    out = 1.0 - factors.prod(axis=1)  # (P,)
    return np.where(n - counts < k, 1.0, out)


def mean_pass_at_k(correct, k: int) -> float:
    """pass@k averaged over problems, from `correct (P, N)` bool (NaN for P = 0)."""
    matrix = _as_matrix(correct)
    if not matrix.shape[0]:
        return float("nan")
    return float(pass_at_k_per_problem(correct_counts(matrix), matrix.shape[1], k).mean())
