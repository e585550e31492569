"""Every loss/diagnostic knob does what it says (the KL penalty, the spurious-token probe).

Hand-computed: with advantages 0 the surrogate contributes nothing, so the loss is exactly
``kl_coef * token-mean k3(ref vs theta)``; with the reference assigning every sampled token twice
the policy's probability, ``ref - logp = log 2`` and ``k3 = e^{log 2} - log 2 - 1 = 1 - log 2``.
"""

from __future__ import annotations

import math

import pytest
import torch

from _rewards import digit_one_reward
from test_trainer import tiny_config

pytestmark = pytest.mark.slow

K3_LOG2 = 1.0 - math.log(2.0)  # 0.30685...


def _batch_with_reference(model, delta: float):
    from stapo.trainer.update import TrainBatch, UpdateOptions, policy_stats

    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(5, 300, (4, 5), generator=g)
    prompt_mask = torch.ones(4, 5, dtype=torch.bool)
    response_ids = torch.randint(5, 300, (4, 6), generator=g)
    response_mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] * 2 + [0] * 4]).bool()

    class Seqs:  # what policy_stats reads: ids and masks
        pass

    seqs = Seqs()
    seqs.prompt_ids, seqs.prompt_mask, seqs.response_ids, seqs.response_mask = (
        prompt_ids, prompt_mask, response_ids, response_mask)
    opts = UpdateOptions(chunk_size=64, micro_batch_size=2)
    old, entropy = policy_stats(model, seqs, opts)
    ref = torch.where(response_mask, old + delta, 0.0)
    batch = TrainBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(4), old, entropy,
                       ref_logprobs=ref)
    return batch, opts


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_kl_penalty_is_kl_coef_times_token_mean_k3(kl_coef, tiny_model_dir):
    import dataclasses

    from transformers import AutoModelForCausalLM

    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.trainer.update import update_minibatch

    init_distributed()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    engine = build_engine(model, lr=1e-3, warmup_steps=0, grad_accum_steps=2, zero_stage=0, bf16=False)
    batch, opts = _batch_with_reference(engine.module, math.log(2.0))
    opts = dataclasses.replace(opts, kl_coef=kl_coef)
    sums = update_minibatch(engine, engine.module, batch, batch.response_mask, opts)
    kept = int(batch.response_mask.sum())  # 16 tokens
    assert float(sums["kept_tokens"]) == kept == 16
    # every kept token: k3 = 1 - log 2 (up to the float difference of two forwards of theta)
    assert float(sums["kl_sum"]) / kept == pytest.approx(K3_LOG2, abs=1e-5)
    assert float(sums["loss"]) == pytest.approx(kl_coef * K3_LOG2, abs=1e-5)  # A = 0: surrogate is 0


