"""LoRA (PEFT) policies: merged-weight sync, reference = adapters disabled, frozen base, adapter-only
optimizer state, under ZeRO-3 on 2 gloo CPU ranks (docs/lora.md).

The tiny Qwen3 has odd sizes (hidden 15, vocab 63) so DeepSpeed's padded partitions are exercised;
``param_persistence_threshold=0`` partitions every tensor, adapters included, so a merged bucket
really is gathered (not read from a persistent replica).
"""

from __future__ import annotations

import pytest
import torch

from _dist_utils import run_ranks, tiny_qwen3
from stapo.config import ConfigError, STAPOConfig
from stapo.distributed.lora import (QWEN3_TARGET_MODULES, AdapterMerge, AdapterPair, DisabledAdapters, base_name,
                                reference_scope, wrap_with_lora)
from stapo.sync.buckets import StateDictConsumer, iter_weight_buckets, sync_weights

MODEL = dict(seed=3, vocab_size=63, hidden_size=15)
IDS = torch.arange(12).reshape(2, 6)


def _lora(seed: int = 0, rank: int = 4):
    return wrap_with_lora(tiny_qwen3(**MODEL), rank=rank, alpha=8.0, dropout=0.0,
                          target_modules=QWEN3_TARGET_MODULES, seed=seed)


