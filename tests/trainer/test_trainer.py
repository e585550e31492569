"""STAPOTrainer end to end on the tiny model (single process, CPU, real DeepSpeed ZeRO-3).

A random tiny model answers everything wrong, so these runs use a reward that depends on the
sampled text (has the digit 1 or not): groups then have mixed rewards, non-zero advantages and
real updates. ``tau_p = 0.05`` makes the S2T condition bite on a near-uniform random policy.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from stapo.config import STAPOConfig
from stapo.losses import available_masks
from stapo.run_dir import read_metrics
from stapo.telemetry.metrics import OPTIONAL_METRIC_KEYS, STEP_METRIC_KEYS

from _rewards import alternating_reward, digit_one_reward

pytestmark = pytest.mark.slow


def tiny_config(tmp_path, model_dir, data, *extra: str) -> STAPOConfig:
    return STAPOConfig.from_yaml(None, [
        f"model.path={model_dir}", f"data.source={data}", f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=4",
        "rollout.group_size=4", "rollout.max_response_length=12", "trainer.total_steps=2",
        "optim.lr=1e-3", "optim.warmup_steps=0", "logging.progress=false", "logging.tensorboard=false",
        "trainer.save_every=0", "trainer.export_hf=false", "logging.plot=false", *extra,
    ])


@pytest.fixture
def isolated_process_group():
    """The first trainer sets up a 1-rank gloo group that DeepSpeed caches; later trainers in this
    process reuse it (a world of one: collectives are no-ops for every other test)."""
    yield


def _params(trainer) -> dict[str, torch.Tensor]:
    from stapo.sync.buckets import iter_weight_buckets

    return {name: t.clone() for bucket in iter_weight_buckets(trainer.model) for name, t in bucket}


@pytest.mark.parametrize("mask", ["none", "stapo", "prob_only", "high_entropy_low_prob", "entropy_top"])
def test_each_builtin_mask_trains(mask, tmp_path, tiny_model_dir, arithmetic_jsonl, isolated_process_group):
    from stapo import STAPOTrainer

    params = "{tau_p: 0.05}" if mask in ("stapo", "prob_only", "high_entropy_low_prob") else "{}"
    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, f"mask.name={mask}", f"mask.params={params}")
    trainer = STAPOTrainer(cfg, reward_fn=digit_one_reward)
    before = _params(trainer)
    trainer.train()
    after = _params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in STEP_METRIC_KEYS if k not in row]
        assert not missing, f"metrics.jsonl lacks {missing}"
        undocumented = set(row) - set(STEP_METRIC_KEYS) - set(OPTIONAL_METRIC_KEYS)
        assert not undocumented, f"metrics.jsonl logs keys missing from STEP_METRIC_KEYS: {undocumented}"
        # mask_tau_h is NaN exactly for masks that compute no entropy threshold
        no_tau_h = mask in ("none", "prob_only")
        assert math.isnan(row["mask_tau_h"]) == no_tau_h
        assert row["probe_tau_h"] > 0.0
        assert "mfu_update" not in row and row["tokens_per_s_update"] > 0  # CPU: no peak, no MFU
        bad = {k: row[k] for k in STEP_METRIC_KEYS if not math.isfinite(row[k]) and k != "mask_tau_h"}
        assert not bad, f"non-finite metrics: {bad}"
        assert 0.0 <= row["silenced_frac"] <= 1.0 and row["keep_frac"] == pytest.approx(1 - row["silenced_frac"])
    silenced = sum(r["silenced_frac"] for r in rows)
    if mask == "none":
        assert silenced == 0.0
    elif mask == "entropy_top":  # keeps the top 20% by entropy: silences ~80%
        assert 0.6 < silenced / len(rows) < 0.85
    else:
        assert silenced > 0.0, f"{mask} silenced nothing with tau_p = 0.05 on a random policy"


def test_a_user_mask_instance_overrides_the_config(tmp_path, tiny_model_dir, arithmetic_jsonl, isolated_process_group,
                                                  monkeypatch):
    from stapo import STAPOTrainer
    from stapo.losses import MASKS, TokenMask, TokenStats, register_mask

    monkeypatch.setitem(MASKS, "test_every_other_position", None)  # registered for this test only (undone after)

    @register_mask("test_every_other_position")
    class EveryOther(TokenMask):
        """Silences odd positions (a deliberately odd strategy)."""

        def silence(self, stats: TokenStats) -> torch.Tensor:
            positions = torch.arange(stats.logprobs.shape[1])
            return (positions % 2 == 1).expand_as(stats.logprobs)

    assert "test_every_other_position" in available_masks()
    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=1")
    trainer = STAPOTrainer(cfg, reward_fn=digit_one_reward, mask=EveryOther())
    trainer.train()
    row = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r][0]
    assert 0.3 < row["silenced_frac"] < 0.6


@pytest.mark.parametrize("zero_stage", [3, 0])
def test_non_finite_loss_skips_the_update_and_training_continues(
    zero_stage, tmp_path, tiny_model_dir, arithmetic_jsonl, isolated_process_group, monkeypatch
):
    from stapo import STAPOTrainer
    from stapo.trainer import update

    real = update.clipped_surrogate_loss
    calls = {"n": 0}

    def nan_on_first_call(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 1 else loss), metrics

    monkeypatch.setattr(update, "clipped_surrogate_loss", nan_on_first_call)
    # one mini-batch per step: the first step's only update is the poisoned one
    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "trainer.mini_batch_size=4",
                      f"trainer.zero_stage={zero_stage}")
    trainer = STAPOTrainer(cfg, reward_fn=alternating_reward())  # group_size 4: [+1, -1, +1, -1]
    before = _params(trainer)
    first = trainer.step()
    assert first["skipped_updates"] == 1.0 and first["skipped_steps"] == 1.0
    unchanged = _params(trainer)
    assert all(torch.equal(before[k], unchanged[k]) for k in before), "a skipped step changed weights"
    second = trainer.step()
    assert second["skipped_updates"] == 0.0 and math.isfinite(second["grad_norm"]) and second["grad_norm"] > 0
    after = _params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_consecutive_non_finite_steps_abort(tmp_path, tiny_model_dir, arithmetic_jsonl, isolated_process_group,
                                             monkeypatch):
    from stapo import STAPOTrainer
    from stapo.trainer import TrainingAborted, update

    real = update.clipped_surrogate_loss
    monkeypatch.setattr(update, "clipped_surrogate_loss",
                        lambda *a, **k: (lambda out: (out[0] * float("nan"), out[1]))(real(*a, **k)))
    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "trainer.max_consecutive_skips=2",
                      "trainer.total_steps=5")
    trainer = STAPOTrainer(cfg, reward_fn=digit_one_reward)
    with pytest.raises(TrainingAborted, match="2 consecutive steps"):
        trainer.train()


def test_export_reloads_with_the_trained_weights(tmp_path, tiny_model_dir, arithmetic_jsonl, isolated_process_group):
    from transformers import AutoModelForCausalLM

    from stapo import STAPOTrainer

    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "trainer.export_hf=true")
    trainer = STAPOTrainer(cfg, reward_fn=digit_one_reward)
    trainer.train()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    reference.load_state_dict(_params(trainer), strict=False)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, reference(ids).logits, atol=1e-6)
        original = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
        assert not torch.allclose(exported(ids).logits, original(ids).logits), "export equals the untrained model"


@pytest.mark.parametrize("resume", ["never", "auto"])
def test_a_fresh_start_moves_an_earlier_run_aside(resume, tmp_path, tiny_model_dir, arithmetic_jsonl):
    # The earlier run's rows must neither be appended to nor lost. With resume=auto a fresh start
    # happens when the earlier run left no complete checkpoint (killed before its first save).
    from stapo import STAPOTrainer
    from stapo.run_dir import PREVIOUS_RUNS_DIR

    first = STAPOTrainer(tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=1"),
                         reward_fn=digit_one_reward)
    first.train()
    run = tmp_path / "run"
    if resume == "auto":
        shutil.rmtree(run / "checkpoints")
    first_rows = (run / "metrics.jsonl").read_text()
    STAPOTrainer(tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=2",
                             f"trainer.resume={resume}"), reward_fn=digit_one_reward).train()
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2], "the new run's metrics.jsonl must hold only its own steps"
    (archive,) = (run / PREVIOUS_RUNS_DIR).iterdir()
    assert (archive / "metrics.jsonl").read_text() == first_rows
    assert (archive / "config.yaml").is_file()


def test_servers_gone_after_an_update_keep_its_metrics_row_with_its_checkpoint(
        tmp_path, tiny_model_dir, arithmetic_jsonl, isolated_process_group, monkeypatch):
    """The sync after step 2's update finds no rollout server (injected here; the lane kills a real
    one): the stop checkpoint holds step 2, and so does metrics.jsonl."""
    from stapo import STAPOTrainer
    from stapo.run_dir import latest_checkpoint, step_of
    from stapo.servers.pool import NoRolloutServers
    from stapo.trainer.rollouts import Rollouts

    real_sync = Rollouts.sync

    def sync_until_step_2(self, version):
        if version == 2:
            raise NoRolloutServers("no rollout server is left: none answers at the weight sync")
        return real_sync(self, version)

    monkeypatch.setattr(Rollouts, "sync", sync_until_step_2)
    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=3")
    with pytest.raises(NoRolloutServers):
        STAPOTrainer(cfg, reward_fn=digit_one_reward).train()
    run = tmp_path / "run"
    assert step_of(latest_checkpoint(run)) == 2
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2]
