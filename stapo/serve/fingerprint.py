"""What a rollout server serves, compared with what the trainer trains (docs/rollout.md, "Faults").

A server with another model, dtype or tokenizer would take the weights badly or sample through another
vocabulary (the reward reads its detokenized text), so both sides compute this description and compare.
"""

from __future__ import annotations

import hashlib
import json

import torch

__all__ = ["first_difference", "model_fingerprint", "tokenizer_fingerprint"]

# config fields that decide the parameter table of a decoder-only HF model
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings")


def _parameter_table(config) -> dict[str, list[int]]:
    """Names and shapes of an HF causal LM of ``config`` ({} when transformers cannot build it)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  (remote code, an architecture this transformers lacks)
        return {}
    return {name: list(p.shape) for name, p in model.named_parameters()}


def model_fingerprint(config, dtype: torch.dtype | str) -> dict:
    """The model side, from an HF ``PretrainedConfig`` and the dtype the weights are held in."""
    return {
        "architectures": list(getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]),
        "config": {f: getattr(config, f, None) for f in SHAPE_FIELDS},
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": _parameter_table(config),
    }


def tokenizer_fingerprint(tokenizer) -> dict:
    """The tokenizer side (the pad id is left out: the trainer sets one where the tokenizer has none)."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {"vocab_size": len(vocab), "vocab_sha256": digest,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}


def first_difference(trainer: dict, server: dict) -> str | None:
    """``"<what>: trainer <a>, server <b>"`` for the first difference of two fingerprints, or None."""
    tm, sm = trainer["model"], server["model"]
    if tm["architectures"] != sm["architectures"]:
        return f"architecture: trainer {tm['architectures']}, server {sm['architectures']}"
    for field in SHAPE_FIELDS:
        if tm["config"].get(field) != sm["config"].get(field):
            return f"model config {field}: trainer {tm['config'].get(field)}, server {sm['config'].get(field)}"
    tp, sp = tm["parameters"], sm["parameters"]
    if tp and sp:
        for name in sorted(set(tp) | set(sp)):
            if tp.get(name) != sp.get(name):
                return (f"parameter {name}: trainer {tp.get(name, 'absent')}, server {sp.get(name, 'absent')}")
    if tm["dtype"] != sm["dtype"]:
        return f"weight dtype: trainer {tm['dtype']}, server {sm['dtype']}"
    tt, st = trainer["tokenizer"], server["tokenizer"]
    for key in ("vocab_size", "vocab_sha256", "bos_token_id", "eos_token_id"):
        if tt.get(key) != st.get(key):
            what = "vocabulary (token -> id)" if key == "vocab_sha256" else f"tokenizer {key}"
            return f"{what}: trainer {tt.get(key)}, server {st.get(key)}"
    return None
