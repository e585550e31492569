"""MFU arithmetic on hand-computed configs; the device table; throughput metric keys."""

import pytest
import torch

from stapo.telemetry.mfu import (causal_context_length, device_peak_flops, forward_flops, head_params, matmul_params,
                               phase_throughput)


def _small_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def test_matmul_params_by_hand():
    # attention per layer: q 64x(4*16)=4096, o 4096, k 64x(2*16)=2048, v 2048 -> 12,288
    # MLP per layer: gate, up, down 3 x 64 x 128 = 24,576; two layers: 2 x 36,864 = 73,728
    # lm_head 64 x 100 = 6,400 (counted although tied to the embedding) -> 80,128
    assert matmul_params(_small_config()) == 80_128


def test_matmul_params_equal_the_linear_weights_of_the_real_model():
    from transformers import Qwen3ForCausalLM

    config = _small_config()
    model = Qwen3ForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(config) == linear  # lm_head is an nn.Linear (tied weight, still a matmul)


def test_forward_flops_count_the_head_only_where_it_runs():
    # two sequences: prompt 3 + response 2 and prompt 4 + response 1 -> 10 real tokens, the head at the
    # 3 positions that predict a response token; causal pairs 5 x 6 / 2 + 5 x 6 / 2 = 30.
    # decoder matmuls 2 x (80,128 - 6,400) x 10 = 1,474,560; attention 2 x 2 x 2 layers x 4 heads x 16 x 30
    # = 15,360; head 2 x 6,400 x 3 = 38,400 -> 1,528,320 (the head on all 10 tokens would add 89,600)
    config = _small_config()
    assert head_params(config) == 64 * 100
    assert causal_context_length([5, 5]) * 10 == 30
    assert forward_flops(config, tokens=10, attn_pairs=30, head_tokens=3) == 1_528_320
    assert forward_flops(config, tokens=10, attn_pairs=30, head_tokens=10) == 1_528_320 + 2 * 6_400 * 7
    assert forward_flops(config, tokens=0, attn_pairs=0, head_tokens=0) == 0
    with pytest.raises(ValueError, match="counts must be >= 0"):
        forward_flops(config, tokens=-1, attn_pairs=0, head_tokens=0)


def test_qwen3_0p6b_shape_of_the_gpu_bench():
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    # per layer: 1024 x 128 x (2 x 16 + 2 x 8) = 6,291,456 + MLP 3 x 1024 x 3072 = 9,437,184 -> 15,728,640
    # 28 layers = 440,401,920; lm_head 1024 x 384 = 393,216 -> 440,795,136
    assert matmul_params(config) == 440_795_136


def test_missing_field_and_moe_are_refused():
    from transformers import PretrainedConfig

    with pytest.raises(ValueError, match="no 'hidden_size'"):
        matmul_params(PretrainedConfig())
    config = _small_config()
    config.num_experts = 8
    with pytest.raises(ValueError, match="mixture-of-experts"):
        forward_flops(config, 1.0, 1.0, 1.0)


def test_causal_context_length():
    assert causal_context_length([1, 3]) == 1.75  # (1 + (1 + 2 + 3)) / (1 + 3) = 7 / 4
    assert causal_context_length([4]) == 2.5  # (4 + 1) / 2
    assert causal_context_length([]) == 0.0


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835.5e12),
    ("NVIDIA H200", 989.4e12), ("NVIDIA H200 NVL", 835.5e12), ("NVIDIA GH200 480GB", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA B200", 2.25e15),
    ("NVIDIA GB200", 2.5e15), ("NVIDIA GeForce RTX 4090", None), ("cpu", None), (None, None), ("", None),
])
def test_device_peak_flops(name, peak):
    assert device_peak_flops(name) == peak


def test_phase_throughput_keys_and_values():
    # 1,000 tokens (165,376,000 forward FLOPs) in 2 s -> 500 tokens/s; MFU = 165,376,000 x 3 / (2 s x 1e9)
    # = 0.248064
    out = phase_throughput("update", tokens=1000, seconds=2.0, flops=165_376_000, peak=1e9, backward=True)
    assert out == {"tokens_per_s_update": 500.0, "mfu_update": pytest.approx(0.248064)}
    # no backward: a third of that; 2 devices: half
    stats = phase_throughput("stats", 1000, 2.0, 165_376_000, 1e9, backward=False, devices=2)
    assert stats["mfu_stats"] == pytest.approx(0.248064 / 3 / 2)
    # unknown peak (CPU): MFU absent, not 0
    assert phase_throughput("rollout", 300, 3.0, 1.0, None, backward=False) == {"tokens_per_s_rollout": 100.0}
    with pytest.raises(ValueError, match="seconds > 0"):
        phase_throughput("update", 10, 0.0, 1.0, None, backward=True)


def test_step_metrics_throughput_by_hand():
    # 2 ranks together: the update ran over 3,000 real tokens (150,000 attention pairs, the head at the
    # 1,000 response tokens) in 2 s; the stats phase over twice that (the policy and the reference) in 1 s.
    # A made-up peak of 1e12 FLOP/s per device.
    from transformers import Qwen3Config

    from stapo.telemetry.step_metrics import PhaseTimer, _throughput

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    timer = PhaseTimer()
    timer.seconds.update({"rollout": 4.0, "stats": 1.0, "update": 2.0})
    sums = {"real_tokens": 3000.0, "attn_pairs": 150_000.0, "head_tokens": 1000.0, "stats_tokens": 6000.0,
            "stats_attn_pairs": 300_000.0, "stats_head_tokens": 2000.0, "length_sum": 2000.0}
    out = _throughput(sums, timer, config, 1e12, world_size=2)
    # decoder matmul params: 2 layers x (attention 64 x 16 x (2 x 4 + 2 x 2) = 12,288 + MLP 3 x 64 x 128
    # = 24,576) = 73,728; head 64 x 128 = 8,192. Update forward: 2 x 73,728 x 3,000 = 442,368,000
    # + attention 2 x 2 x 2 x 4 x 16 x 150,000 = 76,800,000 + head 2 x 8,192 x 1,000 = 16,384,000
    # = 535,552,000; the stats phase is exactly twice that.
    update_flops = 535_552_000
    assert out["tokens_per_s_rollout"] == 500.0 and out["tokens_per_s_stats"] == 6000.0
    assert out["tokens_per_s_update"] == 1500.0 and "mfu_rollout" not in out
    assert out["mfu_stats"] == pytest.approx(2 * update_flops / (1.0 * 1e12 * 2))
    assert out["mfu_update"] == pytest.approx(3 * update_flops / (2.0 * 1e12 * 2))  # forward + backward = 3x
    assert "mfu_update" not in _throughput(sums, timer, config, None, world_size=2)  # CPU: absent, not 0


def test_token_counts_put_the_head_at_response_tokens_only():
    # rows: prompt 2 + response 3, prompt 1 + response 0 -> real 6; pairs 5 x 6 / 2 + 1 = 16; head at 3
    from types import SimpleNamespace

    from stapo.telemetry.step_metrics import stats_counts, token_counts

    seqs = SimpleNamespace(prompt_mask=torch.tensor([[1, 1], [0, 1]]).bool(),
                           response_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]).bool())
    assert token_counts(seqs, no_grad_passes=2) == {
        "real_tokens": 6.0, "attn_pairs": 16.0, "head_tokens": 3.0,
        "stats_tokens": 12.0, "stats_attn_pairs": 32.0, "stats_head_tokens": 6.0}
    assert stats_counts(seqs) == {"stats_tokens": 6.0, "stats_attn_pairs": 16.0, "stats_head_tokens": 3.0}
