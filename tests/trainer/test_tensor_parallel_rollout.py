"""TensorParallelRollout on 2 gloo ranks, each with a real HF engine where a vLLM TP shard would be:
every rank submits the same union of the group's requests (each with its own rank's seeds) and keeps its own
rows (the vLLM lane runs a real TP-2 engine: tests/vllm_cpu/test_train.py)."""

from __future__ import annotations

import pytest

from _dist_utils import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROMPTS = {0: [[1, 2, 3], [4, 5]], 1: [[6, 7, 8, 9], [10, 11], [12]]}  # ranks deal different counts too


def _worker(out_dir, model_dir, **_):
    from stapo.distributed.process_group import init_distributed
    from stapo.rollout import SamplingParams, generate
    from stapo.rollout.hf_engine import HFEngine
    from stapo.rollout.tensor_parallel import TensorParallelRollout, tensor_parallel_group

    info = init_distributed()
    seen = []

    class Recording(HFEngine):  # the real engine; records what each rank submitted
        def generate_segments(self, requests, sampling):
            seen.append([(r.context, r.seed) for r in requests])
            return super().generate_segments(requests, sampling)

    engine = Recording(model_dir, device="cpu")
    shared = TensorParallelRollout(engine, tensor_parallel_group(2))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=100 + info.rank)  # per-rank seeds
    rollout = generate(shared, PROMPTS[info.rank], 2, sampling)
    alone = generate(engine, PROMPTS[info.rank], 2, sampling)  # this rank's rows, submitted alone
    with shared.weight_update(version=3):
        pass
    with pytest.raises(ValueError, match="must divide the number of ranks"):
        tensor_parallel_group(3)
    return {"seen": seen[0], "prompt_ids": rollout.prompt_ids, "prompt_mask": rollout.prompt_mask,
            "response_ids": rollout.response_ids, "rows": len(rollout), "alone": alone.response_ids,
            "version": shared.policy_version}


def test_ranks_submit_the_union_and_keep_their_own_rows(tmp_path, tiny_model_dir):
    results = run_ranks(_worker, 2, tmp_path, timeout=300, kwargs={"model_dir": str(tiny_model_dir)})
    union = [p for rank in (0, 1) for p in PROMPTS[rank] for _ in range(2)]
    for rank, r in enumerate(results):
        assert r["seen"] == results[0]["seen"] and [c for c, _ in r["seen"]] == union  # the same requests on both ranks
        assert r["rows"] == 2 * len(PROMPTS[rank])  # n=2 samples of each of its own prompts
        own = [r["prompt_ids"][i][r["prompt_mask"][i]].tolist() for i in range(r["rows"])]
        assert own == [p for p in PROMPTS[rank] for _ in range(2)]
        assert r["response_ids"].equal(r["alone"])  # its rows are those of its own seeds
        assert r["version"] == 3  # the weight session and its version are the engine's
