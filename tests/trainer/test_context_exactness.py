"""Split invariance with interleaved context tokens (multi-turn episodes, docs/tir.md): the update of
a mini-batch of episodes does not depend on how it is cut into micro-batches or ranks, nor on packing.

As tests/trainer/test_exactness.py, on real DeepSpeed ZeRO-3 over 1 or 2 gloo ranks, but every row
is an episode: policy turns with context segments (tool output, template tokens) between them, so
packed widths, token budgets and the balanced plan all count context tokens while the loss, the
masks' quantiles and the normalizer count the policy's tokens only. Loss and full gradient agree to
1e-6 in absolute terms.
"""

from __future__ import annotations

import pytest
import torch

from _batches import ragged_rows
from _dist_utils import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROWS, G = 8, 4
# (label, ranks, rows per micro-batch, packed, token budget); budget 40 of ~130 real tokens
LAYOUTS = (("1x1", 1, 8, False, None), ("2x2", 2, 2, False, None), ("2x2-packed", 2, 2, True, None),
           ("2-budget", 2, 8, True, 40))
MASKS = {"stapo": {"tau_p": 0.05}, "entropy_top": {}}


def _episodes():
    """8 ragged episodes: context segments at varying places, one row ending in a policy turn of 1 token."""
    prompt_ids, prompt_mask, response_ids, real = ragged_rows(
        [3, 5, 4, 6, 2, 5, 3, 4], [12, 7, 14, 9, 16, 5, 11, 13], seed=4)
    context = torch.zeros_like(real)
    spans = {0: [(2, 5)], 1: [(3, 6)], 2: [(1, 3), (6, 10)], 3: [(4, 8)], 4: [(2, 4), (7, 9), (11, 15)],
             5: [(1, 4)], 6: [(5, 10)], 7: [(3, 4), (8, 12)]}
    for row, segments in spans.items():
        for a, b in segments:
            context[row, a:b] = True
    return prompt_ids, prompt_mask, response_ids, real & ~context, context


def _make_batch(model_dir) -> dict:
    from transformers import AutoModelForCausalLM

    from stapo.distributed.policy import response_token_stats, teacher_forced_inputs
    from stapo.losses import group_advantages

    prompt_ids, prompt_mask, response_ids, response_mask, context = _episodes()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        inputs = teacher_forced_inputs(prompt_ids, prompt_mask, response_ids, response_mask, packed=False,
                                       context_mask=context)
        logprobs, entropy = response_token_stats(model, inputs, temperature=1.0, chunk_size=64)
    g = torch.Generator().manual_seed(1)
    offset = (torch.rand(response_ids.shape, generator=g) - 0.5) * response_mask  # both clip sides
    pad = lambda x: torch.nn.functional.pad(x, (0, response_ids.shape[1] - x.shape[1]))  # noqa: E731
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                response_mask=response_mask, advantages=group_advantages(rewards, G),
                old_logprobs=pad(logprobs) + offset, entropy=pad(entropy), context_mask=context)


def _update_worker(out_dir, *, model_dir, batch, micro_batch_size, packing, max_tokens):
    from transformers import AutoModelForCausalLM

    from _dist_utils import gather_full_grads
    from stapo.distributed.accumulation import GradientAccumulation
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.distributed.process_group import init_distributed
    from stapo.losses import TokenStats, build_mask
    from stapo.trainer.update import TrainBatch, UpdateOptions, update_minibatch

    info = init_distributed()
    share = ROWS // info.world_size
    rows = slice(info.rank * share, (info.rank + 1) * share)
    mine = TrainBatch(*(batch[f][rows] for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                                 "advantages", "old_logprobs", "entropy")),
                      context_mask=batch["context_mask"][rows])
    stats = TokenStats(mine.old_logprobs, mine.old_entropy, mine.advantages, mine.response_mask)
    opts = UpdateOptions(micro_batch_size=micro_batch_size, chunk_size=64, packing=packing,
                         max_tokens_per_micro_batch=max_tokens)
    captured, real_step = {}, GradientAccumulation.step

    def step_after_capturing_grads(self):
        captured.update(gather_full_grads(self.engine))
        return real_step(self)

    GradientAccumulation.step = step_after_capturing_grads
    results = {}
    for name, params in MASKS.items():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        engine = build_engine(model, lr=1e-3, warmup_steps=0, grad_accum_steps=-(-len(mine) // micro_batch_size),
                              micro_batch_size=micro_batch_size, bf16=False)  # ZeRO-3
        captured.clear()
        masked = build_mask(name, **params).apply(stats)
        sums = update_minibatch(engine, engine.module, mine, masked.keep, opts)
        results[name] = {"loss": float(sums["loss"]), "keep": masked.keep, "grads": dict(captured),
                         "micro_batches": float(sums["micro_batches"])}
    return results


@pytest.fixture(scope="module")
def layouts(tiny_model_dir, tmp_path_factory):
    batch = _make_batch(tiny_model_dir)
    out = {}
    for label, world, micro, packing, max_tokens in LAYOUTS:
        results = run_ranks(_update_worker, world, tmp_path_factory.mktemp(label), timeout=240,
                            kwargs={"model_dir": str(tiny_model_dir), "batch": batch, "micro_batch_size": micro,
                                    "packing": packing, "max_tokens": max_tokens})
        out[label] = {name: {"loss": sum(r[name]["loss"] for r in results),
                             "keep": torch.cat([r[name]["keep"] for r in results]),
                             "grads": results[0][name]["grads"],
                             "micro_batches": [r[name]["micro_batches"] for r in results]} for name in MASKS}
    return batch, out


@pytest.mark.parametrize("mask", list(MASKS))
def test_update_with_context_tokens_is_independent_of_micro_batches_and_ranks(layouts, mask):
    batch, out = layouts
    ref = out["1x1"][mask]
    assert not (ref["keep"] & ~batch["response_mask"]).any(), "a mask kept a context or padding token"
    assert 0 < int(ref["keep"].sum()) < int(batch["response_mask"].sum())
    assert any(g.abs().sum() > 0 for g in ref["grads"].values())
    for label in [layout[0] for layout in LAYOUTS[1:]]:
        got = out[label][mask]
        assert torch.equal(got["keep"], ref["keep"]), f"{label}: keep mask differs"
        assert abs(got["loss"] - ref["loss"]) <= 1e-6, f"{label}: loss {got['loss']} vs {ref['loss']}"
        if "budget" in label:  # context tokens count in the budget: several micro-batches per rank
            assert all(n >= 2 for n in got["micro_batches"]), f"{label}: {got['micro_batches']}"
        gap = max(float((got["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
        assert gap <= 1e-6, f"{label}: max |grad difference| {gap:.2e}"
