"""Attention over packed rows: the ``auto`` choice, and what flex/flash are given (stapo.distributed.attention).

The kernels themselves run on CPU only for flex's forward; forward + backward of flex and flash against
sdpa are in tests/gpu/test_attention_gpu.py.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from _batches import ragged_rows
from stapo.config import STAPOConfig
from stapo.distributed import attention
from stapo.distributed.attention import (choose_attention, document_causal_block_mask, document_ids,
                                         flash_varlen_kwargs, packed_attention_kwargs)
from stapo.distributed.policy import response_token_stats, teacher_forced_inputs
from stapo.trainer.components import update_options

BF16, FP32 = torch.bfloat16, torch.float32


def test_auto_is_sdpa_on_cpu_and_explicit_choices_pass_through():
    assert not torch.cuda.is_available()  # this suite runs on CPU; tests/gpu covers CUDA
    assert choose_attention("auto", dtype=FP32) == "sdpa"
    assert choose_attention("auto", dtype=BF16, cuda=False) == "sdpa"
    for name in ("sdpa", "eager", "flash_attention_2"):
        assert choose_attention(name, dtype=FP32) == name
    assert choose_attention("flex_attention", dtype=BF16, cuda=True, capability=(9, 0)) == "flex_attention"
    with pytest.raises(ValueError, match="flex_attention needs a CUDA GPU .* no backward"):
        choose_attention("flex_attention", dtype=FP32)


@pytest.mark.parametrize("capability, dtype, packages, flex, chosen", [
    ((9, 0), BF16, {"flash-attn-3", "flash-attn"}, True, "flash_attention_3"),  # Hopper: FA3 first
    ((9, 0), BF16, {"flash-attn"}, True, "flash_attention_2"),
    ((8, 0), BF16, {"flash-attn-3", "flash-attn"}, True, "flash_attention_2"),  # FA3 is Hopper-only
    ((8, 0), torch.float16, {"flash-attn"}, True, "flash_attention_2"),
    ((7, 5), BF16, {"flash-attn"}, True, "flex_attention"),  # FA2 needs Ampere or newer
    ((9, 0), FP32, {"flash-attn-3", "flash-attn"}, True, "flex_attention"),  # flash: half precision only
    ((9, 0), BF16, set(), True, "flex_attention"),
    ((9, 0), BF16, set(), False, "sdpa"),  # no Triton: nothing block-sparse runs
])
def test_auto_on_cuda_follows_what_is_installed(capability, dtype, packages, flex, chosen):
    assert choose_attention("auto", dtype=dtype, cuda=True, capability=capability,
                            installed=packages.__contains__, flex_on_cuda=lambda: flex) == chosen


def test_auto_reads_this_machines_gpu_and_packages(monkeypatch):
    # the default probes, with CUDA, a Hopper GPU and flash-attn mocked in
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    real = importlib.metadata.distribution

    def distribution(name):
        return object() if name == "flash-attn" else real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert choose_attention("auto", dtype=BF16) == "flash_attention_2"
    cfg = STAPOConfig.from_yaml(None, ["model.dtype=bf16", "trainer.zero_stage=1"])
    assert update_options(cfg).pack_one_row  # flash: a micro-batch is one packed row
    monkeypatch.setattr(importlib.metadata, "distribution", real)
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)  # no Triton, no flex
    assert choose_attention("auto", dtype=BF16) == "sdpa"


def test_the_default_is_auto_and_packs_rows_for_sdpa_on_cpu():
    from stapo.trainer.preflight import _attention_line

    cfg = STAPOConfig()
    assert cfg.model.attn_implementation == "auto"
    assert not update_options(cfg).pack_one_row  # sdpa: rows as wide as the longest sequence
    assert _attention_line(cfg) == "model.attn_implementation: auto -> sdpa on this machine"  # the dry run's line
    flex = STAPOConfig.from_yaml(None, ["model.attn_implementation=flex_attention"])
    assert _attention_line(flex).startswith("model.attn_implementation: flex_attention (not on this machine: ")


def test_document_ids_and_flash_arguments_by_hand():
    # row 0: sequences of 3 and 2 tokens; row 1: 4 tokens and a 1-token tail
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    assert document_ids(positions).tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    kwargs = flash_varlen_kwargs(positions)  # the rows flattened: starts 0, 3, 5, 9 and the end, 10
    assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 3, 5, 9, 10]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4
    assert packed_attention_kwargs("sdpa", positions) == {"attention_mask": None}
    assert packed_attention_kwargs("flash_attention_2", positions)["max_length_q"] == 4


def _tiles(num, index):
    """A BlockMask's (num_blocks, indices) as a bool (R, 1, n, n) tile table."""
    dense = torch.zeros(*index.shape, dtype=torch.bool)
    for r, q in torch.cartesian_prod(torch.arange(index.shape[0]), torch.arange(index.shape[2])).tolist():
        dense[r, 0, q, index[r, 0, q, : num[r, 0, q]].long()] = True
    return dense