def _perturb_adapters(model, seed: int = 1) -> None:
    """B starts at zero (the adapted policy IS the base): give it values so merging matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


# ---- pure pieces ----------------------------------------------------------------------------
def test_base_name_drops_the_peft_prefix_and_base_layer():
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert base_name("base_model.model.model.norm.weight") == "model.norm.weight"
    assert base_name("model.norm.weight") == "model.norm.weight"


def test_units_put_each_base_weight_with_its_adapter_in_order():
    names = ["emb", "q.base_layer.weight", "q.lora_A.default.weight", "q.lora_B.default.weight", "norm",
             "k.lora_A.default.weight", "k.base_layer.weight", "k.lora_B.default.weight"]
    pair = {x: AdapterPair(f"{x}.lora_A.default.weight", f"{x}.lora_B.default.weight", 2.0) for x in "qk"}
    merge = AdapterMerge({f"{x}.base_layer.weight": pair[x] for x in "qk"})
    # a unit sits where its first member is, even when an adapter precedes its base weight
    assert merge.units(names) == [[0], [1, 2, 3], [4], [5, 6, 7]]


def test_adapters_the_merge_cannot_express_are_refused():
    tied = wrap_with_lora(tiny_qwen3(**MODEL), rank=2, alpha=2.0, dropout=0.0, target_modules=["lm_head"], seed=0)
    with pytest.raises(ValueError, match="tied weight"):
        next(iter_weight_buckets(tied))
    embedding = wrap_with_lora(tiny_qwen3(**MODEL), rank=2, alpha=2.0, dropout=0.0, target_modules=["embed_tokens"],
                               seed=0)
    with pytest.raises(ValueError, match="Linear layer"):
        next(iter_weight_buckets(embedding))


def test_merge_is_w_plus_scaling_b_a_under_the_base_name():
    w, a, b = torch.ones(3, 2), torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [-1.0]])  # r = 1
    merge = AdapterMerge({"base_model.model.p.base_layer.weight": AdapterPair("A", "B", 0.5)})
    out = merge([("base_model.model.p.base_layer.weight", w), ("A", a), ("B", b), ("base_model.model.n", w[0])])
    assert [n for n, _ in out] == ["p.weight", "n"]
    # B @ A = [[1, 2], [0, 0], [-1, -2]]; W + 0.5 * BA:
    assert torch.equal(out[0][1], torch.tensor([[1.5, 2.0], [1.0, 1.0], [0.5, 0.0]]))


def test_lora_config_defaults_off_and_validates():
    cfg = STAPOConfig()
    assert not cfg.model.lora.enabled and cfg.model.lora.target_modules == list(QWEN3_TARGET_MODULES)
    on = STAPOConfig.from_dict({}, ["model.lora.enabled=true", "model.lora.rank=8", "model.lora.alpha=16"])
    assert (on.model.lora.rank, on.model.lora.alpha) == (8, 16.0)
    for bad, field in (("model.lora.rank=0", "rank"), ("model.lora.dropout=1", "dropout"),
                       ("model.lora.target_modules=[]", "target_modules"), ("model.lora.alpha=0", "alpha"),
                       ("model.lora.export_merged=true", "export_merged")):
        with pytest.raises(ConfigError, match=f"model.lora.{field}"):
            STAPOConfig.from_dict({}, [bad])
    with pytest.raises(ConfigError, match="unknown config key 'model.lora.rnak'"):
        STAPOConfig.from_dict({}, ["model.lora.rnak=4"])


# ---- single process: the PEFT model itself -------------------------------------------------
def test_only_adapters_train_and_wrapping_is_seeded_without_touching_the_rng():
    base = tiny_qwen3(**MODEL)  # (tiny_qwen3 seeds the global RNG itself)
    state = torch.get_rng_state()
    wrap_with_lora(base, rank=4, alpha=8.0, dropout=0.0, target_modules=QWEN3_TARGET_MODULES, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # the forked RNG leaves the caller's stream alone
    one, two = _lora(seed=5), _lora(seed=5)
    trainable = [n for n, p in one.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(QWEN3_TARGET_MODULES) * 2  # A and B, 7 projections, 2 layers
    for (n, p), (_, q) in zip(one.named_parameters(), two.named_parameters()):
        assert torch.equal(p, q), n  # same seed, same adapters on every rank
    assert not torch.equal(dict(one.named_parameters())[trainable[0]],
                           dict(_lora(seed=6).named_parameters())[trainable[0]])


@pytest.mark.parametrize("bucket_bytes", [1, 2048, 256 * 2**20])
def test_merged_sync_has_base_names_and_gives_the_peft_forward(bucket_bytes):
    model = _lora()
    _perturb_adapters(model)
    plain = tiny_qwen3(**{**MODEL, "seed": 99})  # different init: the sync must overwrite every weight
    buckets = list(iter_weight_buckets(model, bucket_bytes))
    names = [n for b in buckets for n, _ in b]
    assert names == [n for n, _ in tiny_qwen3(**MODEL).named_parameters()]  # base names, each once, in order
    if bucket_bytes == 1:  # one unit per bucket: a merged projection never lacks its adapter
        assert len(buckets) == len(names)
    sync_weights(model, StateDictConsumer(plain), bucket_bytes)
    peft_logits, merged_logits = model(input_ids=IDS).logits, plain(input_ids=IDS).logits
    base_logits = tiny_qwen3(**MODEL)(input_ids=IDS).logits
    assert (peft_logits - base_logits).abs().max() > 0.05  # the adapters matter ...
    torch.testing.assert_close(merged_logits, peft_logits, rtol=0, atol=2e-6)  # ... and merge exactly


def test_reference_is_the_base_model_and_adapters_come_back():
    model = _lora()
    _perturb_adapters(model)
    reference = DisabledAdapters(model)
    with reference_scope(reference) as ref:
        assert ref is model
        ref_logits = ref(input_ids=IDS).logits
    assert torch.equal(ref_logits, tiny_qwen3(**MODEL)(input_ids=IDS).logits)
    assert not torch.allclose(model(input_ids=IDS).logits, ref_logits)  # adapters on again
    plain = tiny_qwen3(**MODEL)
    with reference_scope(plain) as ref:  # a separate reference model passes through unchanged
        assert ref is plain
    with pytest.raises(TypeError, match="PEFT model"):
        DisabledAdapters(plain)


def test_gradient_checkpointing_gives_the_same_adapter_gradients():
    """The 8B/14B recipes checkpoint activations: with a frozen base and frozen embeddings the adapters
    must still get their gradients through the recomputed layers (non-reentrant checkpointing)."""
    from stapo.distributed.deepspeed_engine import _enable_activation_checkpointing
    from stapo.distributed.policy import PolicyInputs, response_token_stats

    prompt = torch.tensor([[5, 6, 7], [0, 8, 9]])
    inputs = PolicyInputs.from_parts(prompt, prompt > 0, torch.tensor([[10, 11, 12], [13, 14, 0]]),
                                     torch.tensor([[1, 1, 1], [1, 1, 0]]).bool())
    grads = []
    for checkpointing in (False, True):
        model = _lora()
        _perturb_adapters(model)  # B = 0 would leave A's gradient at exactly zero
        if checkpointing:
            _enable_activation_checkpointing(model)  # what build_engine does for model.gradient_checkpointing
        model.train()
        logprobs, _ = response_token_stats(model, inputs, temperature=1.0, chunk_size=4)
        logprobs.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(g.abs().sum() > 0 for g in grads[1].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


# ---- 2 ranks, ZeRO-3 -------------------------------------------------------------------------
def _full(module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().clone() for n, p in params}


def _train_steps(engine, steps: int) -> None:
    """A few real updates through the trainer's token-stats op (lm_head frozen, run as its forward)."""
    from stapo.distributed.deepspeed_engine import _enable_activation_checkpointing
    from stapo.distributed.policy import PolicyInputs, response_token_stats

    prompt = torch.tensor([[5, 6, 7], [0, 8, 9]])
    inputs = PolicyInputs.from_parts(prompt, prompt > 0, torch.tensor([[10, 11, 12], [13, 14, 0]]),
                                     torch.tensor([[1, 1, 1], [1, 1, 0]]).bool())
    for _ in range(steps):
        logprobs, _ = response_token_stats(engine.module, inputs, temperature=1.0, chunk_size=4)
        loss = -logprobs.sum()
        engine.backward(loss)
        engine.step()


