"""20-Entropy token selection, TRL's rule vs stapo's, on IDENTICAL entropies (``bench/vs_trl.py``).

Both rules keep tokens whose entropy is at or above the 80% quantile (top 20%); they differ in
WHERE the quantile is taken and in the loss NORMALIZER (docs/vs_trl.md, docs/algorithm.md):

- TRL ``GRPOTrainer`` (``top_entropy_quantile=0.2``): the threshold is computed per micro-step
  over the micro-batch's valid tokens (gathered over ranks), and the DAPO loss keeps dividing by
  all valid tokens of the optimizer step's window (``num_items_in_batch * GA / steps_per_generation``),
  so silenced tokens leave only the numerator: the loss shrinks by about the kept fraction.
- stapo ``entropy_top``: one ``tau_h`` over the valid tokens of the whole mini-batch (all ranks),
  and Eq. 1 divides by the kept tokens (silenced tokens leave numerator and denominator).

TRL's own ``GRPOTrainer.get_high_entropy_mask`` is called (with a one-process accelerator stand-in)
and stapo's own ``EntropyTopMask``; the entropies are those stapo's mask saw in a real run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

# What TRL's accelerator calls do in a 1-process run: no padding across ranks, gather = identity.
_ONE_PROCESS = SimpleNamespace(accelerator=SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t,
                                                           gather=lambda t: t))


def trl_keep(entropy: torch.Tensor, response_mask: torch.Tensor, micro_batch: int, keep_fraction: float):
    """TRL's keep mask ``(B, T)`` and its per-micro-batch thresholds (one micro-step per slice)."""
    from trl import GRPOTrainer

    keep = torch.zeros_like(response_mask, dtype=torch.bool)
    thresholds = []
    for start in range(0, entropy.shape[0], micro_batch):
        sl = slice(start, start + micro_batch)
        keep[sl] = GRPOTrainer.get_high_entropy_mask(_ONE_PROCESS, entropy[sl], response_mask[sl], 1 - keep_fraction)
        valid = entropy[sl][response_mask[sl]]
        thresholds.append(float(torch.quantile(valid, 1 - keep_fraction)) if valid.numel() else float("nan"))
    return keep, thresholds


def stapo_keep(entropy: torch.Tensor, response_mask: torch.Tensor, keep_fraction: float):
    """stapo's ``entropy_top`` keep mask ``(B, T)`` over the whole mini-batch and its ``tau_h``."""
    from stapo.losses import TokenStats, build_mask

    stats = TokenStats(torch.zeros_like(entropy), entropy, torch.zeros(entropy.shape[0]), response_mask)
    result = build_mask("entropy_top", entropy_quantile=1 - keep_fraction).apply(stats)
    return result.keep, float(result.thresholds["tau_h"])


def selection_tables(record: Path, *, micro_batch: int, keep_fraction: float, updates_per_iteration: int) -> list[str]:
    """Markdown tables for the first mini-batch of the recorded iteration."""
    calls = torch.load(record)
    entropy, mask = calls[0]["entropy"], calls[0]["response_mask"].bool()  # (B, T)
    # TRL's DAPO normalizer: valid tokens of the generation batch / optimizer steps per generation
    window = sum(int(c["response_mask"].sum()) for c in calls) / len(calls) if len(calls) == updates_per_iteration \
        else float(mask.sum())
    t_keep, t_thr = trl_keep(entropy, mask, micro_batch, keep_fraction)
    s_keep, tau_h = stapo_keep(entropy, mask, keep_fraction)
    lines = [f"20-Entropy selection on identical entropies (first mini-batch of iteration 1: {entropy.shape[0]} "
             f"sequences, {int(mask.sum())} valid tokens; TRL micro-batch = {micro_batch} sequences):", "",
             "| micro-batch | valid tokens | TRL threshold (per micro-batch) | TRL keeps | stapo keeps "
             f"(tau_h = {tau_h:.3f}) | both keep |", "|---|---|---|---|---|---|"]
    for i, start in enumerate(range(0, entropy.shape[0], micro_batch)):
        sl = slice(start, start + micro_batch)
        lines.append(f"| {i} (rows {start}-{min(start + micro_batch, entropy.shape[0]) - 1}) | {int(mask[sl].sum())} "
                     f"| {t_thr[i]:.3f} | {int(t_keep[sl].sum())} | {int(s_keep[sl].sum())} "
                     f"| {int((t_keep[sl] & s_keep[sl]).sum())} |")
    both, either = int((t_keep & s_keep).sum()), int((t_keep | s_keep).sum())
    kt, ks = int(t_keep.sum()), int(s_keep.sum())
    lines += ["", "| rule | kept tokens | kept / valid | loss normalizer | weight per kept token "
              "| sum of weights (gradient scale vs. keep-all) |", "|---|---|---|---|---|---|",
              f"| TRL `top_entropy_quantile={keep_fraction}` | {kt} | {kt / max(int(mask.sum()), 1):.3f} "
              f"| {window:.0f} (all valid tokens of the step's window) | 1/{window:.0f} | {kt / window:.3f} |",
              f"| stapo `entropy_top` (q={1 - keep_fraction:.1f}) | {ks} | {ks / max(int(mask.sum()), 1):.3f} "
              f"| {ks} (kept tokens) | 1/{ks} | {1.0 if ks else 0.0:.3f} |",
              "", f"Tokens kept by both rules: {both}; by exactly one: {either - both} "
              f"(Jaccard overlap {both / max(either, 1):.3f})."]
    return lines
