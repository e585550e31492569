"""`VLLMEngine`: vLLM colocated in the training process (one engine per rank), with sleep mode.

Only this module and `stapo/serve/worker_extension.py` import vllm, lazily, so stapo imports on a CPU box.
The choices (processed log-probs, the executor plan, one update session per sync, one seeded request per
segment, the caller's RNGs left as they were) are in docs/rollout.md, "`VLLMEngine`"; sleep levels and
memory in docs/gpu.md, "Colocated memory".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from stapo.distributed.device_memory import release_cached_memory
from stapo.distributed.process_group import DistInfo, free_port
from stapo.distributed.rng_state import capture_rng_state, restore_rng_state
from stapo.rollout.engine import RolloutEngine, Segment, SegmentRequest, pad_token_id
from stapo.rollout.sampling import SamplingParams, vllm_request_kwargs
from stapo.serve.launcher import cpu_engine_kwargs
from stapo.serve.worker_extension import WORKER_EXTENSION
from stapo.sync.bucket_format import pack_bucket

__all__ = ["VLLMEngine", "ExecutorPlan", "plan_executor", "segment_from_vllm"]

EXTERNAL_LAUNCHER = "external_launcher"
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class ExecutorPlan:
    """How to build `vllm.LLM`: its executor backend and the launcher variables to provide."""

    backend: str | None  # distributed_executor_backend; None: vLLM's own choice
    env: dict[str, str]  # variables missing from the environment, set while vllm.LLM is built


def plan_executor(tensor_parallel_size: int, env: Mapping[str, str], group: DistInfo | None,
                  spare_port: int = 29500) -> ExecutorPlan:
    """Executor backend and the launcher variables vLLM needs (docs/rollout.md, "`VLLMEngine`"); ``group``:
    None without a process group; ``spare_port`` fills ``MASTER_PORT`` (vLLM joins the group, never uses it)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if group is None:
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return ExecutorPlan(None, {})  # standalone engine: vLLM's uni/mp executor
        missing = [name for name in _LAUNCHER_VARS if name not in env]
        if missing:  # vLLM would rendezvous on env:// itself and fail with a bare KeyError
            raise ValueError(f"incomplete launcher environment for vLLM's external launcher: {missing} "
                             "unset; launch with torchrun / deepspeed / accelerate, or unset RANK and "
                             "WORLD_SIZE for a single process")
        return ExecutorPlan(EXTERNAL_LAUNCHER, {})
    if group.world_size % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) must divide the number of "
                         f"ranks ({group.world_size})")
    for name, fact in (("RANK", group.rank), ("WORLD_SIZE", group.world_size)):
        if name in env and env[name] != str(fact):
            raise ValueError(f"{name}={env[name]} in the environment, but the process group says "
                             f"{name.lower()} {fact}; vLLM would join the wrong rank")
    wanted = {"RANK": str(group.rank), "WORLD_SIZE": str(group.world_size),
              "LOCAL_RANK": str(group.local_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spare_port)}
    return ExecutorPlan(EXTERNAL_LAUNCHER, {k: v for k, v in wanted.items() if k not in env})


@contextlib.contextmanager
def _provided_env(extra: Mapping[str, str]) -> Iterator[None]:
    """Set the missing launcher variables ``extra`` for the duration of the block, then remove them."""
    os.environ.update(extra)
    try:
        yield
    finally:
        for name in extra:
            os.environ.pop(name, None)


def _group_facts() -> DistInfo | None:
    """This process in the live default process group (``local_rank``: its CUDA device index), or None."""
    from stapo.losses.reduce import distributed_on

    dist = torch.distributed
    if not distributed_on():
        return None
    default = torch.cuda.current_device() if torch.cuda.is_available() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", default))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


