"""``stapo serve MODEL [vLLM server options]``: a vLLM server that stapo can train through.

It is vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, present
in vLLM 0.26 and in the CPU build 0.32, whose ``vllm`` command cannot find its own version) with
what ``rollout.mode: server`` needs added, unless the options already say otherwise:

- ``--worker-extension-cls`` stapo's worker extension (the weight-update session, the policy version);
- ``--logprobs-mode processed_logprobs``: the sampled token's log-prob under the distribution it was
  drawn from (temperature, top-k, top-p), as the colocated engine reports it;
- ``VLLM_SERVER_DEV_MODE=1``: vLLM serves ``/collective_rpc`` and ``/reset_prefix_cache`` only then.
  Those routes change the served weights: bind the server to an address only the trainer reaches;
- on vLLM's CPU build, the colocated engine's CPU settings (`cpu_engine_kwargs`): whole-prompt prefill
  and a fixed KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB).

Every other option goes to vLLM unchanged (``--port``, ``--host``, ``--tensor-parallel-size``,
``--dtype``, ``--max-model-len``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stapo.rollout.vllm_engine import CPU_KV_CACHE_BYTES
from stapo.rollout.vllm_worker import WORKER_EXTENSION

__all__ = ["SERVER_MODULE", "serve_command"]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _has(args: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in args)


def _value(args: Sequence[str], option: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(option + "="):
            return a.split("=", 1)[1]
        if a == option and i + 1 < len(args):
            return args[i + 1]
    return None


def serve_command(model: str, vllm_args: Sequence[str], python: str, env: Mapping[str, str],
                  on_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of the server process (pure: the caller executes it)."""
    if not model or model.startswith("-"):
        raise ValueError("stapo serve needs the model first: stapo serve MODEL [vLLM server options]")
    args = list(vllm_args)
    defaults = [("--worker-extension-cls", WORKER_EXTENSION), ("--logprobs-mode", "processed_logprobs")]
    if on_cpu:  # see cpu_engine_kwargs: a partially prefilled seeded request breaks the CPU sampler
        max_model_len = _value(args, "--max-model-len")
        batched = max(int(max_model_len), 4096) if max_model_len and max_model_len.isdigit() else 4096
        defaults.append(("--max-num-batched-tokens", str(batched)))
    for option, value in defaults:
        if not _has(args, option):
            args += [option, value]
    if on_cpu and not _has(args, "--enable-chunked-prefill") and not _has(args, "--no-enable-chunked-prefill"):
        args.append("--no-enable-chunked-prefill")
    out_env = dict(env)
    out_env["VLLM_SERVER_DEV_MODE"] = "1"
    if on_cpu:
        out_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_BYTES // 2**30))
    return [python, "-m", SERVER_MODULE, "--model", model, *args], out_env
