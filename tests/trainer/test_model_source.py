"""model.path: built-in, local directory, HF cache or hub; one clear error, offline, before any weights load."""

import pytest

from stapo.cli import main
from stapo.trainer.model_source import model_source, require_model, unavailable_reason

NOT_CACHED = "stapo-tests/no-such-model"  # a valid hub name that no cache holds


def test_sources_are_classified_from_the_disk_alone(tmp_path):
    assert model_source("builtin:tiny").kind == "builtin"
    (tmp_path / "config.json").write_text("{}")
    assert model_source(str(tmp_path)).kind == "local"
    assert model_source(NOT_CACHED).kind == "hub"
    with pytest.raises(ValueError, match="not a Hugging Face model directory \\(no config.json\\)"):
        model_source(str(tmp_path.parent))
    with pytest.raises(ValueError, match="no such directory, and not a hub model name"):
        model_source(str(tmp_path / "no" / "such" / "dir"))


def test_an_uncached_hub_name_offline_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touches the network, so it cannot hang
    with pytest.raises(ValueError) as raised:
        require_model(NOT_CACHED)
    message = str(raised.value)
    assert message == unavailable_reason(model_source(NOT_CACHED))
    for part in (f"model.path {NOT_CACHED!r}", "local model directory", "HF_HUB_OFFLINE=1",
                 f"hf download {NOT_CACHED}"):
        assert part in message, message


def test_train_stops_with_that_message_before_loading_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", f"model.path={NOT_CACHED}", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"stapo train: error: model.path {NOT_CACHED!r}"), err
    assert "HF_HUB_OFFLINE is set" in err
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing of a run was written
