"""The trainer-vs-server check (stapo.serve.fingerprint): the same model and tokenizer agree; another
size, dtype or vocabulary is named by its first difference."""

from __future__ import annotations

import torch

from stapo.serve.fingerprint import first_difference, model_fingerprint, tokenizer_fingerprint


def fingerprint(config, tokenizer, dtype=torch.float32) -> dict:
    return {"model": model_fingerprint(config, dtype), "tokenizer": tokenizer_fingerprint(tokenizer)}


def test_the_same_model_and_tokenizer_agree_and_the_table_is_the_models(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config, tokenizer = AutoConfig.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = fingerprint(config, tokenizer)
    assert first_difference(ours, fingerprint(AutoConfig.from_pretrained(tiny_model_dir), tokenizer)) is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert ours["model"]["parameters"] == {n: list(p.shape) for n, p in model.named_parameters()}
    assert ours["tokenizer"]["vocab_size"] == len(tokenizer.get_vocab())


def test_the_first_difference_is_named(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    config, tokenizer = AutoConfig.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = fingerprint(config, tokenizer)
    wider = AutoConfig.from_pretrained(tiny_model_dir, intermediate_size=config.intermediate_size * 2)
    assert first_difference(ours, fingerprint(wider, tokenizer)) == \
        f"model config intermediate_size: trainer {config.intermediate_size}, server {config.intermediate_size * 2}"
    assert first_difference(ours, fingerprint(config, tokenizer, torch.bfloat16)) == \
        "weight dtype: trainer float32, server bfloat16"
    tokenizer.add_tokens(["<extra_token>"])
    other = fingerprint(config, tokenizer)
    assert first_difference(ours, other).startswith("tokenizer vocab_size: trainer ")
    other["tokenizer"]["vocab_size"] = ours["tokenizer"]["vocab_size"]  # same size, other tokens
    assert first_difference(ours, other).startswith("vocabulary (token -> id): trainer ")
    renamed = {**ours, "model": {**ours["model"], "parameters": {**ours["model"]["parameters"], "extra.weight": [1]}}}
    assert first_difference(ours, renamed) == "parameter extra.weight: trainer absent, server [1]"
