"""Per-step metrics (docs/algorithm.md, "Metrics that follow the paper"): per-rank SUMS, one reduction
across ranks, ratios formed afterwards, so the figures do not depend on how the batch was spread.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from stapo.health import control_token_sums, repeated_ngram_tokens
from stapo.losses import MaskResult, TokenStats
from stapo.distributed.process_group import all_reduce_max, reduce_metrics
from stapo.telemetry.mfu import causal_context_length, forward_flops, phase_throughput
from stapo.rollout.batch import row_lengths

# Quantities that are already global (identical on every rank) before the reduction. (The loss is
# not: each rank holds its share of Eq. 1's numerator over the global denominator.)
_GLOBAL = ("mask_tau_h", "probe_tau_h", "grad_norm")
# Maxima: the max over mini-batches, then over ranks (never summed).
MAX_KEYS = ("mismatch_abs_max", "rollout_is_max")


class PhaseTimer:

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        return time.perf_counter() - self.start


class StepSums(dict):
    """Mini-batch metric sums of one step; tensors stay on their device until :func:`step_metrics`."""

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        """One mini-batch's sums."""
        self["minibatches"] = self.get("minibatches", 0.0) + 1.0
        for key, value in sums.items():
            self.add_value(key, value)

    def add_value(self, key: str, value) -> None:
        if key in MAX_KEYS and key in self:
            self[key] = torch.maximum(torch.as_tensor(self[key]), torch.as_tensor(value))
        else:
            self[key] = self.get(key, 0.0) + value

    def add_sync(self, synced=None, *, server: bool = False, delta: bool = False) -> None:
        """The step's weight sync (a SyncStats; None: it failed); the same keys on every rank."""
        self.add_value("sync_mb", 0.0 if synced is None else synced.num_bytes / 2**20)
        transfer = None if synced is None else synced.transfer
        if server:
            self.add_value("sync_sent_mb", 0.0 if transfer is None else transfer.sent_bytes / 2**20)
        if server and delta:
            self.add_value("sync_changed_words", 0.0 if transfer is None else float(transfer.changed_words))
            self.add_value("sync_compared_words", 0.0 if transfer is None else float(transfer.compared_words))


def _rollout_sums(rollout, rewards: torch.Tensor, scores: torch.Tensor, group_size: int,
                  control_ids: torch.Tensor | None = None) -> dict[str, float]:
    lengths = rollout.response_mask.sum(dim=1).float()  # (B,)
    groups = rewards.view(-1, group_size)  # (P, G)
    zero_std = (groups == groups[:, :1]).all(dim=1)  # all rewards equal -> A = 0 for the group
    return {
        "responses": float(len(rewards)),
        "reward_sum": float(rewards.sum()),
        "reward_sq_sum": float(rewards.square().sum()),
        "correct": float((scores > 0).sum()),
        "length_sum": float(lengths.sum()),
        "truncated": float(sum(r == "length" for r in rollout.finish_reason)),
        "groups": float(groups.shape[0]),
        "zero_std_groups": float(zero_std.sum()),
        "prompt_tokens": float(rollout.prompt_mask.sum()),
        "context_tokens": float(rollout.context_mask.sum()),  # episodes' tool/template tokens: read, not trained
        "repeated_tokens": float(repeated_ngram_tokens(rollout.response_ids, rollout.response_mask).sum()),
        **_episode_sums(rollout.episodes),
        **({} if control_ids is None else {k: float(v) for k, v in control_token_sums(
            rollout.response_ids, rollout.response_mask, rollout.sampling_logprobs, control_ids).items()}),
    }


def _episode_sums(episodes) -> dict[str, float]:
    """Tool-integrated episodes (docs/tir.md): turns, calls, errors, seconds in tools; nothing otherwise."""
    if episodes is None:
        return {}
    return {"turns_sum": float(episodes.turns.sum()), "tool_calls_sum": float(episodes.tool_calls.sum()),
            "tool_errors_sum": float(episodes.tool_errors.sum()), "tool_wait_s": float(episodes.tool_wait_s)}


