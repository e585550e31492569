"""GPU helper run as a subprocess (tests/gpu/test_train_gpu.py): a VLLMEngine inside the
trainer's plain one-process group (no launcher variables), as `stapo train` builds it.

Prints one JSON line with what the test asserts."""

from __future__ import annotations

import json
import os
import sys

import torch


def main(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from stapo.rollout import SamplingParams, VLLMEngine
    from stapo.trainer.distributed import _launched, init_distributed

    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ, "run without a launcher"
    init_distributed()  # the trainer's 1-rank tcp:// group
    engine = VLLMEngine(model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=256,
                        enforce_eager=True)
    out = {"in_process": engine.in_process, "rank_left_set": "RANK" in os.environ, "launched": _launched()}
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = engine.generate(prompts, 1, greedy).response_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    named = [(n, (t + 0.5 * t.std() * torch.randn(t.shape, generator=gen)).cuda()) for n, t in model.state_dict().items()]
    engine.sleep()
    for start in range(0, len(named), 8):  # buckets, weights asleep: load_weights wakes them
        engine.load_weights(named[start:start + 8])
    out["perturbed_changes_outputs"] = not torch.equal(before, engine.generate(prompts, 1, greedy).response_ids)
    engine.load_weights(list(model.state_dict().items()))
    out["restored"] = torch.equal(before, engine.generate(prompts, 1, greedy).response_ids)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    rng_before = torch.cuda.get_rng_state()
    a = engine.generate(prompts, 4, sampled).response_ids
    out["caller_rng_untouched"] = torch.equal(rng_before, torch.cuda.get_rng_state())
    out["engine_seed_reproduces"] = torch.equal(a, engine.generate(prompts, 4, sampled).response_ids)
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free_asleep, total = torch.cuda.mem_get_info()
    out["freed_fraction"] = (free_asleep - free_awake) / total
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
