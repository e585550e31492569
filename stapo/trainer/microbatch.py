"""Micro-batch plans: rows or a balanced token budget (docs/distributed.md, "Throughput"). Under ZeRO-3 every
rank must run the SAME number of micro-batches (each forward all-gathers the layers): the maximum over ranks.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence

import torch

from stapo.distributed.process_group import all_reduce_max
from stapo.rollout.batch import row_lengths
from stapo.distributed.policy import TeacherForcedInputs, teacher_forced_inputs

__all__ = ["MicroBatches", "plan_micro_batches", "balanced_bins", "bins_needed"]


def balanced_bins(lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """LPT: rows longest-first, each into the bin with the fewest tokens so far; each bin's rows ascending
    (e.g. lengths [5, 1, 4, 2], 2 bins -> [[0, 1], [2, 3]])."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    heap = [(0, b) for b in range(num_bins)]  # (tokens, bin)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, b = heapq.heappop(heap)
        bins[b].append(row)
        heapq.heappush(heap, (tokens + max(lengths[row], 1), b))  # >= 1: no bin stays empty
    return [sorted(b) for b in bins]


def _fits(bins: list[list[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    """Every bin within budget, except a single over-long row alone in its bin."""
    return all(len(b) == 1 or sum(lengths[i] for i in b) <= max_tokens for b in bins)


def bins_needed(lengths: Sequence[int], max_tokens: int) -> int:
    """Fewest balanced bins (:func:`balanced_bins`) that keep every bin within ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not lengths:
        return 1
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while k < len(lengths) and not _fits(balanced_bins(lengths, k), lengths, max_tokens):
        k += 1
    return min(k, len(lengths))


def plan_micro_batches(lengths: Sequence[int], *, max_rows: int | None = None,
                       max_tokens: int | None = None, sync_ranks: bool = True) -> list[list[int]]:
    """Row indices of each micro-batch, as many on every rank (one all-reduce unless ``sync_ranks=False``);
    ``lengths``: real tokens of this rank's rows."""
    n = len(lengths)
    if max_tokens is not None:
        local = bins_needed(lengths, max_tokens)
    elif max_rows is not None and max_rows >= 1:
        local = max(1, math.ceil(n / max_rows))
    else:
        raise ValueError(f"plan_micro_batches needs max_rows >= 1 or max_tokens, got {max_rows!r}, {max_tokens!r}")
    count = int(all_reduce_max(local)) if sync_ranks else local
    if count > n:
        raise ValueError(f"this rank has {n} rows but the ranks agreed on {count} micro-batches; "
                         "every rank must hold the same number of rows")
    if max_tokens is not None:
        return balanced_bins(lengths, count)
    sizes = [n // count + (i < n % count) for i in range(count)]  # `count` near-equal runs, <= max_rows
    starts = [sum(sizes[:i]) for i in range(count)]
    return [list(range(s, s + k)) for s, k in zip(starts, sizes)]


class MicroBatches:
    """THE micro-batch loop of the stats pass, the update and the token recorder: ``(rows, inputs)`` on
    ``device``, packed or padded; ``len()`` known before the loop. Collective."""

    def __init__(self, seqs, opts, device, *, no_grad: bool) -> None:
        self.seqs, self.opts, self.device = seqs, opts, device
        self.plan = plan_micro_batches(row_lengths(seqs), max_rows=opts.micro_batch_size,
                                       max_tokens=opts.budget(no_grad))

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, TeacherForcedInputs]]:
        s = self.seqs
        for rows in self.plan:
            index = torch.tensor(rows, dtype=torch.long)
            context = getattr(s, "context_mask", None)  # None: single-turn rows
            context = None if context is None else context[index]
            inputs = teacher_forced_inputs(s.prompt_ids[index], s.prompt_mask[index], s.response_ids[index],
                                           s.response_mask[index], packed=self.opts.packing,
                                           one_row=self.opts.pack_one_row, context_mask=context)
            yield index, inputs.to(self.device)