def mask_sums(stats: TokenStats, masked: MaskResult, probe: MaskResult) -> dict[str, torch.Tensor]:
    """What the active mask and the S2T probe did on one mini-batch, as sums (device tensors); ``mask_tau_h``
    is the ACTIVE mask's threshold (NaN without one), ``probe_tau_h`` the S2T probe's (docs/metrics.md)."""
    valid = stats.response_mask
    nan = torch.tensor(float("nan"), device=valid.device)
    gate = {"mask_gate": masked.thresholds["gate"].detach().float()} if "gate" in masked.thresholds else {}
    return {
        **gate,
        "valid_tokens": valid.sum(),
        "kept_tokens_mask": masked.keep.sum(),
        "silenced_tokens": masked.silenced.sum(),
        "upweighted_tokens": masked.upweighted.sum(),
        "downweighted_tokens": masked.downweighted.sum(),
        "weight_sum": masked.weights[valid].sum(),
        "spurious_tokens": probe.silenced.sum(),
        "entropy_sum": stats.entropy[valid].sum(),
        "mask_tau_h": masked.thresholds.get("tau_h", nan).detach().float(),
        "probe_tau_h": probe.thresholds.get("tau_h", nan).detach().float(),
    }


def stats_counts(seqs, passes: int = 1) -> dict[str, float]:
    """Real tokens, causal attention pairs and lm_head positions of ``passes`` no-grad passes over ``seqs``."""
    lengths = row_lengths(seqs)
    real = float(sum(lengths))
    return {"stats_tokens": real * passes, "stats_attn_pairs": causal_context_length(lengths) * real * passes,
            "stats_head_tokens": float(seqs.response_mask.sum()) * passes}


def token_counts(seqs, no_grad_passes: int = 0) -> dict[str, float]:
    """The update's counts over ``seqs`` (as :func:`stats_counts`) and those of ``no_grad_passes`` no-grad passes."""
    once = stats_counts(seqs)
    return {"real_tokens": once["stats_tokens"], "attn_pairs": once["stats_attn_pairs"],
            "head_tokens": once["stats_head_tokens"], **stats_counts(seqs, no_grad_passes)}


def _throughput(s: dict, timer: PhaseTimer, model_config, peak_flops: float | None, world_size: int) -> dict:
    """tokens/s per phase and, on a device of known peak, MFU of the stats pass and the update."""
    if model_config is None:
        return {}
    stats = forward_flops(model_config, s["stats_tokens"], s["stats_attn_pairs"], s["stats_head_tokens"])
    update = forward_flops(model_config, s["real_tokens"], s["attn_pairs"], s["head_tokens"])

    def seconds(phase):
        return max(timer.seconds.get(phase, 0.0), 1e-9)

    return {**phase_throughput("rollout", s["length_sum"], seconds("rollout"), 0.0, None, False, world_size),
            **phase_throughput("stats", s["stats_tokens"], seconds("stats"), stats, peak_flops, False, world_size),
            **phase_throughput("update", s["real_tokens"], seconds("update"), update, peak_flops, True, world_size)}


def sync_metrics(s: dict) -> dict[str, float]:
    """The weight sync's optional keys (`StepSums.add_sync`): ``sync_sent_mb``, ``sync_changed_frac`` (delta)."""
    out = {}
    if "sync_sent_mb" in s:
        out["sync_sent_mb"] = s["sync_sent_mb"]
    if "sync_compared_words" in s:
        compared = s["sync_compared_words"]
        out["sync_changed_frac"] = s["sync_changed_words"] / compared if compared else float("nan")
    return out


def skipped_updates(sums: StepSums) -> int:
    """Mini-batch updates skipped this step (identical on every rank: the grad norm is global)."""
    return int(round(float(sums["minibatches"]) - float(sums["step_applied"])))


