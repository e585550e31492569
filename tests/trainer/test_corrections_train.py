"""Each off-policy correction trains through ``stapo train`` and logs verl's diagnostics every step.

The HF engine reports the sampler's log-probs under its processed distribution: with ``rollout.top_p``
below 1 the sampler renormalizes over the nucleus, so ``pi_sampler >= pi_old`` on every sampled token
and ``log r = log pi_old - log pi_sampler <= 0`` is a real, measurable mismatch (as vLLM's bf16 or a
stale policy would give), without vLLM. Each run: 2 iterations of the tiny sizes.
"""

from __future__ import annotations

import logging

import pytest

from stapo.cli import main
from stapo.inspect import load_records
from stapo.run_dir import METRICS_FILE, read_metrics

pytestmark = pytest.mark.slow

DIAGNOSTICS = ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size", "rollout_is_clipped_frac")
ALWAYS = ("mismatch_kl", "mismatch_kl_k1", "rollout_ppl", "training_ppl", "rejected_frac", "rejected_seq_frac",
          "silenced_frac")


@pytest.mark.parametrize("overrides, line", [
    (["loss.rollout_is=token", "loss.rollout_rs=seq_mean_k3", "loss.rollout_rs_threshold=0.00525"],
     "token-level importance weights pi_old/pi_sampler, truncated at 2; "
     "reject sequences unless seq_mean_k3 <= 0.00525"),
    (["loss.rollout_is=sequence", "loss.rollout_is_threshold=0.2_1.0", "loss.rollout_is_batch_normalize=true",
      "loss.rollout_rs=token_k1,seq_max_k2", "loss.rollout_rs_threshold=0.9_1.1101,0.05"],
     "sequence-level importance weights pi_old/pi_sampler, zero outside [0.2, 1], batch-normalized; reject tokens "
     "unless exp(token_k1) in [0.9, 1.1101]; reject sequences unless seq_max_k2 <= 0.05"),
    (["loss.rollout_is=token", "loss.rollout_is_threshold=1.5", "loss.rollout_rs=token_k3",
      "loss.rollout_rs_threshold=0.00525"],
     "token-level importance weights pi_old/pi_sampler, truncated at 1.5; reject tokens unless token_k3 <= 0.00525"),
], ids=["token_is+seq_mean_k3", "icepop_sequence+token_k1,seq_max_k2", "token_is_1.5+token_k3"])
def test_each_correction_trains_through_the_cli(overrides, line, tmp_path, tiny_model_dir, arithmetic_jsonl, caplog):
    out = tmp_path / "run"
    argv = ["train", f"model.path={tiny_model_dir}", f"data.source={arithmetic_jsonl}", f"trainer.output_dir={out}",
            "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=4",
            "rollout.group_size=4", "rollout.max_response_length=12", "rollout.top_p=0.9", "trainer.total_steps=2",
            "optim.lr=1e-3", "optim.warmup_steps=0", "logging.progress=false", "logging.tensorboard=false",
            "trainer.save_every=0", "trainer.export_hf=false", "logging.plot=false", "data.eval_size=4",
            "inspect.record_every=1", *overrides]
    with caplog.at_level(logging.INFO, logger="stapo.trainer"):
        assert main(argv) == 0
    assert f"off-policy correction: {line}" in caplog.text
    steps = [r for r in read_metrics(out / METRICS_FILE) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(key in r for key in DIAGNOSTICS + ALWAYS), sorted(r)
        assert r["mismatch_kl_k1"] > 1e-3 and r["mismatch_kl"] > 1e-4  # the nucleus: a real mismatch
        assert r["rollout_ppl"] < r["training_ppl"]  # the sampler is more confident than theta_old
        assert 0 < r["rollout_is_eff_sample_size"] <= 1 and r["rollout_is_max"] <= 1.0 + 1e-6  # r <= 1 here
        assert 0.0 <= r["rejected_frac"] <= 1.0 and (r["rejected_seq_frac"] > 0) == (r["rejected_frac"] > 0)
    rejected = [r["rejected_frac"] for r in steps]
    assert 0 < max(rejected) and min(rejected) < 1, rejected  # the filter cut through the batch
    records = load_records(out)  # the inspector sees the rejected tokens of each recorded mini-batch
    assert len(records) == 2 and any(r.rejected.any() for r in records)
