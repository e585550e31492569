"""Token-weighting masks (``stare``, ``clip_cov``) do not depend on the micro-batch or rank split.

The released STARE and Clip-Cov code select per micro-batch and rank; stapo selects over the whole
mini-batch on all ranks. The batch of tests/trainer/test_exactness.py (8 ragged rows, mixed
advantages, theta_old offset so the ratio clips on both sides) is updated with real DeepSpeed
ZeRO-3 under 1 or 2 gloo ranks and 1 or several micro-batches (rows or a token budget): the
weights must be identical, the loss and the full gradient equal to fp32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from _dist_utils import run_ranks
from test_exactness import _make_batch, rank_share

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAYOUTS = (("1x1", 1, 8, False, None), ("1x4", 1, 2, False, None), ("2x2", 2, 2, False, None),
           ("2-budget", 2, 8, True, 24))
# stare C2 with a wide top-P so that both signs are re-weighted on 80 tokens; the gate is on
# (batch entropy 0.1 < 0.3). clip_cov with a wide band and ratio so that several tokens are drawn.
MASKS = {"stare": {"variant": "C2", "top_p_ratio": 0.3, "reweight_w": 1.3, "reweight_m": 0.6},
         "clip_cov": {"ratio": 0.1, "lb": -100.0, "ub": 100.0}}
BATCH_ENTROPY, SEED = 0.1, 1234
#: max |difference| against the 1x1 reference, filled by the test (shown with ``pytest -s``)
FIGURES: dict[str, float] = {}


def _weights_worker(out_dir, *, model_dir, batch, micro_batch_size, packing, max_tokens):
    """On each rank: its share of rows, one weighted update per mask, full grads before the step."""
    from transformers import AutoModelForCausalLM

    from stapo.distributed.accumulation import GradientAccumulation
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.losses import TokenStats, build_mask
    from stapo.trainer.update import UpdateOptions, update_minibatch
    from _dist_utils import gather_full_grads

    info, rows, mine = rank_share(batch)
    stats = TokenStats(batch["logprobs"][rows], mine.old_entropy, mine.advantages, mine.response_mask,
                       old_logprobs=mine.old_logprobs, clip_range=(0.2, 0.28), batch_entropy=BATCH_ENTROPY,
                       seed=SEED)
    opts = UpdateOptions(micro_batch_size=micro_batch_size, chunk_size=64, packing=packing,
                         max_tokens_per_micro_batch=max_tokens)
    captured = {}
    real_step = GradientAccumulation.step

    def step_after_capturing_grads(self):
        captured.update(gather_full_grads(self.engine))
        return real_step(self)

    GradientAccumulation.step = step_after_capturing_grads
    results = {}
    for name, params in MASKS.items():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        engine = build_engine(model, lr=1e-3, warmup_steps=0, grad_accum_steps=-(-len(mine) // micro_batch_size),
                              micro_batch_size=micro_batch_size, bf16=False)
        captured.clear()
        masked = build_mask(name, **params).apply(stats)
        sums = update_minibatch(engine, engine.module, mine, masked.keep, opts, weights=masked.weights)
        results[name] = {"loss": float(sums["loss"]), "weights": masked.weights, "grads": dict(captured),
                         "micro_batches": float(sums["micro_batches"])}
    return results


@pytest.fixture(scope="module")
def layouts(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from stapo.distributed.policy import PolicyInputs, response_token_stats

    batch = _make_batch(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs, _ = response_token_stats(model, PolicyInputs.from_parts(
            batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"]),
            temperature=1.0, chunk_size=64)
    batch["logprobs"] = torch.zeros_like(batch["old_logprobs"])
    batch["logprobs"][:, : logprobs.shape[1]] = logprobs
    out = {}
    for label, world, micro, packing, max_tokens in LAYOUTS:
        results = run_ranks(_weights_worker, world, tmp_path_factory.mktemp(label), timeout=240,
                            kwargs={"model_dir": str(tiny_model_dir), "batch": batch, "micro_batch_size": micro,
                                    "packing": packing, "max_tokens": max_tokens})
        out[label] = {name: {"loss": sum(r[name]["loss"] for r in results),
                             "weights": torch.cat([r[name]["weights"] for r in results]),
                             "grads": results[0][name]["grads"],
                             "micro_batches": [r[name]["micro_batches"] for r in results]}
                      for name in MASKS}
    return batch, out


@pytest.mark.parametrize("mask", list(MASKS))
def test_weighted_update_is_independent_of_micro_batches_and_ranks(layouts, mask):
    batch, out = layouts
    ref = out["1x1"][mask]
    weights, valid = ref["weights"], batch["response_mask"]
    assert not weights[~valid].any()
    if mask == "stare":  # both signs re-weighted, the rest at 1
        assert (weights > 1).any() and ((weights > 0) & (weights < 1)).any() and (weights[valid] == 1).any()
    else:  # int(0.1 * 80 valid tokens) = 8 drawn (fewer only if the ratio clips more than 72)
        assert 0 < int(((weights == 0) & valid).sum()) <= 8
    for label in [layout[0] for layout in LAYOUTS if layout[0] != "1x1"]:
        got = out[label][mask]
        assert torch.equal(got["weights"], weights), f"{label}: weights differ"
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), f"{label}: loss"
        if label != "2x2":
            assert max(got["micro_batches"]) >= 2, f"{label}: {got['micro_batches']}"
        FIGURES[f"{mask} {label} loss"] = abs(got["loss"] - ref["loss"])
        FIGURES[f"{mask} {label} grad"] = max(float((got["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"{label}: {name}")
    assert any(g.abs().sum() > 0 for g in ref["grads"].values()), "the update produced no gradient"
    print({k: f"{v:.3g}" for k, v in FIGURES.items() if k.startswith(mask)})
