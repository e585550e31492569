"""Run as a subprocess by tests/vllm_cpu/test_engine.py (and the GPU lane): a VLLMEngine inside the
trainer's plain one-process group (no launcher variables), as `stapo train` builds it.

Prints one JSON line with what the tests assert."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))


def rng_states():
    return (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())


def same_states(a, b) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def main(model_dir: str) -> None:
    from _rollout_utils import teacher_forced
    from transformers import AutoModelForCausalLM

    from stapo.rollout import SamplingParams, VLLMEngine, generate
    from stapo.distributed.process_group import _launched, init_distributed

    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ, "run without a launcher"
    init_distributed()  # the trainer's 1-rank tcp:// group
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    states = rng_states()
    engine = VLLMEngine(model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=256,
                        enforce_eager=True)
    out = {"in_process": engine.in_process, "rank_left_set": "RANK" in os.environ, "launched": _launched(),
           "caller_rngs_untouched_by_build": same_states(states, rng_states())}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = generate(engine, prompts, 1, greedy).response_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
    named = [(n, p.detach().to(device)) for n, p in model.named_parameters()]
    engine.sleep()
    with engine.weight_update():  # buckets of 3 split q/k/v and gate/up; asleep weights are woken
        for start in range(0, len(named), 3):
            engine.load_weights(named[start:start + 3])
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    states = rng_states()
    rollout = generate(engine, prompts, 4, sampled)
    out["caller_rngs_untouched_by_generate"] = same_states(states, rng_states())
    ref = teacher_forced(model, rollout)
    valid = rollout.response_mask
    out["perturbed_max_abs_diff"] = float((rollout.sampling_logprobs[valid] - ref[valid]).abs().max())
    out["seed_reproduces"] = torch.equal(rollout.response_ids, generate(engine, prompts, 4, sampled).response_ids)
    with engine.weight_update():
        engine.load_weights([(n, t.to(device)) for n, t in original])
    out["restored"] = torch.equal(before, generate(engine, prompts, 1, greedy).response_ids)
    out["freed_fraction"] = None
    if torch.cuda.is_available():
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        free_asleep, total = torch.cuda.mem_get_info()
        out["freed_fraction"] = (free_asleep - free_awake) / total
        # level 2: the weights are discarded; generate refuses until a weight update pushed all of them
        engine.wake()
        engine.sleep_level = 2
        engine.sleep()
        try:
            generate(engine, prompts, 1, greedy)
            out["level2_refused"] = False
        except RuntimeError as err:
            out["level2_refused"] = "level-2 sleep" in str(err)
        with engine.weight_update():
            engine.load_weights([(n, t.to(device)) for n, t in original])
        out["level2_restored"] = torch.equal(before, generate(engine, prompts, 1, greedy).response_ids)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