@contextlib.contextmanager
def _preserved_rngs() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global RNG states after the block (vLLM's worker reseeds and
    draws from them, in this process)."""
    state = capture_rng_state(start_cuda=False)
    try:
        yield
    finally:
        restore_rng_state(state)


def unlink_cpu_shm_names(rank: int, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the names of vLLM's CPU tensor-parallel shared memory that this ``rank`` takes part in; the names
    unlinked. Under the external launcher the names are the same for every run (``-tp:0-[0-1]-cpushm_0``) and
    vLLM unlinks them only in its C++ teardown, so a run that never gets there (a crash, or the ``stapo``
    command's `exit_process`) would make every later one fail ("create shm in SHMManager failed. errno: 17").
    Once the engine is built every rank has mapped every segment, so the names can go now: the memory stays
    until the last rank exits."""
    prefix = os.environ.get("VLLM_DIST_IDENT", "").lstrip("/") + "-"  # shm_open drops leading slashes
    gone = []
    for name in sorted(os.listdir(shm_dir)) if os.path.isdir(shm_dir) else ():
        found = re.fullmatch(r"(.*)-\[([\d-]+)\]-cpushm_\d+", name)
        if found and name.startswith(prefix) and str(rank) in found.group(2).split("-"):
            with contextlib.suppress(FileNotFoundError):  # the group's other ranks unlink them too
                os.unlink(os.path.join(shm_dir, name))
                gone.append(name)
    return gone


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError("VLLMEngine needs vLLM: pip install 'stapo[vllm]' (or use HFEngine)") from err
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    reload_api = importlib.util.find_spec("vllm.model_executor.model_loader.reload") is not None
    if "logprobs_mode" not in fields or "worker_extension_cls" not in fields or not reload_api:
        raise ImportError(f"vLLM {vllm.__version__} is too old: VLLMEngine needs EngineArgs.logprobs_mode, "
                          "worker_extension_cls and the layerwise weight reload (vllm>=0.26)")
    return vllm


