"""The update does not depend on how a mini-batch is split into micro-batches or ranks, nor on
packing (docs/algorithm.md, docs/distributed.md).

One mini-batch of 8 rows (2 prompts x G=4, ragged prompt and response lengths) is updated with
real DeepSpeed ZeRO-3 under the layouts of ``LAYOUTS``: 1 or 2 ranks, padded or packed rows,
micro-batches by row count or by a token budget. The loss, the keep mask and the accumulated full gradient (read before the optimizer step)
must agree to fp32 tolerance, for the ``stapo`` and ``entropy_top`` masks. The stats the masks see
are fixed per row (computed once by a plain forward) so only the layout differs; the ratio's
denominator is offset per token so that both clip sides are exercised.

The off-policy corrections (docs/losses.md, "Off-policy corrections") go through the same layouts on top
of the ``stapo`` mask: token IS, sequence IS batch-normalized over the mini-batch on all ranks, and a
sequence rejection filter, each computed on a rank's full rows before micro-batching. Their loss and
gradient must equal the 1x1 reference within 1e-6 (absolute).
"""

from __future__ import annotations

import pytest
import torch

from _batches import ragged_rows
from _dist_utils import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROWS, G = 8, 4
# (label, ranks, rows per micro-batch, packed, token budget): the padded reference "1x1" against
# padded row micro-batches, packed row micro-batches and packed token-budget micro-batches
# (budget 24 of 80 real tokens: several micro-batches per rank, balanced by length).
LAYOUTS = (("1x1", 1, 8, False, None), ("1x4", 1, 2, False, None), ("2x2", 2, 2, False, None),
           ("1x4-packed", 1, 2, True, None), ("2x2-packed", 2, 2, True, None),
           ("1-budget", 1, 8, True, 24), ("2-budget", 2, 8, True, 24))
MASKS = {"stapo": {"tau_p": 0.05}, "entropy_top": {}}
# on the stapo mask: the sampler is off by up to +-0.6 nats per token (see _make_batch)
CORRECTIONS = {"token_is": {"rollout_is": "token", "rollout_is_threshold": 1.2},
               "sequence_is": {"rollout_is": "sequence", "rollout_is_threshold": 3.0,
                               "rollout_is_batch_normalize": True},
               "seq_rs": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.07}}


def _make_batch(model_dir) -> dict:
    """Ragged rows with mixed advantages and per-token stats from one plain forward."""
    from transformers import AutoModelForCausalLM

    from stapo.losses import group_advantages
    from stapo.distributed.policy import PolicyInputs, response_token_stats

    prompt_ids, prompt_mask, response_ids, response_mask = ragged_rows(
        [3, 5, 4, 6, 2, 5, 3, 4], [7, 2, 9, 5, 10, 1, 6, 8], seed=0)
    lt = response_ids.shape[1]
    g = torch.Generator().manual_seed(1)
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    advantages = group_advantages(rewards, G)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs, entropy = response_token_stats(
            model, PolicyInputs.from_parts(prompt_ids, prompt_mask, response_ids, response_mask),
            temperature=1.0, chunk_size=64)
    # theta_old differs from theta by up to +-0.5 nats per token: ratios on both sides of the clip range
    offset = (torch.rand(ROWS, lt, generator=g) - 0.5) * torch.where(response_mask, 1.0, 0.0)
    sampler_offset = (torch.rand(ROWS, lt, generator=g) - 0.5) * 1.2 * torch.where(response_mask, 1.0, 0.0)
    old = torch.zeros(ROWS, lt)
    old[:, : logprobs.shape[1]] = logprobs
    ent = torch.zeros(ROWS, lt)
    ent[:, : entropy.shape[1]] = entropy
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                response_mask=response_mask, advantages=advantages, old_logprobs=old + offset,
                entropy=ent, sampling_logprobs=old + offset - sampler_offset)


def rank_share(batch: dict):
    """``(DistInfo, row slice, TrainBatch)``: this rank's contiguous share of the batch's rows (joins the group)."""
    from stapo.distributed.process_group import init_distributed
    from stapo.trainer.update import TrainBatch

    info = init_distributed()
    share = ROWS // info.world_size
    rows = slice(info.rank * share, (info.rank + 1) * share)
    fields = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages", "old_logprobs", "entropy")
    return info, rows, TrainBatch(*(batch[f][rows] for f in fields), sampling_logprobs=batch["sampling_logprobs"][rows])


