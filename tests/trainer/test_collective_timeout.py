"""``trainer.collective_timeout_minutes`` reaches the process group's backend (DeepSpeed's default, 10
minutes, is shorter than the gap between ranks that generate different shares of long responses)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from _dist_utils import run_ranks
from stapo.config import STAPOConfig
from stapo.config.loading import ConfigError
from stapo.trainer.components import collective_timeout


def _backend_timeout() -> timedelta:
    """What the default group's gloo backend will wait for a collective."""
    import torch
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout


def _timeout_worker(out_dir, minutes=None, again=None, **_):
    import torch.distributed as dist

    from stapo.distributed.process_group import all_reduce_max, init_distributed

    info = init_distributed(timeout=timedelta(minutes=minutes) if minutes else None)
    out = {"first": _backend_timeout(), "world": info.world_size}
    if again:  # a group that already exists gets the timeout too
        init_distributed(timeout=timedelta(minutes=again))
        out["again"] = _backend_timeout()
    out["max"] = all_reduce_max(info.rank)  # the group still works
    dist.barrier()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_timeout_reaches_a_launched_group_and_an_existing_one(tmp_path):
    results = run_ranks(_timeout_worker, 2, tmp_path, kwargs={"minutes": 77, "again": 133}, timeout=120)
    for r in results:
        assert (r["world"], r["max"]) == (2, 1)
        assert r["first"] == timedelta(minutes=77) and r["again"] == timedelta(minutes=133)


@pytest.mark.distributed
@pytest.mark.slow
def test_timeout_reaches_a_single_process_group_and_defaults_to_deepspeeds(tmp_path):
    (set_,) = run_ranks(_timeout_worker, 1, tmp_path / "set", kwargs={"minutes": 45}, launcher=False, timeout=120)
    assert set_["first"] == timedelta(minutes=45)
    (default,) = run_ranks(_timeout_worker, 1, tmp_path / "default", launcher=False, timeout=120)
    from deepspeed.constants import default_pg_timeout

    assert default["first"] == default_pg_timeout  # DEEPSPEED_TIMEOUT, 10 minutes unless set


def test_config_field_is_read_and_checked():
    assert collective_timeout(STAPOConfig()) == timedelta(minutes=120)
    cfg = STAPOConfig.from_dict({}, ["trainer.collective_timeout_minutes=300"])
    assert collective_timeout(cfg) == timedelta(hours=5)
    with pytest.raises(ConfigError, match="trainer.collective_timeout_minutes must be >= 1, got 0"):
        STAPOConfig.from_dict({}, ["trainer.collective_timeout_minutes=0"])
