"""Run as a subprocess by tests/vllm_cpu/test_vllm_partial.py: the trainer's producer with partial rollouts on a
real server, in the trainer's one-process group. A stand-in for the update (a small change of the weights,
made once the next batch streams tokens) keeps the run fast, and every response runs to its length limit
(``ignore_eos``), so every sync finds the next batch under way whatever the machine's speed (a fixed 1 s pause
let a less loaded machine finish a batch before its sync); the rest — `Rollouts`, its producer, the `ServerEngine`, the syncs — is
the trainer's. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import threading

import torch


def _long_responses() -> None:
    """Every segment request runs to its ``max_tokens`` (vLLM's ``ignore_eos``)."""
    import stapo.servers.engine as server_engine

    body = server_engine.completion_body
    server_engine.completion_body = lambda request, base: {**body(request, base), "ignore_eos": True}


def _streaming() -> threading.Event:
    """Set by the engine's chunk reader when a segment streams tokens and has not finished."""
    import stapo.servers.engine as server_engine

    streaming, read_chunk = threading.Event(), server_engine.read_chunk

    def watched(choice, address):
        ids, logprobs, text, finish = read_chunk(choice, address)
        if ids and finish is None:
            streaming.set()
        return ids, logprobs, text, finish

    server_engine.read_chunk = watched
    return streaming


def main(server: str, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapo.config import STAPOConfig
    from stapo.data import PromptSampler
    from stapo.distributed.process_group import init_distributed
    from stapo.trainer.components import build_datasets
    from stapo.trainer.rollouts import Rollouts
    from stapo.trainer.server_setup import build_server_engine

    _long_responses()
    streaming = _streaming()
    dist = init_distributed()
    cfg = STAPOConfig.from_yaml(None, [
        "rollout.mode=server", f"rollout.server.addresses=[{server}]", "rollout.max_staleness=1", "rollout.partial=true",
        "trainer.train_batch_size=2", "trainer.mini_batch_size=2", "rollout.group_size=8",
        "rollout.max_response_length=300", "model.dtype=fp32", "data.eval_size=4", "trainer.total_steps=4"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = build_server_engine(cfg, model_dir, tokenizer, torch.float32)
    train, _ = build_datasets(cfg, tokenizer)
    sampler = PromptSampler(len(train), cfg.trainer.train_batch_size, seed=cfg.trainer.seed)
    rollouts = Rollouts(cfg, dist, engine, model, sampler, train, score=None, reward_terms=None)
    rollouts.sync(0)
    rollouts.start_producer(0)
    batches = []
    for step in range(cfg.trainer.total_steps):
        produced = rollouts.producer.take(step)
        streaming.clear()  # batch `step` is done: a chunk from now on is the next batch's
        r = produced.rollout
        batches.append({"interrupted": produced.interrupted, "policy_version": produced.policy_version,
                        "versions": [row[m].tolist() for row, m in zip(r.token_version, r.response_mask)],
                        "finish": r.finish_reason})
        # the update, once the next batch streams (what a real update's seconds guarantee); the last has none
        if step + 1 < cfg.trainer.total_steps and not streaming.wait(timeout=120):
            raise SystemExit(f"the batch after step {step} streamed no token in 120 s")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        rollouts.sync(step + 1)
    rollouts.close()
    print("RESULT " + json.dumps(batches), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