def test_kl_coef_builds_a_frozen_reference_and_logs_kl(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from stapo import STAPOTrainer
    from stapo.telemetry.metrics import read_metrics
    from stapo.sync.buckets import iter_weight_buckets

    off = STAPOTrainer(tiny_config(tmp_path / "off", tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=1"),
                       reward_fn=digit_one_reward)
    assert off.reference is None  # the paper's setting builds no reference model
    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "loss.kl_coef=0.1")
    trainer = STAPOTrainer(cfg, reward_fn=digit_one_reward)
    assert trainer.reference is not None
    before = {n: t.clone() for b in iter_weight_buckets(trainer.reference) for n, t in b}
    trainer.train()
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    # step 1 starts at theta = theta_ref (k3 = 0 there); once the policy has moved, k3 > 0
    assert rows[0]["kl"] >= 0.0 and rows[-1]["kl"] > 1e-4
    after = {n: t for b in iter_weight_buckets(trainer.reference) for n, t in b}
    assert all(torch.equal(before[n], after[n]) for n in before), "the reference policy changed"
    policy = {n: t for b in iter_weight_buckets(trainer.model) for n, t in b}
    assert any(not torch.equal(before[n], policy[n]) for n in before), "the policy did not move"


def test_spurious_probe_follows_the_configured_thresholds(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from stapo import STAPOTrainer
    from stapo.losses import build_mask
    from stapo.losses import spurious_probe

    probe = spurious_probe(build_mask("prob_only", tau_p=0.05))
    assert (probe.tau_p, probe.entropy_quantile) == (0.05, 0.8)  # the paper's q where the mask has none
    probe = spurious_probe(build_mask("stapo", tau_p=1e-3, entropy_quantile=0.6))
    assert (probe.tau_p, probe.entropy_quantile) == (1e-3, 0.6)
    defaults = spurious_probe(build_mask("none"))
    assert (defaults.tau_p, defaults.entropy_quantile) == (2e-3, 0.8)
    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "mask.name=stapo",
                      "mask.params={tau_p: 0.2, entropy_quantile: 0.9}", "trainer.total_steps=1")
    trainer = STAPOTrainer(cfg, reward_fn=lambda response, _: 1.0 if len(response) % 2 else -1.0)
    metrics = trainer.step()
    # the probe IS the active criterion here, so it flags exactly what the mask silenced
    assert metrics["spurious_frac"] == metrics["silenced_frac"] > 0
    assert metrics["probe_tau_h"] == pytest.approx(metrics["mask_tau_h"])


def _engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import build_engine

    init_distributed()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return build_engine(model, lr=1e-3, warmup_steps=0, grad_accum_steps=2, zero_stage=0, bf16=False)


def _sampled_by(batch, log_gap):
    """The batch with the sampler's log-probs ``old - log_gap`` per row (``log r = log_gap``)."""
    import dataclasses

    gap = torch.as_tensor(log_gap, dtype=torch.float32)[:, None]
    sampling = torch.where(batch.response_mask, batch.old_logprobs - gap, 0.0)
    # rows of 6, 3, 5 and 2 tokens with A = 1, -1, 1, 1: sum(A) over the 16 tokens is 6 - 3 + 5 + 2 = 10
    return dataclasses.replace(batch, advantages=torch.tensor([1.0, -1.0, 1.0, 1.0]), sampling_logprobs=sampling,
                               ref_logprobs=None)


@pytest.mark.parametrize("settings, factor", [({}, 1.0), ({"rollout_is": "token", "rollout_is_threshold": 2.0}, 2.0),
                                              ({"rollout_is": "sequence", "rollout_is_threshold": 8.0}, 8.0),
                                              ({"rollout_is": "token", "rollout_is_threshold": 8.0}, 4.0)])
def test_importance_weights_scale_the_surrogate(settings, factor, tiny_model_dir):
    # the sampler gave every token a quarter of the trainer's probability: pi_old / pi_sampler = 4 per
    # token (a row's product: 4^len, truncated at 8), capped at the threshold. At theta_old rho = 1, so each
    # kept token's loss is -A * w and the token-mean loss is -w * sum(A) / N = factor times the plain loss.
    from stapo.losses import RolloutCorrection
    from stapo.trainer.update import update_minibatch

    engine = _engine(tiny_model_dir)
    batch, opts = _batch_with_reference(engine.module, 0.0)
    batch = _sampled_by(batch, [math.log(4.0)] * 4)
    corrected = RolloutCorrection(**settings)(batch.sampling_logprobs, batch.old_logprobs, batch.response_mask)
    sums = update_minibatch(engine, engine.module, batch, batch.response_mask, opts, correction=corrected)
    assert float(sums["loss"]) == pytest.approx(-factor * 10 / 16, abs=1e-5)


def test_a_token_weight_is_the_masks_times_the_corrections(tiny_model_dir):
    # mask weight 0.5 on row 0, 1 elsewhere; IS weight 4 everywhere (cap 8): per-token weights 2, 4, 4, 4,
    # the normalizer the 16 tokens: -(2 * 6 - 4 * 3 + 4 * 5 + 4 * 2) / 16 = -28 / 16
    from stapo.losses import RolloutCorrection
    from stapo.trainer.update import update_minibatch

    engine = _engine(tiny_model_dir)
    batch, opts = _batch_with_reference(engine.module, 0.0)
    batch = _sampled_by(batch, [math.log(4.0)] * 4)
    corrected = RolloutCorrection("token", 8.0)(batch.sampling_logprobs, batch.old_logprobs, batch.response_mask)
    mask_weights = torch.where(torch.arange(4)[:, None] == 0, 0.5, 1.0).expand(4, 6)
    sums = update_minibatch(engine, engine.module, batch, batch.response_mask, opts, weights=mask_weights,
                            correction=corrected)
    assert float(sums["loss"]) == pytest.approx(-28 / 16, abs=1e-5)
    assert float(sums["kept_tokens"]) == 16


@pytest.mark.parametrize("settings, loss, kept", [
    # row 1 (3 tokens, A = -1) sampled with log r = 1.5 against 0 elsewhere. IcePop band [0.5, 2]: r = e^1.5
    # is outside, weight 0, the token stays in the normalizer: -(6 + 0 + 5 + 2) / 16
    ({"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"}, -13 / 16, 16),
    # rejection (seq_mean_k3 = e^1.5 - 2.5 = 1.98 > 0.5 on row 1, 0 elsewhere): row 1 leaves numerator and
    # normalizer: -(6 + 5 + 2) / 13
    ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.5}, -1.0, 13),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}, -1.0, 13),  # exp(k1) = e^-1.5 < 1/2
])
def test_rejection_leaves_the_normalizer_and_a_zero_weight_does_not(settings, loss, kept, tiny_model_dir):
    from stapo.losses import RolloutCorrection
    from stapo.trainer.update import update_minibatch

    engine = _engine(tiny_model_dir)
    batch, opts = _batch_with_reference(engine.module, 0.0)
    batch = _sampled_by(batch, [0.0, 1.5, 0.0, 0.0])
    corrected = RolloutCorrection(**settings)(batch.sampling_logprobs, batch.old_logprobs, batch.response_mask)
    sums = update_minibatch(engine, engine.module, batch, batch.response_mask, opts, correction=corrected)
    assert float(sums["loss"]) == pytest.approx(loss, abs=1e-5)
    assert float(sums["kept_tokens"]) == kept


