"""The run directory's format module: artifact listing, record and checkpoint names, one-way imports."""

import subprocess
import sys

import pytest

from stapo.run_dir import (RUN_ARTIFACTS, checkpoint_name, complete_checkpoints, latest_checkpoint, step_of,
                           token_record_path, token_record_paths, written_artifacts)


def test_written_artifacts_lists_present_entries_in_order(tmp_path):
    assert written_artifacts(tmp_path) == []
    for name in ("final", "tensorboard"):
        (tmp_path / name).mkdir()
    (tmp_path / "curves.png").write_bytes(b"png")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "unrelated.txt").write_text("")  # not a run artifact
    # RUN_ARTIFACTS order, directories marked with a slash
    assert written_artifacts(tmp_path) == ["metrics.jsonl", "tensorboard/", "final/", "curves.png"]
    assert set(n.rstrip("/") for n in written_artifacts(tmp_path)) <= set(RUN_ARTIFACTS)


def test_token_record_paths_are_ordered_by_step_then_minibatch(tmp_path):
    paths = [token_record_path(tmp_path, 20), token_record_path(tmp_path, 3, 1), token_record_path(tmp_path, 3)]
    for p in paths:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"")
    (paths[0].parent / "step_000004.pt.tmp").write_bytes(b"")  # a half-written file is ignored
    assert [p.name for p in token_record_paths(tmp_path)] == ["step_000003.pt", "step_000003_mb1.pt",
                                                              "step_000020.pt"]
    assert token_record_paths(tmp_path / "nowhere") == []


def test_checkpoint_names_round_trip(tmp_path):
    assert checkpoint_name(40) == "step_40" and step_of(tmp_path / checkpoint_name(40)) == 40
    with pytest.raises(ValueError, match="step_<N>"):
        step_of(tmp_path / "latest")
    for step in (10, 2):  # complete once client_state.pt is in them
        (tmp_path / "checkpoints" / checkpoint_name(step)).mkdir(parents=True)
        (tmp_path / "checkpoints" / checkpoint_name(step) / "client_state.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "step_30").mkdir()  # incomplete
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_2", "step_10"]
    assert latest_checkpoint(tmp_path).name == "step_10"


def test_readers_of_a_run_do_not_import_the_trainer():
    # plotting, the inspector and the format module sit below stapo.trainer; run_dir needs no torch
    code = ("import sys, stapo.run_dir; heavy = [m for m in ('torch', 'stapo.trainer') if m in sys.modules]\n"
            "import stapo.plots, stapo.inspect.report, stapo.inspect.collect\n"
            "print(heavy, [m for m in sys.modules if m.startswith('stapo.trainer')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []", out
