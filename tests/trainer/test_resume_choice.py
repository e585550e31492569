"""Which checkpoint ``trainer.resume`` continues (stapo.trainer.resume), on hand-built checkpoint dirs
laid out like DeepSpeed's (client_state.pt + zero/ shards written with torch.save)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stapo.trainer.resume import CheckpointUnreadable, checkpoint_problem, choose_checkpoint


def _checkpoint(out: Path, step: int, world_size: int = 2, ranks=None) -> Path:
    path = out / "checkpoints" / f"step_{step}"
    (path / "zero").mkdir(parents=True)
    torch.save({"world_size": world_size, "step": step}, path / "client_state.pt")
    for rank in range(world_size) if ranks is None else ranks:
        for kind in ("model", "optim"):
            torch.save({"w": torch.ones(64)}, path / "zero" / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
    (out / "checkpoints" / "latest").write_text(path.name)
    return path


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_an_intact_checkpoint_has_no_problem_and_each_damage_is_named(tmp_path):
    good = _checkpoint(tmp_path, 1)
    assert checkpoint_problem(good, 2) is None
    assert checkpoint_problem(good, 4) == "saved with 2 rank(s), this run has 4: resume with the same number of ranks"
    missing = _checkpoint(tmp_path, 2, ranks=[0])
    assert checkpoint_problem(missing, 2) == \
        "zero/zero_pp_rank_N_mp_rank_00_model_states.pt: the shard(s) of rank(s) [1] are missing"
    cut = _checkpoint(tmp_path, 3)
    _truncate(cut / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert checkpoint_problem(cut, 2).startswith("zero/zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated")
    _truncate(cut / "client_state.pt")
    assert checkpoint_problem(cut, 2).startswith("client_state.pt cannot be read")


def test_auto_skips_unreadable_checkpoints_for_the_newest_intact_one(tmp_path):
    older = _checkpoint(tmp_path, 4)
    newer = _checkpoint(tmp_path, 6, ranks=[0])  # `latest` names it
    newest_unnamed = _checkpoint(tmp_path, 8)
    _truncate(newest_unnamed / "zero" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (tmp_path / "checkpoints" / "latest").write_text(newer.name)
    choice = choose_checkpoint(tmp_path, "auto", 2)
    assert choice.path == older
    assert [p for p, _ in choice.skipped] == [newer, newest_unnamed]  # latest first, then newest to oldest
    assert all(p.exists() for p in (older, newer, newest_unnamed))  # nothing deleted


def test_a_named_checkpoint_fails_with_its_reason_and_none_left_lists_them_all(tmp_path):
    broken = _checkpoint(tmp_path, 2, ranks=[1])
    with pytest.raises(CheckpointUnreadable, match=rf"trainer.resume: checkpoint {broken} cannot be resumed: "
                                                   r".*rank\(s\) \[0\] are missing"):
        choose_checkpoint(tmp_path, str(broken), 2)
    with pytest.raises(CheckpointUnreadable, match=rf"no checkpoint under .* can be resumed \({broken}: .*\)"
                                                   r".*trainer.resume=never starts over"):
        choose_checkpoint(tmp_path, "auto", 2)
    assert choose_checkpoint(tmp_path, "never", 2).path is None
    assert choose_checkpoint(tmp_path / "fresh", "auto", 2).path is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        choose_checkpoint(tmp_path, str(tmp_path / "nowhere"), 2)
