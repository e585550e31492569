"""`stapo train --dry-run` with the token-weighting masks: valid parameters pass, bad ones fail with a
message naming the parameter (the same check `stapo train` runs before building anything)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stapo.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "recipes" / "tiny_cpu.yaml")


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("overrides, summary", [
    (["mask.name=stare"], "mask: stare (variant='O1', top_p_ratio=0.1, reweight_w=1.1, reweight_m=0.9, "
                          "target_entropy=0.3, adaptive=False, alpha=0.01, w_max=1.5, m_min=0.5)"),
    (["mask.name=stare", "mask.params={variant: C2, adaptive: true}"], "variant='C2'"),
    (["mask.name=clip_cov"], "mask: clip_cov (ratio=0.0002, lb=1.0, ub=5.0)"),
])
def test_weighting_masks_validate(overrides, summary, capsys):
    code = main(["train", TINY, *overrides, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert summary in out


@pytest.mark.parametrize("overrides, message", [
    (["mask.name=stare", "mask.params={top_p_ratio: 0}"], "mask.params: stare top_p_ratio must be in (0, 1], got 0"),
    (["mask.name=stare", "mask.params={top_p_ratio: 1.5}"], "stare top_p_ratio must be in (0, 1], got 1.5"),
    (["mask.name=stare", "mask.params={variant: O3}"], "stare variant must be one of O1, C2, got 'O3'"),
    (["mask.name=stare", "mask.params={w_max: 0.5}"], "w_max >= 1"),
    (["mask.name=stare", "mask.params={gate: 0.3}"], "unknown parameter(s) ['gate'] for mask 'stare'"),
    (["mask.name=clip_cov", "mask.params={lb: 5, ub: 1}"], "clip_cov needs lb < ub, got lb=5.0, ub=1.0"),
    (["mask.name=clip_cov", "mask.params={ratio: 0}"], "clip_cov ratio must be in (0, 1], got 0"),
])
def test_bad_weighting_parameters_fail_with_a_clear_message(overrides, message, capsys):
    code = main(["train", TINY, *overrides, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and not out, err
