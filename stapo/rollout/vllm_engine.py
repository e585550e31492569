"""`VLLMEngine`: vLLM colocated in the training process (one engine per rank), with sleep mode.

The only module of stapo that imports vllm, and only inside `VLLMEngine.__init__`, so stapo imports on a CPU box (docs/rollout.md).

Choices (checked against vLLM's V1 engine and TRL's colocate mode; see docs/rollout.md):
- `logprobs_mode="processed_logprobs"`: vLLM's default returns logprobs of the RAW logits; the
  trainer needs the distribution the token was drawn from (after temperature / top-k / top-p).
- Under torchrun / DeepSpeed (world size > 1) or tensor parallelism,
  `distributed_executor_backend="external_launcher"` keeps vLLM's worker in this process, so
  `load_weights` copies tensors straight into the running model (no serialization).
- Sampling with a seed: one derived seed per prompt (vLLM gives the i-th of the n children of a
  request `seed + i`), so different prompts never share random streams.
- `sleep()` is `llm.sleep(level=1)` (weights offloaded to CPU, KV cache freed); `load_weights`
  wakes only the weights, `generate` wakes the KV cache.

Launch (2 GPUs, one engine per rank): `torchrun --nproc_per_node 2 your_train.py`; torchrun sets the
RANK / WORLD_SIZE / MASTER_ADDR variables vLLM's external launcher reads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from stapo.rollout.batch import Rollout, left_pad, right_pad
from stapo.rollout.engine import check_prompts
from stapo.rollout.sampling import SamplingParams

__all__ = ["VLLMEngine", "choose_executor_backend", "rollout_from_vllm_outputs"]


def choose_executor_backend(tensor_parallel_size: int, world_size: int, dist_initialized: bool) -> str | None:
    """`"external_launcher"` when vLLM must live inside an already-distributed process, else None
    (vLLM's default executor)."""
    if tensor_parallel_size > 1 or world_size > 1 or dist_initialized:
        return "external_launcher"
    return None


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError("VLLMEngine needs vLLM: pip install 'stapo[vllm]' (or use HFEngine)") from err
    if not torch.cuda.is_available():
        raise RuntimeError("VLLMEngine needs a CUDA GPU; none is visible (use HFEngine on CPU)")
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    if "logprobs_mode" not in fields:
        raise ImportError(f"vLLM {vllm.__version__} is too old: VLLMEngine needs EngineArgs.logprobs_mode "
                          "(vllm>=0.10.2) to report processed sampling logprobs")
    return vllm


class VLLMEngine:
    """A `vllm.LLM` held next to the trainer; see the module docstring for the design.

    Args:
        model_path: HF model directory (or hub name) vLLM loads its own copy from.
        gpu_memory_utilization: fraction of the GPU vLLM may take (weights + KV cache).
        tensor_parallel_size: GPUs per engine (ranks of one TP group must pass the same seed).
        enable_sleep_mode: allow `sleep()` to free GPU memory during training.
        dtype: vLLM weight dtype.
        max_model_len: longest prompt + response.
        seed: the engine's global seed (used when `SamplingParams.seed` is None).
        **llm_kwargs: passed to `vllm.LLM` (override any of the above, e.g. `logprobs_mode`).
    """

    def __init__(self, model_path: str | Path, *, gpu_memory_utilization: float = 0.5,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = True, dtype: str = "bfloat16",
                 max_model_len: int = 4096, seed: int = 0, **llm_kwargs) -> None:
        vllm = _import_vllm()
        self._vllm = vllm
        kwargs = dict(model=str(model_path), gpu_memory_utilization=gpu_memory_utilization,
                      tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode,
                      dtype=dtype, max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs")
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        backend = choose_executor_backend(tensor_parallel_size, world_size, dist_on)
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        kwargs.update(llm_kwargs)
        self.llm = vllm.LLM(**kwargs)
        self.enable_sleep_mode = enable_sleep_mode
        self.tokenizer = self.llm.get_tokenizer()
        eos = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos or 0)
        self._sleeping: set[str] = set()  # tags currently asleep: {"weights", "kv_cache"}

    # ---------------------------------------------------------------- generate
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Rollout:
        """Sample `n` responses per prompt with vLLM; rows grouped per prompt (see `Rollout`)."""
        prompts = check_prompts(prompt_ids, n)
        self.wake()
        base = dict(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                    top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
                    stop_token_ids=list(sampling.stop_token_ids), logprobs=0, skip_special_tokens=True)
        if sampling.seed is None:
            params = self._vllm.SamplingParams(**base)
        else:  # one seed per prompt, derived reproducibly from sampling.seed
            gen = torch.Generator().manual_seed(sampling.seed)
            seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=gen).tolist()
            params = [self._vllm.SamplingParams(**base, seed=s) for s in seeds]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        return rollout_from_vllm_outputs(outputs, prompts, n, self.pad_token_id)

    # ------------------------------------------------------------ weight sync
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full tensors (HF names) into the running model, then drop the prefix
        cache (its KV entries were computed with the old weights)."""
        bucket = list(weights)
        if "weights" in self._sleeping:  # writing into offloaded weights would be lost / crash
            self.llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")
        model = _local_model(self.llm)
        # vLLM's own loader maps HF names onto its fused layers (q/k/v -> qkv_proj, ...) and its TP
        # shards, and raises on names it does not know.
        if model is not None:
            model.load_weights(bucket)
        else:  # vLLM runs its worker in another process: ship the bucket through an RPC
            try:
                self.llm.apply_model(lambda m: m.load_weights(bucket))
            except Exception as err:
                raise RuntimeError(
                    "VLLMEngine.load_weights: vLLM's worker runs in another process and the weight RPC "
                    "failed; run under torchrun (external_launcher keeps it in-process) or set "
                    "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the engine") from err
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Offload weights to CPU and free the KV cache (`llm.sleep(level=1)`); no-op without sleep mode."""
        if self.enable_sleep_mode and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = {"weights", "kv_cache"}

    def wake(self) -> None:
        """Bring back whatever is asleep (weights and/or KV cache)."""
        if self._sleeping:
            self.llm.wake_up(tags=sorted(self._sleeping))
            self._sleeping = set()