class VLLMEngine(RolloutEngine):
    """A `vllm.LLM` held next to the trainer.

    Args:
        model_path: HF model directory (or hub name) vLLM loads its own copy from.
        gpu_memory_utilization: fraction of the GPU vLLM may take (weights + KV cache); on vLLM's CPU build
            the KV cache has a fixed size instead (`stapo.serve.launcher.cpu_engine_kwargs`).
        tensor_parallel_size: GPUs per engine; every rank of a TP group must submit the same requests
            (`stapo.rollout.tensor_parallel.TensorParallelRollout`).
        enable_sleep_mode: let `sleep()` free GPU memory (ignored where vLLM has no sleep mode: its CPU build).
        sleep_level: 1 keeps a host copy of the weights while asleep, 2 discards them (a sync must then
            push them before generating).
        seed: the engine's seed (requests without their own seed draw from it); give each rank its own.
        progress: show vLLM's progress bar while generating (`stapo eval`).
        **llm_kwargs: passed to `vllm.LLM` (override any of the above, e.g. `enforce_eager`).
    """

    def __init__(self, model_path: str | Path, *, gpu_memory_utilization: float = 0.5,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = True, dtype: str = "bfloat16",
                 max_model_len: int = 4096, seed: int = 0, sleep_level: int = 1, progress: bool = False,
                 **llm_kwargs) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMEngine: sleep_level must be 1 or 2, got {sleep_level}")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.enable_sleep_mode = enable_sleep_mode and current_platform.is_sleep_mode_available()
        kwargs = dict(model=str(model_path), gpu_memory_utilization=gpu_memory_utilization,
                      tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=self.enable_sleep_mode,
                      dtype=dtype, max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs",
                      worker_extension_cls=WORKER_EXTENSION)
        kwargs.update(cpu_engine_kwargs(max_model_len, os.environ) if current_platform.is_cpu() else {})
        group = _group_facts()
        plan = plan_executor(tensor_parallel_size, os.environ, group,
                             free_port() if group is not None and "MASTER_PORT" not in os.environ else 29500)
        if plan.backend is not None:
            kwargs["distributed_executor_backend"] = plan.backend
        kwargs.update(llm_kwargs)
        with _provided_env(plan.env), _preserved_rngs():
            self.llm = vllm.LLM(**kwargs)
        if current_platform.is_cpu() and plan.backend == EXTERNAL_LAUNCHER:
            unlink_cpu_shm_names(group.rank if group is not None else int(os.environ["RANK"]))
        # the worker lives in this process unless vLLM runs its engine core in a child process
        self.in_process = getattr(self.llm.llm_engine, "model_executor", None) is not None
        self.tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = pad_token_id(self.tokenizer)
        self.max_model_len = int(kwargs["max_model_len"])
        self._sleeping: set[str] = set()  # tags currently asleep: {"weights", "kv_cache"}
        self._updating = self._closed = False
        self.sleep_level, self.progress = sleep_level, progress
        self.needs_weights = False  # a level-2 sleep discarded them; a weight update restores them

    # ---------------------------------------------------------------- generate
    def generate_segments(self, requests: Sequence[SegmentRequest], sampling: SamplingParams) -> list[Segment]:
        """Every request in ONE vLLM submission, one sample each with its own seed."""
        if self._updating:
            raise RuntimeError("generation inside a weight update session: finish the update first")
        if self._closed:
            raise RuntimeError("generation after VLLMEngine.close(): its engine core is stopped")
        if self.needs_weights:
            raise RuntimeError("generation after a level-2 sleep discarded the weights: push them first "
                               "(stapo.sync.buckets.sync_weights, one weight_update session)")
        base = vllm_request_kwargs(sampling)
        params = [self._vllm.SamplingParams(**base, max_tokens=r.max_new_tokens,
                                            **({} if r.seed is None else {"seed": r.seed})) for r in requests]
        self.wake()
        with _preserved_rngs():  # in-process, vLLM's scheduler and sampler must not move the trainer's RNGs
            outputs = self.llm.generate([{"prompt_token_ids": list(r.context)} for r in requests],
                                        sampling_params=params, use_tqdm=self.progress)
        return [segment_from_vllm(out.outputs[0], self.policy_version) for out in outputs]

    # ------------------------------------------------------------ weight sync
    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[None]:
        """One weight-update session (`load_weights` per bucket inside); the prefix cache is dropped after it
        (its KV entries came from the old weights)."""
        if self._updating:
            raise RuntimeError("a weight update session is already open")
        if "weights" in self._sleeping:  # writing into offloaded weights would be lost / crash
            release_cached_memory()
            self.llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")
        self.llm.collective_rpc("stapo_begin_weight_update")
        self._updating = True
        try:
            yield
        finally:
            self._updating = False
            self.llm.collective_rpc("stapo_finish_weight_update")
            self.llm.reset_prefix_cache()
        self.needs_weights = False  # only after a session that completed
        self.policy_version = version

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full tensors (HF names), one RPC; only inside `weight_update`."""
        if not self._updating:
            raise RuntimeError("VLLMEngine.load_weights must be called inside `with engine.weight_update():` "
                               "(one session per sync; stapo.sync.buckets.sync_weights opens it)")
        bucket = list(weights)
        payload = bucket if self.in_process else pack_bucket(bucket)
        self.llm.collective_rpc("stapo_load_weights", args=(payload,))

    # ------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Free the KV cache and the weights (`llm.sleep(level=sleep_level)`); no-op without sleep mode."""
        if self.enable_sleep_mode and not self._sleeping:
            self.llm.sleep(level=self.sleep_level)
            self._sleeping = {"weights", "kv_cache"}
            self.needs_weights = self.sleep_level == 2

    def wake(self) -> None:
        """Bring back whatever is asleep, after PyTorch's free cached blocks are returned (vLLM maps its
        memory back into them)."""
        if self._sleeping:
            release_cached_memory()
            self.llm.wake_up(tags=sorted(self._sleeping))
            self._sleeping = set()

    def close(self) -> None:
        """Stop vLLM's engine-core process (its worker, weights and KV cache): otherwise it lives until the
        interpreter exits, and a second engine in the same process (a notebook, a test session) holds its own
        beside it. An engine core in this process (``in_process``: it shares the trainer's process and groups)
        ends with the process. Generating after `close` is an error."""
        if not self.in_process and not self._closed:
            self._closed = True
            self.llm.llm_engine.engine_core.shutdown()


def segment_from_vllm(completion, version: int | None = None) -> Segment:
    """One vLLM ``CompletionOutput`` (``logprobs=0``) as a `Segment` (pure)."""
    ids = [int(t) for t in completion.token_ids]
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        raise ValueError("a vLLM completion has no per-token logprobs (vLLM SamplingParams needs logprobs=0)")
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"a vLLM completion ended with {completion.finish_reason!r}")
    logprobs = [_chosen_logprob(entry, tok) for entry, tok in zip(completion.logprobs, ids, strict=True)]
    return Segment(ids, logprobs, completion.text, completion.finish_reason, version)


def _chosen_logprob(entry, token_id: int) -> float:
    value = entry[token_id]  # a position's {token_id: Logprob} (or plain floats)
    return float(getattr(value, "logprob", value))
