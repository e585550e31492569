"""TensorParallelRollout on 2 gloo ranks, each with a real HF engine where a vLLM TP shard would be:
every rank submits the same union of the group's prompts with the leader's seed and keeps its own rows
(the vLLM lane runs a real TP-2 engine: tests/vllm_cpu/test_train.py)."""

from __future__ import annotations

import pytest

from _dist_utils import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROMPTS = {0: [[1, 2, 3], [4, 5]], 1: [[6, 7, 8, 9], [10, 11], [12]]}  # ranks deal different counts too


def _worker(out_dir, model_dir, **_):
    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.tensor_parallel import TensorParallelRollout, tensor_parallel_group
    from stapo.rollout import SamplingParams
    from stapo.rollout.hf_engine import HFEngine

    info = init_distributed()
    seen = []

    class Recording(HFEngine):  # the real engine; records what each rank submitted
        def generate(self, prompt_ids, n, sampling):
            seen.append(([list(p) for p in prompt_ids], sampling.seed))
            return super().generate(prompt_ids, n, sampling)

    engine = Recording(model_dir, device="cpu")
    shared = TensorParallelRollout(engine, tensor_parallel_group(2))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=100 + info.rank)  # per-rank seeds
    rollout = shared.generate(PROMPTS[info.rank], 2, sampling)
    with pytest.raises(ValueError, match="must divide the number of ranks"):
        tensor_parallel_group(3)
    return {"seen": seen, "prompt_ids": rollout.prompt_ids, "prompt_mask": rollout.prompt_mask,
            "response_ids": rollout.response_ids, "rows": len(rollout), "sleep": shared.sleep == engine.sleep}


def test_ranks_submit_the_union_and_keep_their_own_rows(tmp_path, tiny_model_dir):
    results = run_ranks(_worker, 2, tmp_path, timeout=300, kwargs={"model_dir": str(tiny_model_dir)})
    union = PROMPTS[0] + PROMPTS[1]
    for rank, r in enumerate(results):
        assert r["seen"] == [(union, 100)]  # the same requests on both ranks, the leader's seed
        assert r["rows"] == 2 * len(PROMPTS[rank])  # n=2 samples of each of its own prompts
        own = [r["prompt_ids"][i][r["prompt_mask"][i]].tolist() for i in range(r["rows"])]
        assert own == [p for p in PROMPTS[rank] for _ in range(2)]
        assert r["sleep"]  # everything else goes to the engine
