"""`stapo eval` on a LoRA adapter directory (docs/lora.md): every engine loads plain model directories, so the
adapter is merged into its base model (PEFT's ``merge_and_unload``) in a temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Iterator

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | Path) -> bool:
    """A PEFT adapter directory that is not also a full model directory."""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model an adapter was trained on (its ``base_model_name_or_path``)."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return base


@contextlib.contextmanager
def loadable_model_dir(path: str | Path) -> Iterator[Path]:
    """``path`` itself for a model directory; for an adapter directory, a temporary directory with the
    merged model and the adapter directory's tokenizer (the base's when it has none), removed on exit."""
    path = Path(path)
    if not is_adapter_dir(path):
        yield path
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapo.distributed.lora import require_peft

    peft = require_peft()
    base = adapter_base(path)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = peft.PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    has_tokenizer = (path / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(path) if has_tokenizer else base)
    with tempfile.TemporaryDirectory(prefix="stapo-merged-adapter-") as tmp:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        yield Path(tmp)
