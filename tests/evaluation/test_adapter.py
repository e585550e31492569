"""`stapo eval` on a LoRA adapter directory: merged into its base model, it evaluates exactly like the
merged model saved by hand (same responses, same scores)."""

from __future__ import annotations

import json

import pytest
import torch

from stapo.evaluation import PAPER_SETTINGS, check_model_dir, evaluate_model, local_benchmark
from stapo.evaluation.adapter import adapter_base, is_adapter_dir, loadable_model_dir


@pytest.fixture()
def adapter_and_merged(tiny_model_dir, tiny_tokenizer, tmp_path):
    """A rank-4 adapter with random B on the tiny model (PEFT's own files) and its merge, by PEFT."""
    from transformers import AutoModelForCausalLM

    from stapo.distributed.lora import QWEN3_TARGET_MODULES, wrap_with_lora

    model = wrap_with_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), rank=4, alpha=8.0,
                           dropout=0.0, target_modules=QWEN3_TARGET_MODULES, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    model.save_pretrained(str(adapter))
    tiny_tokenizer.save_pretrained(str(adapter))
    model.merge_and_unload().save_pretrained(str(merged))
    tiny_tokenizer.save_pretrained(str(merged))
    return adapter, merged


def test_an_adapter_dir_evaluates_as_its_merged_model(adapter_and_merged, arithmetic_file, tiny_model_dir, tmp_path):
    adapter, merged = adapter_and_merged
    assert is_adapter_dir(adapter) and not is_adapter_dir(merged)
    assert check_model_dir(adapter) == adapter and adapter_base(adapter) == str(tiny_model_dir)
    preset = local_benchmark(arithmetic_file, name="arith")
    reports = [evaluate_model(path, [preset], settings=PAPER_SETTINGS[:1], num_samples=2, max_new_tokens=12,
                              engine="hf", seed=3, cache_dir=tmp_path / "hf") for path in (adapter, merged)]
    assert reports[0].results[0].responses == reports[1].results[0].responses
    assert reports[0].results[0].correct_counts.tolist() == reports[1].results[0].correct_counts.tolist()
    base = evaluate_model(tiny_model_dir, [preset], settings=PAPER_SETTINGS[:1], num_samples=2, max_new_tokens=12,
                          engine="hf", seed=3, cache_dir=tmp_path / "hf")
    assert base.results[0].responses != reports[0].results[0].responses  # the adapter was applied


def test_an_adapter_without_a_base_is_a_clear_error(adapter_and_merged):
    adapter, _ = adapter_and_merged
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names no base model"):
        with loadable_model_dir(adapter):
            pass