def step_metrics(*, step: int, epoch: int, lr: float, skipped_steps: int, group_size: int, world_size: int,
                 scored, sums: StepSums, timer: PhaseTimer, entropy_coef: float = 0.0, model_config=None,
                 peak_flops: float | None = None, control_ids: torch.Tensor | None = None) -> dict[str, float]:
    """The documented per-step metrics, reduced once across ranks; ``scored``: the iteration's ScoredRollout."""
    rollout = scored.rollout
    local = {**_rollout_sums(rollout, scored.rewards, scored.scores, group_size, control_ids), **sums}
    maxima = {key: all_reduce_max(float(local.pop(key))) for key in MAX_KEYS if key in local}  # not sums
    generation = timer.seconds.get("rollout", 0.0)  # this rank's; the ranks' spread shows an uneven deal
    slowest, fastest = all_reduce_max(generation), -all_reduce_max(-generation)
    s = reduce_metrics(local)
    minibatches = s["minibatches"] / world_size
    for key in _GLOBAL:  # identical on every rank: undo the sum over ranks
        s[key] = s.get(key, 0.0) / world_size
    n, valid, kept = s["responses"], max(s["valid_tokens"], 1.0), max(s["kept_tokens_mask"], 1.0)
    reward_mean = s["reward_sum"] / n
    applied = s["step_applied"] / world_size
    step_time = timer.total()
    optional = dict(scored.sampling)  # dynamic sampling: already global
    if "kl_sum" in s:  # only with a reference policy
        optional["kl"] = s["kl_sum"] / kept
    if "mask_gate" in s:  # only for a gated mask (STARE): identical on every rank, mean over mini-batches
        optional["mask_gate"] = s["mask_gate"] / world_size / minibatches
    if "entropy_bonus_sum" in s:  # only with loss.entropy_coef != 0
        optional["entropy_bonus"] = entropy_coef * s["entropy_bonus_sum"] / kept
    optional.update(sync_metrics(s))
    if "tool_calls_sum" in s:  # only with rollout.tools: multi-turn episodes
        optional.update(_episode_metrics(s, n, world_size))
    if "control_tokens" in s:  # tool episodes whose format has single-token control tags
        optional["control_token_frac"] = s["control_tokens"] / max(s["length_sum"], 1.0)
        optional["control_token_prob"] = s["control_prob_sum"] / s["control_tokens"] if s["control_tokens"] \
            else float("nan")
    if "rollout_is_weight_sum" in s:  # only with importance weights (loss.rollout_is)
        optional.update(_is_diagnostics(s, maxima["rollout_is_max"]))
    return {
        "step": float(step),
        "epoch": float(epoch),
        "reward_mean": reward_mean,
        "reward_std": max(s["reward_sq_sum"] / n - reward_mean**2, 0.0) ** 0.5,
        "accuracy": s["correct"] / n,
        "response_length_mean": s["length_sum"] / n,
        "response_length_max": all_reduce_max(float(rollout.response_mask.sum(dim=1).max())),
        "response_clip_ratio": s["truncated"] / n,
        "repetition_frac": s["repeated_tokens"] / max(s["length_sum"], 1.0),
        "overlong_penalty_mean": s["overlong_penalty_sum"] / n,
        "reward_failures": s["reward_failures"],
        "entropy_mean": s["entropy_sum"] / valid,
        "silenced_frac": s["silenced_tokens"] / valid,
        "spurious_frac": s["spurious_tokens"] / valid,
        "keep_frac": s["kept_tokens_mask"] / valid,
        "upweighted_frac": s["upweighted_tokens"] / valid,
        "downweighted_frac": s["downweighted_tokens"] / valid,
        "weight_mean": s["weight_sum"] / valid,
        "mask_tau_h": s["mask_tau_h"] / minibatches,
        "probe_tau_h": s["probe_tau_h"] / minibatches,
        "clip_frac_low": s.get("clip_low_count", 0.0) / kept,
        "clip_frac_high": s.get("clip_high_count", 0.0) / kept,
        "approx_kl": s.get("approx_kl_sum", 0.0) / kept,
        "mismatch_logp_abs_mean": s["mismatch_abs_sum"] / max(s["mismatch_tokens"], 1.0),
        "mismatch_logp_abs_max": maxima["mismatch_abs_max"],
        "mismatch_kl": s["mismatch_k3_sum"] / max(s["mismatch_tokens"], 1.0),
        "mismatch_kl_k1": s["mismatch_k1_sum"] / max(s["mismatch_tokens"], 1.0),
        "rollout_ppl": s["rollout_ppl_sum"] / max(s["mismatch_seqs"], 1.0),
        "training_ppl": s["training_ppl_sum"] / max(s["mismatch_seqs"], 1.0),
        "rejected_frac": s["rejected_tokens"] / max(s["correction_tokens"], 1.0),
        "rejected_seq_frac": s["rejected_seqs"] / max(s["correction_seqs"], 1.0),
        "loss": s["loss"] / minibatches,
        "grad_norm": s["grad_norm"] / max(applied, 1.0),
        "lr": lr,
        "zero_std_group_frac": s["zero_std_groups"] / s["groups"],
        "skipped_updates": minibatches - applied,
        "skipped_steps": float(skipped_steps),
        **{f"time_{phase}": timer.seconds.get(phase, 0.0) for phase in ("rollout", "reward", "stats", "update", "sync")},
        "time_step": step_time,
        "time_rollout_max": slowest,
        "time_rollout_min": fastest,
        "sync_mb": s["sync_mb"] / world_size,
        "tokens_per_s": (s["length_sum"] + s["prompt_tokens"] + s["context_tokens"]) / step_time,
        **_throughput(s, timer, model_config, peak_flops, world_size),
        **optional,
    }


