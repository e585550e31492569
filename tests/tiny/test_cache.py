"""Cache entries copied between machines (the trainer sends rank 0's tiny model to node-local caches)."""

import pytest

from stapo.tiny.cache import cache_root, entry_files, install_entry


def test_an_installed_entry_has_the_same_bytes_and_loads(tiny_model_dir, tmp_path, monkeypatch):
    files = entry_files(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    monkeypatch.setenv("STAPO_CACHE", str(tmp_path / "other_node"))  # another node's empty cache
    installed = install_entry(tiny_model_dir.name, files)
    assert installed == cache_root() / tiny_model_dir.name != tiny_model_dir
    assert entry_files(installed) == files
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(installed))  # a complete model directory
    (installed / "config.json").write_text("{}")  # an entry of that name exists: reused, not rewritten
    assert install_entry(tiny_model_dir.name, files) == installed and (installed / "config.json").read_text() == "{}"


def test_only_flat_entries_are_copied(tmp_path):
    (tmp_path / "entry" / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"not a flat cache entry: \['sub'\]"):
        entry_files(tmp_path / "entry")