@pytest.mark.parametrize("out", ["loss_mask", "rejected"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_row_out_of_the_loss_leaves_numerator_and_normalizer(agg, out, tiny_model_dir):
    # loss.mask_truncated (a row masked out by loss_mask) or a sequence rejected by the off-policy correction
    # gives exactly the loss of the batch without that row, in every aggregation (for the seq-mean modes the
    # row leaves the row count too)
    import dataclasses

    from transformers import AutoModelForCausalLM

    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.trainer.update import update_minibatch

    init_distributed()

    def engine():
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        return build_engine(model, lr=1e-3, warmup_steps=0, grad_accum_steps=2, zero_stage=0, bf16=False)

    first = engine()
    batch, opts = _batch_with_reference(first.module, 0.0)
    batch = dataclasses.replace(batch, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), ref_logprobs=None)
    opts = dataclasses.replace(opts, agg=agg, max_response_length=6)
    cut = torch.tensor([False, True, False, False])  # row 1 hit the length limit, or its sampler was far off
    if out == "loss_mask":
        masked = dataclasses.replace(batch, loss_mask=batch.response_mask & ~cut[:, None])
        with_mask = update_minibatch(first, first.module, masked, masked.response_mask, opts)
    else:
        from stapo.losses import RolloutCorrection

        sampling = torch.where(batch.response_mask, batch.old_logprobs - 2.0 * cut[:, None], 0.0)
        corrected = RolloutCorrection(rollout_rs="seq_max_k2", rollout_rs_threshold=1.0)(  # (log r)^2 / 2 = 2 on row 1
            sampling, batch.old_logprobs, batch.response_mask)
        assert torch.equal(corrected.rejected.any(dim=1), cut)
        with_mask = update_minibatch(first, first.module, batch, batch.response_mask, opts, correction=corrected)
    rest = batch.rows(torch.tensor([0, 2, 3]))
    second = engine()
    without_row = update_minibatch(second, second.module, rest, rest.response_mask, opts)
    assert float(with_mask["kept_tokens"]) == float(without_row["kept_tokens"]) == 6 + 5 + 2
    assert float(with_mask["loss"]) == pytest.approx(float(without_row["loss"]), abs=1e-6)
    assert abs(float(with_mask["loss"])) > 1e-3
