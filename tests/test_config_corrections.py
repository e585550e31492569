"""The off-policy correction's settings (``loss.rollout_*``): ``auto`` resolved by one property, the removed
``loss.tis_cap`` named with its replacement, bad values named, and what ``stapo train --dry-run`` says."""

from __future__ import annotations

from pathlib import Path

import pytest

from stapo.cli import main
from stapo.config import ConfigError, STAPOConfig

TINY = str(Path(__file__).resolve().parents[1] / "examples" / "recipes" / "tiny_cpu.yaml")
ASYNC = ["rollout.mode=server", "rollout.server.addresses=[127.0.0.1:9]", "rollout.max_staleness=2"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)


def _resolved(*overrides: str) -> dict:
    return STAPOConfig.from_dict({}, list(overrides)).rollout_correction


def test_auto_is_token_is_when_asynchronous_and_off_in_lock_step():
    assert STAPOConfig.from_dict({}).loss.rollout_is == "auto"  # the field keeps what the user wrote
    assert _resolved()["rollout_is"] is None  # lock-step: the paper's setting
    assert _resolved(*ASYNC)["rollout_is"] == "token"
    assert _resolved(*ASYNC)["rollout_is_threshold"] == 2.0
    assert _resolved(*ASYNC, "loss.rollout_is=null")["rollout_is"] is None  # turned off explicitly
    assert _resolved(*ASYNC, "loss.rollout_is=sequence")["rollout_is"] == "sequence"
    assert _resolved("loss.rollout_is=token")["rollout_is"] == "token"  # lock-step, asked for


def test_tis_cap_is_gone_and_names_its_replacement(capsys):
    code = main(["train", TINY, "loss.tis_cap=3", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and not out and err.strip().count("\n") == 0, err  # one line
    assert "loss.tis_cap=3 was removed: write loss.rollout_is=token loss.rollout_is_threshold=3" in err
    # a run directory's config.yaml written before holds `tis_cap: null` (off): it still loads, unchanged
    old = STAPOConfig.from_dict({"loss": {"tis_cap": None}, "rollout": {"tools": {"call_penalty": 0.0}}})
    assert old.rollout_correction == STAPOConfig.from_dict({}).rollout_correction


@pytest.mark.parametrize("overrides, message", [
    (["loss.rollout_is=geometric"], "loss.rollout_is must be one of ['auto', 'token', 'sequence', null]"),
    (["loss.rollout_rs=seq_mean_k3"], "loss.rollout_rs=seq_mean_k3 needs rollout_rs_threshold"),
    (["loss.rollout_rs=seq_mean_k4", "loss.rollout_rs_threshold=1"], "loss.rollout_rs: unknown option 'seq_mean_k4'"),
    # YAML reads 0.5_2 as the number 0.52: a single k1 bound below 1 leaves an empty band, named
    (["loss.rollout_rs=token_k1", "loss.rollout_rs_threshold=0.5_2"], "gives the band [1.92308, 0.52], empty"),
    (["loss.rollout_is=token", "loss.rollout_is_threshold=2.0_0.5"], "loss.rollout_is_threshold: the band"),
    (["loss.rollout_is_batch_normalize=true"], "loss.rollout_is_batch_normalize normalizes importance weights"),
])
def test_bad_settings_are_one_line_errors(overrides, message, capsys):
    code = main(["train", TINY, *overrides, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and not out, err


def test_the_dry_run_says_what_is_corrected_and_why(capsys):
    assert main(["train", TINY, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "off-policy correction: none (loss.rollout_is=auto: no importance weights in lock-step" in out
    assert main(["train", TINY, *ASYNC, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "\n  rollout_is: auto\n" in out  # the resolved config shows the setting; the summary its meaning
    assert ("off-policy correction: token-level importance weights pi_old/pi_sampler, truncated at 2 (importance "
            "weights on by default with rollout.max_staleness=2; loss.rollout_is=null turns them off)") in out
    assert main(["train", TINY, *ASYNC, "loss.rollout_is=null", "loss.rollout_rs=seq_mean_k3",
                 "loss.rollout_rs_threshold=0.01", "--dry-run"]) == 0
    assert "off-policy correction: reject sequences unless seq_mean_k3 <= 0.01\n" in capsys.readouterr().out
