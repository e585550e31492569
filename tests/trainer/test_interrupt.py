"""Ctrl-C / SIGTERM stop at a step boundary with a checkpoint (stapo.trainer.interrupt): the flag, its
agreement across ranks, and a 2-rank run where only one rank gets the signal."""

from __future__ import annotations

import os
import signal

import pytest

from stapo.trainer.interrupt import RunInterrupted, StopRequest, stop_on_signals


def test_a_signal_only_sets_the_flag_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as stop:
        assert stop.signal_name is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this thread before kill returns to Python code
        assert stop.signal_name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM changes nothing
        with pytest.raises(KeyboardInterrupt):  # but a Ctrl-C after it stops at once
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_any_rank_stopping_stops_all_with_the_same_signal():
    stop = StopRequest()
    assert stop.agreed(lambda mine: [mine, None]) is None
    assert stop.agreed(lambda mine: [mine, "SIGTERM"]) == "SIGTERM"  # rank 1 got it, rank 0 did not (yet)
    interrupted = RunInterrupted("SIGTERM", 3, None)
    assert interrupted.exit_status == 143 and RunInterrupted("SIGINT", 3, None).exit_status == 130
    assert str(interrupted) == "SIGTERM at step 3: nothing to save yet"


def _one_rank_signalled(out_dir, model_dir, data):
    """Rank 1 sends itself SIGTERM during step 1; rank 0 never gets one."""
    from _rewards import digit_one_reward

    from stapo import STAPOConfig, STAPOTrainer
    from stapo.distributed.process_group import get_rank

    cfg = STAPOConfig.from_yaml(None, [
        f"model.path={model_dir}", f"data.source={data}", f"trainer.output_dir={out_dir}/run",
        "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=4",
        "rollout.group_size=2", "rollout.max_response_length=8", "trainer.total_steps=4",
        "trainer.save_every=0", "logging.progress=false", "logging.tensorboard=false",
        "trainer.export_hf=false", "logging.plot=false"])
    trainer = STAPOTrainer(cfg, reward_fn=digit_one_reward)
    step = trainer.step

    def step_and_signal():
        metrics = step()
        if get_rank() == 1 and trainer.step_count == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    trainer.step = step_and_signal
    try:
        trainer.train()
    except RunInterrupted as stop:
        return {"signal": stop.signal_name, "step": stop.step, "checkpoint": str(stop.checkpoint)}
    return {"signal": None}


@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_signalled_stops_both_at_the_same_step_with_one_checkpoint(tmp_path, tiny_model_dir,
                                                                           arithmetic_jsonl):
    from _dist_utils import run_ranks

    results = run_ranks(_one_rank_signalled, 2, tmp_path, timeout=420,
                        kwargs={"model_dir": str(tiny_model_dir), "data": str(arithmetic_jsonl)})
    checkpoint = tmp_path / "ranks__one_rank_signalled" / "run" / "checkpoints" / "step_1"
    assert results == [{"signal": "SIGTERM", "step": 1, "checkpoint": str(checkpoint)}] * 2
    assert (checkpoint / "client_state.pt").is_file()