@pytest.mark.parametrize("length, block", [(405, 16), (128, 16), (37, 8)])
def test_block_mask_tiles_equal_torchs_create_block_mask(length, block):
    # two rows of random sequence lengths (the last may end inside a tile): the tile table built from the
    # document boundaries equals the one torch derives from the dense mask, partial and full tiles alike
    gen = torch.Generator().manual_seed(length)
    rows = []
    for _ in range(2):
        positions = []
        while len(positions) < length:
            positions += range(int(torch.randint(1, 60, (1,), generator=gen)))
        rows.append(positions[:length])
    doc = document_ids(torch.tensor(rows))
    ours = document_causal_block_mask(doc, block=block)
    ref = create_block_mask(lambda b, h, q, k: (doc[b, q] == doc[b, k]) & (q >= k), 2, 1, length, length,
                            device="cpu", BLOCK_SIZE=block)
    assert ours.shape == ref.shape == (2, 1, length, length)
    assert torch.equal(_tiles(ours.kv_num_blocks, ours.kv_indices), _tiles(ref.kv_num_blocks, ref.kv_indices))
    assert torch.equal(_tiles(ours.full_kv_num_blocks, ours.full_kv_indices),
                       _tiles(ref.full_kv_num_blocks, ref.full_kv_indices))
    assert ours.full_kv_num_blocks.sum() > 0  # long sequences: whole tiles are skipped by the mask function
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    assert torch.equal(ours.mask_mod(torch.tensor(1), 0, q, k), (doc[1][:, None] == doc[1][None, :]) & (q >= k))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _flex_stats(model, inputs, monkeypatch):
    """Stats under flex_attention, counting block-mask builds and what each attention layer received."""
    built, seen = [], []
    build = attention.document_causal_block_mask
    monkeypatch.setattr(attention, "document_causal_block_mask", lambda doc: built.append(build(doc)) or built[-1])
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["attention_mask"]),
                                                       with_kwargs=True) for layer in model.model.layers]
    model.set_attn_implementation("flex_attention")
    try:
        with torch.no_grad():
            return response_token_stats(model, inputs, temperature=0.7, chunk_size=16), built, seen
    finally:
        model.set_attn_implementation("sdpa")
        for h in hooks:
            h.remove()


def _check_flex_equals_sdpa(model, monkeypatch):
    parts = ragged_rows([3, 5, 4, 6, 2, 5, 1], [7, 2, 9, 5, 10, 1, 3], seed=2)
    inputs = teacher_forced_inputs(*parts, packed=True, one_row=True)
    with torch.no_grad():  # sdpa on the same packed row (its dense block-diagonal mask)
        ref_lp, ref_h = response_token_stats(model, inputs, temperature=0.7, chunk_size=16)
    (lp, h), built, seen = _flex_stats(model, inputs, monkeypatch)
    assert len(built) == 1 and len(seen) == len(model.model.layers) == 4  # ONE mask for the micro-batch
    assert all(m is built[0] for m in seen)  # ... handed to every layer
    assert (lp - ref_lp).abs().max() <= 1e-5 and (h - ref_h).abs().max() <= 1e-5
    assert (lp != 0).sum() == parts[3].sum()  # every response token has a (nonzero) logprob


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_on_packed_rows_equals_sdpa_with_one_mask_for_every_layer(model, monkeypatch):
    # flex's unfused reference path (no compilation: seconds); the compiled kernel is the slow test below
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", lambda q, k, v, training, **kw: flex_attention(
        q, k, v, **kw))
    _check_flex_equals_sdpa(model, monkeypatch)


@pytest.mark.slow
def test_compiled_flex_kernel_on_packed_rows_equals_sdpa(model, monkeypatch):
    # the CPU kernel torch.compile generates from the block mask (10-20 s to compile on 2 cores: slow)
    _check_flex_equals_sdpa(model, monkeypatch)