def _update_worker(out_dir, *, model_dir, batch, micro_batch_size, packing, max_tokens):
    """On each rank: its share of rows, one update per mask and per correction, full grads captured
    before the step."""
    from transformers import AutoModelForCausalLM

    from stapo.losses import RolloutCorrection, TokenStats, build_mask
    from _dist_utils import gather_full_grads
    from stapo.distributed.accumulation import GradientAccumulation
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.trainer.update import UpdateOptions, update_minibatch

    info, rows, mine = rank_share(batch)
    stats = TokenStats(mine.old_logprobs, mine.old_entropy, mine.advantages, mine.response_mask)
    opts = UpdateOptions(micro_batch_size=micro_batch_size, chunk_size=64, packing=packing,
                         max_tokens_per_micro_batch=max_tokens)
    captured = {}
    real_step = GradientAccumulation.step

    def step_after_capturing_grads(self):
        captured.update(gather_full_grads(self.engine))
        return real_step(self)

    GradientAccumulation.step = step_after_capturing_grads
    results = {}
    runs = [(name, name, params, None) for name, params in MASKS.items()] + \
        [(name, "stapo", MASKS["stapo"], settings) for name, settings in CORRECTIONS.items()]
    for label, name, params, settings in runs:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        engine = build_engine(model, lr=1e-3, warmup_steps=0, grad_accum_steps=-(-len(mine) // micro_batch_size),
                              micro_batch_size=micro_batch_size, bf16=False)
        captured.clear()
        masked = build_mask(name, **params).apply(stats)
        corrected = None if settings is None else RolloutCorrection(**settings)(
            mine.sampling_logprobs, mine.old_logprobs, mine.response_mask)  # full rows, before micro-batching
        sums = update_minibatch(engine, engine.module, mine, masked.keep, opts, correction=corrected)
        keep = masked.keep if corrected is None else masked.keep & ~corrected.rejected
        results[label] = {"loss": float(sums["loss"]), "keep": keep, "grads": dict(captured),
                          "tau_h": float(masked.thresholds["tau_h"]), "micro_batches": float(sums["micro_batches"]),
                          "weights": None if corrected is None or corrected.weights is None else corrected.weights,
                          "rejected": torch.zeros_like(keep) if corrected is None else corrected.rejected}
    return results


@pytest.fixture(scope="module")
def layouts(tiny_model_dir, tmp_path_factory):
    batch = _make_batch(tiny_model_dir)
    out = {}
    for label, world, micro, packing, max_tokens in LAYOUTS:
        results = run_ranks(_update_worker, world, tmp_path_factory.mktemp(label), timeout=240,
                            kwargs={"model_dir": str(tiny_model_dir), "batch": batch, "micro_batch_size": micro,
                                    "packing": packing, "max_tokens": max_tokens})
        out[label] = {
            name: {
                "loss": sum(r[name]["loss"] for r in results),  # each rank: its share of Eq. 1's numerator
                "keep": torch.cat([r[name]["keep"] for r in results]),
                "grads": results[0][name]["grads"],  # full gradients are identical on every rank
                "tau_h": [r[name]["tau_h"] for r in results],
                "micro_batches": [r[name]["micro_batches"] for r in results],
                "weights": None if results[0][name]["weights"] is None
                else torch.cat([r[name]["weights"] for r in results]),
                "rejected": torch.cat([r[name]["rejected"] for r in results]),
            }
            for name in (*MASKS, *CORRECTIONS)
        }
    return batch, out


@pytest.mark.parametrize("mask", list(MASKS))
def test_update_is_independent_of_micro_batches_and_ranks(layouts, mask):
    batch, out = layouts
    ref = out["1x1"][mask]
    keep = ref["keep"]
    valid = batch["response_mask"]
    assert not (keep & ~valid).any()
    assert 0 < int(keep.sum()) < int(valid.sum()), "the mask should silence some but not all tokens"
    for label in [layout[0] for layout in LAYOUTS if layout[0] != "1x1"]:
        got = out[label][mask]
        assert torch.equal(got["keep"], keep), f"{label}: keep mask differs"
        assert all(t == pytest.approx(ref["tau_h"][0], rel=1e-6) for t in got["tau_h"]), f"{label}: tau_h"
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), f"{label}: loss"
        if "budget" in label:  # 80 tokens over a 24-token budget: several balanced micro-batches
            assert all(n >= 2 for n in got["micro_batches"]), f"{label}: {got['micro_batches']}"
        assert got["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"{label}: {name}")
    assert any(g.abs().sum() > 0 for g in ref["grads"].values()), "the update produced no gradient"


@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_corrections_are_independent_of_micro_batches_and_ranks(layouts, correction):
    batch, out = layouts
    ref = out["1x1"][correction]
    valid = batch["response_mask"]
    if correction == "seq_rs":  # the filter rejects some responses, not all
        rows = ref["rejected"].any(dim=1)
        assert 0 < int(rows.sum()) < valid.shape[0] and torch.equal(ref["rejected"], valid & rows[:, None])
    else:
        w = ref["weights"][valid]
        assert w.min() < w.max() and not ref["rejected"].any()  # weights differ; nothing rejected
    assert abs(ref["loss"] - out["1x1"]["stapo"]["loss"]) > 1e-4, "the correction changed nothing"
    for label in [layout[0] for layout in LAYOUTS if layout[0] != "1x1"]:
        got = out[label][correction]
        assert torch.equal(got["keep"], ref["keep"]) and torch.equal(got["rejected"], ref["rejected"]), label
        if ref["weights"] is not None:
            torch.testing.assert_close(got["weights"], ref["weights"], rtol=0, atol=1e-6, msg=f"{label}: weights")
        assert abs(got["loss"] - ref["loss"]) <= 1e-6, f"{label}: |dloss| = {abs(got['loss'] - ref['loss']):.3g}"
        worst = max((got["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items())
        assert worst <= 1e-6, f"{label}: max |dgrad| = {worst:.3g}"
