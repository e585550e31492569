"""``rollout.offload_training_state``: the ZeRO state goes to the host around generation and comes back
bit for bit (stapo.distributed.training_offload).

Two engines from the same seed take the same optimizer steps; one has its whole ZeRO state moved to
the host and back before the first step and between every two (where the trainer generates). Their
weights and AdamW states must stay bit-identical, and while moved, every tensor the engine steps with
must BE the host buffer (a reference left on the old storage would silently train a stale copy).
On CPU the move is a copy between host buffers, so the test shows that every reference is rewired; the
device memory it frees is measured by the GPU lane only.
"""

from __future__ import annotations

import pytest
import torch

from _dist_utils import run_ranks, tiny_qwen3

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 3


def _step(engine, ids: torch.Tensor) -> None:
    from stapo.distributed.accumulation import GradientAccumulation

    accumulation = GradientAccumulation(engine, 1)
    logits = engine(input_ids=ids).logits[:, :-1].float()
    loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
    accumulation.backward(loss)
    accumulation.step()


def _full_state(engine) -> dict[str, torch.Tensor]:
    """Every weight (gathered) and the fp32 master / AdamW tensors of this rank's partitions."""
    from stapo.sync.buckets import iter_weight_buckets

    state = {f"w.{n}": t.float().clone() for bucket in iter_weight_buckets(engine) for n, t in bucket}
    zero = engine.optimizer
    masters = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    for i, master in enumerate(masters):
        state[f"master.{i}"] = master.detach().clone()
        for key, value in zero.optimizer.state.get(master, {}).items():
            state[f"adam.{i}.{key}"] = value.detach().clone()
    return state


def _worker(out_dir, stage: int, bf16: bool, **_):
    from stapo.distributed.deepspeed_engine import build_engine
    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.training_offload import TrainingOffload

    info = init_distributed()

    def engine():
        model = tiny_qwen3(seed=0)
        return build_engine(model.to(torch.bfloat16) if bf16 else model, lr=1e-2, warmup_steps=0,
                            grad_accum_steps=1, zero_stage=stage, bf16=bf16)

    plain, moved = engine(), engine()
    offload = TrainingOffload(moved)
    ids = torch.randint(0, 64, (STEPS, 2, 7), generator=torch.Generator().manual_seed(info.rank))
    rewired = []
    with offload.offloaded_while():  # as around the engine's start: no AdamW moments exist yet
        pass
    for step in range(STEPS):
        _step(plain, ids[step])
        _step(moved, ids[step])
        with offload.offloaded_while():  # as around a generation
            if stage == 3:
                own = offload._own_tensors()
                rewired.append(len(own) > len(moved.optimizer.fp32_partitioned_groups_flat)
                               and all(t.data_ptr() == h.data_ptr() for t, h in zip(own, offload._host)))
            rewired.append(bool(moved.optimizer.offloaded_states))
        rewired.append(not moved.optimizer.offloaded_states and not offload.offloaded)
    return {"plain": _full_state(plain), "moved": _full_state(moved), "rewired": rewired}


@pytest.mark.parametrize("stage, bf16, world_size", [(1, False, 1), (2, True, 1), (3, False, 1), (3, True, 2)])
def test_offloading_between_steps_changes_nothing(stage, bf16, world_size, tmp_path):
    for result in run_ranks(_worker, world_size, tmp_path, timeout=240, kwargs={"stage": stage, "bf16": bf16}):
        assert all(result["rewired"]), result["rewired"]
        plain, moved = result["plain"], result["moved"]
        assert plain.keys() == moved.keys() and any(k.startswith("adam.") for k in plain)
        for key in plain:
            assert torch.equal(plain[key], moved[key]), key


def test_the_trainer_with_offloaded_state_matches_the_plain_run(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """ZeRO-3, one process, HF engine (its own copy of the weights): the state is moved around the
    engine's start and every generation; same metrics as the run that keeps it."""
    from stapo import STAPOTrainer
    from stapo.run_dir import read_metrics

    from _rewards import digit_one_reward
    from test_trainer import tiny_config

    rows = {}
    for offload in (False, True):
        out = tmp_path / str(offload)
        cfg = tiny_config(out, tiny_model_dir, arithmetic_jsonl, "trainer.zero_stage=3",
                          f"rollout.offload_training_state={str(offload).lower()}")
        trainer = STAPOTrainer(cfg, reward_fn=digit_one_reward)
        assert (trainer.training_offload is not None) == offload
        trainer.train()
        rows[offload] = [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per_s", "mfu"))}
                         for r in read_metrics(out / "run" / "metrics.jsonl") if "loss" in r]
    assert len(rows[True]) == 2 and rows[True] == rows[False]