def _local_model(llm) -> torch.nn.Module | None:
    """The vLLM model object when the worker lives in this process (external launcher / uniproc)."""
    executor = getattr(llm.llm_engine, "model_executor", None)
    worker = getattr(executor, "driver_worker", None)
    for candidate in (getattr(worker, "worker", None), worker):  # V1 wraps the worker; V0 does not
        runner = getattr(candidate, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is not None and hasattr(model, "load_weights"):
            return model
    return None


def rollout_from_vllm_outputs(outputs: Sequence, prompts: Sequence[Sequence[int]], n: int,
                              pad_token_id: int) -> Rollout:
    """Convert vLLM `RequestOutput`s (one per prompt, `n` completions each, `logprobs=0`) into a
    `Rollout`. Pure: only reads `.outputs[i].token_ids / .logprobs / .finish_reason / .text / .index`."""
    if len(outputs) != len(prompts):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    tokens, logprobs, reasons, texts = [], [], [], []
    for p, out in enumerate(outputs):
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ValueError(f"prompt {p}: vLLM returned {len(completions)} completions, expected {n}")
        for c in completions:
            ids = [int(t) for t in c.token_ids]
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise ValueError(f"prompt {p}: completion {c.index} has no per-token logprobs "
                                 "(vLLM SamplingParams needs logprobs=0)")
            logprobs.append([_chosen_logprob(entry, tok) for entry, tok in zip(c.logprobs, ids, strict=True)])
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"prompt {p}: completion {c.index} ended with {c.finish_reason!r}")
            tokens.append(ids)
            reasons.append(c.finish_reason)
            texts.append(c.text)
    prompt_ids, prompt_mask = left_pad([list(p) for p in prompts for _ in range(n)], pad_token_id)
    response_ids = right_pad(tokens, pad_token_id, torch.long)  # (B, T)
    response_mask = right_pad([[1] * len(t) for t in tokens], 0, torch.long).bool()  # (B, T)
    return Rollout(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        sampling_logprobs=right_pad(logprobs, 0.0, torch.float32), finish_reason=reasons, response_text=texts,
        group_index=torch.arange(len(prompts)).repeat_interleave(n), group_size=n, pad_token_id=pad_token_id)


def _chosen_logprob(entry, token_id: int) -> float:
    """Logprob of `token_id` from one position's `{token_id: Logprob}` mapping (or plain floats)."""
    value = entry[token_id]
    return float(getattr(value, "logprob", value))
