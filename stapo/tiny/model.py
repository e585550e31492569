"""Random-init tiny Qwen3 models for offline demos and tests: the real ``Qwen3ForCausalLM`` architecture at a
few hundred thousand to a few million parameters, so every trainer code path runs unchanged on a CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from stapo.tiny.cache import build_cached, hash_files
from stapo.tiny.tokenizer import VOCAB_SIZE, build_tiny_tokenizer


@dataclass(frozen=True)
class TinySpec:
    """Qwen3 hyper-parameters of a tiny model, named and meant as in ``transformers.Qwen3Config`` (GQA, tied
    embeddings as the small Qwen3 models); the vocabulary comes from the tiny tokenizer."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"TinySpec.{f.name} must be > 0, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinySpec.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


def _write_model(out_dir: Path, spec: TinySpec, seed: int, tokenizer_dir: Path | None = None) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or build_tiny_tokenizer()))
    config = Qwen3Config(vocab_size=len(tokenizer), **dataclasses.asdict(spec), bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         torch_dtype="float32")
    # A private generator state: seed the global RNG only inside a fork so callers' RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def build_tiny_model(out_dir: Path | None = None, *, spec: TinySpec = TinySpec(), seed: int = 0,
                     tokenizer_dir: Path | None = None) -> Path:
    """A random-init tiny Qwen3 model dir, deterministic for ``(spec, seed)``; ``out_dir=None`` reuses a cache
    entry keyed by both and by ``tokenizer_dir``'s files (``stapo.tiny.cache``).
    """
    if not isinstance(spec, TinySpec):
        raise TypeError(f"spec must be a TinySpec, got {type(spec).__name__}")

    def build(tmp: Path) -> None:
        _write_model(tmp, spec, seed, tokenizer_dir)

    payload = {"spec": dataclasses.asdict(spec), "seed": seed, "tokenizer_vocab": VOCAB_SIZE}
    if tokenizer_dir is not None:
        tok = Path(tokenizer_dir)
        payload["tokenizer"] = hash_files(tok, sorted(f.name for f in tok.iterdir() if f.is_file()))
    return build_cached(out_dir, "model", payload, build)


def model_fingerprint(model_dir: Path) -> str:
    """sha256 of a model dir's config and weights (keys derived artifacts such as warm starts)."""
    model_dir = Path(model_dir)
    names = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors"))
    if "config.json" not in names:
        raise FileNotFoundError(f"{model_dir} is not a model dir: no config.json")
    return hash_files(model_dir, names)

