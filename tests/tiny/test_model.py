import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from stapo.tiny import TinySpec, build_tiny_model
from stapo.tiny.cache import build_atomically

SMALL = TinySpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)


def _digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_loads_with_auto_classes(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    n = sum(p.numel() for p in model.parameters())
    assert n < 5_000_000
    ids = tok("1+2=3", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_same_bytes_twice_and_seed_matters(tmp_path):
    a = build_tiny_model(tmp_path / "a", spec=SMALL, seed=1)
    b = build_tiny_model(tmp_path / "b", spec=SMALL, seed=1)
    c = build_tiny_model(tmp_path / "c", spec=SMALL, seed=2)
    assert "model.safetensors" in _digests(a) and "generation_config.json" in _digests(a)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", spec=SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_cache_is_keyed_and_reused(_tiny_cache):
    first = build_tiny_model(spec=SMALL, seed=5)
    assert first.parent == _tiny_cache / "tiny"
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(spec=SMALL, seed=5) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert build_tiny_model(spec=SMALL, seed=6) != first


def test_failed_build_leaves_nothing(tmp_path):
    def broken(tmp):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        build_atomically(tmp_path / "final", broken, reuse=True)
    assert list(tmp_path.iterdir()) == []


def test_spec_validation():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TinySpec(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        TinySpec(hidden_size=0)