def _is_diagnostics(s: dict, is_max: float) -> dict[str, float]:
    """verl's IS diagnostics: the raw ratios' mean and max, ESS ``(sum w)^2 / (n sum w^2)``, the clipped fraction."""
    n, total, squares = max(s["correction_tokens"], 1.0), s["rollout_is_weight_sum"], s["rollout_is_weight_sq_sum"]
    return {"rollout_is_mean": s["rollout_is_raw_sum"] / n, "rollout_is_max": is_max,
            "rollout_is_eff_sample_size": total * total / (n * squares) if squares > 0 else 0.0,
            "rollout_is_clipped_frac": s["rollout_is_clipped"] / n}


def _episode_metrics(s: dict, n: float, world_size: int) -> dict[str, float]:
    """Per-episode means of the tool-integrated episodes, from the step's global sums."""
    calls = s["tool_calls_sum"]
    return {"turns_mean": s["turns_sum"] / n, "tool_calls_mean": calls / n,
            "tool_errors_mean": s["tool_errors_sum"] / n,
            "tool_error_frac": s["tool_errors_sum"] / max(calls, 1.0),
            "context_token_frac": s["context_tokens"] / max(s["context_tokens"] + s["length_sum"], 1.0),
            "tool_penalty_mean": s.get("tool_penalty_sum", 0.0) / n, "time_tools": s["tool_wait_s"] / world_size}


def evaluation_metrics(rewards: list[float], response_lengths: list[int] | None = None,
                       tool_calls: list[int] | None = None, prefix: str = "eval_") -> dict[str, float]:
    """Held-out accuracy, mean reward, response length and tool calls (when given) over all ranks."""
    lengths = [] if response_lengths is None else response_lengths
    s = reduce_metrics({"n": float(len(rewards)), "correct": float(sum(r > 0 for r in rewards)),
                        "reward_sum": float(sum(rewards)), "length_sum": float(sum(lengths)),
                        "calls": float(sum(tool_calls or []))})
    n = max(s["n"], 1.0)
    row = {f"{prefix}accuracy": s["correct"] / n, f"{prefix}reward_mean": s["reward_sum"] / n}
    if response_lengths is not None:
        row[f"{prefix}response_length_mean"] = s["length_sum"] / n
    if tool_calls is not None:
        row[f"{prefix}tool_calls_mean"] = s["calls"] / n
    return row


def sample_completions(rollout, rewards: torch.Tensor, silenced: torch.Tensor, tokenizer, count: int = 2) -> list[dict]:
    """A few completions with their tokens and which were silenced, for ``MetricsLogger.log_samples``."""
    samples = []
    for row in range(min(count, len(rollout))):
        valid = rollout.real_mask[row]
        ids = rollout.response_ids[row][valid].tolist()
        samples.append({
            "prompt": rollout.prompt_text[row] if rollout.prompt_text else "",
            "response": rollout.response_text[row],
            "reward": float(rewards[row]),
            "ground_truth": rollout.ground_truth[row] if rollout.ground_truth else "",
            "tokens": [tokenizer.decode([i]) for i in ids],
            "silenced": silenced[row][valid].tolist(),
        })
    return samples