def _zero3_worker(out_dir, **_):
    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import ZeroTuning, build_engine

    from test_weight_sync import _CountGathers

    init_distributed()
    out = {}
    for bf16 in (False, True):
        engine = build_engine(_lora(), lr=1e-2, warmup_steps=0, grad_accum_steps=1, bf16=bf16, zero_stage=3,
                              zero_tuning=ZeroTuning(param_persistence_threshold=0))
        before = _full(engine.module)
        _train_steps(engine, 3)
        after = _full(engine.module)
        flat = engine.optimizer.fp32_partitioned_groups_flat
        moments = [t for s in engine.optimizer.optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0]
        with _CountGathers() as gathers:
            buckets = [[(n, t.clone()) for n, t in b] for b in iter_weight_buckets(engine, 1)]
        plain = tiny_qwen3(**{**MODEL, "seed": 99}).to(torch.bfloat16 if bf16 else torch.float32)
        for bucket in buckets:
            StateDictConsumer(plain).load_weights(bucket)
        with torch.no_grad():
            peft_logits = engine.module(input_ids=IDS).logits.float()
            with DisabledAdapters(engine.module).active():
                ref_logits = engine.module(input_ids=IDS).logits.float()
        out[bf16] = dict(before=before, after=after, flat=sum(t.numel() for t in flat),
                         moments=sum(t.numel() for t in moments), n_gathers=gathers.count,
                         bucket_names=[[n for n, _ in b] for b in buckets], peft_logits=peft_logits,
                         merged_logits=plain(input_ids=IDS).logits.float().detach(), ref_logits=ref_logits)
    return out


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return run_ranks(_zero3_worker, 2, tmp_path_factory.mktemp("lora_zero3"), timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_zero3_trains_adapters_only_and_the_base_stays_bit_identical(zero3, bf16):
    for rank in zero3:
        got = rank[bf16]
        adapters = [n for n in got["before"] if ".lora_" in n]
        base = [n for n in got["before"] if ".lora_" not in n]
        assert all(torch.equal(got["before"][n], got["after"][n]) for n in base)
        assert all(not torch.equal(got["before"][n], got["after"][n]) for n in adapters if "lora_B" in n)
        # optimizer state: the fp32 master partition and two Adam moments cover the adapters only
        adapter_numel = sum(got["before"][n].numel() for n in adapters)
        assert adapter_numel / 2 <= got["flat"] <= adapter_numel / 2 + len(adapters)  # + partition padding
        assert got["moments"] == 2 * got["flat"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_zero3_merged_sync_is_one_gather_per_bucket_and_matches_the_peft_forward(zero3, bf16):
    expected_names = [n for n, _ in tiny_qwen3(**MODEL).named_parameters()]
    base_logits = tiny_qwen3(**MODEL).to(torch.bfloat16 if bf16 else torch.float32)(input_ids=IDS).logits.float()
    for rank in zero3:
        got = rank[bf16]
        assert [n for b in got["bucket_names"] for n in b] == expected_names  # no lora_A/B, no PEFT prefix
        assert got["n_gathers"] == len(got["bucket_names"])  # base + adapter in ONE collective
        # fp32: merged equals PEFT to float rounding; bf16: the merged weight is rounded to bf16 once,
        # PEFT rounds base and adapter outputs separately, both within bf16's resolution of the logits
        atol = 0.02 if bf16 else 2e-6  # bf16: logits ~0.3, bf16 spacing there 2e-3
        torch.testing.assert_close(got["merged_logits"], got["peft_logits"], rtol=0, atol=atol)
        assert (got["peft_logits"] - base_logits).abs().max() > 0.1  # the adapters did change the policy
        torch.testing.assert_close(got["ref_logits"], base_logits, rtol=0, atol=1e-6 if not bf16 else 1e-2)
