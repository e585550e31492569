"""``stapo serve MODEL [vLLM server options]``: a vLLM server that stapo can train through.

It is vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, present
in vLLM 0.26 and in the CPU build 0.32, whose ``vllm`` command cannot find its own version) with
what ``rollout.mode: server`` needs added, unless the options already say otherwise:

- ``--worker-extension-cls`` stapo's worker extension (the weight-update session, the policy version);
- ``--logprobs-mode processed_logprobs``: the sampled token's log-prob under the distribution it was
  drawn from (temperature, top-k, top-p), as the colocated engine reports it;
- ``--host 127.0.0.1``: loopback only unless ``--host`` says otherwise, and any other address only with
  a shared secret (``STAPO_SERVER_TOKEN`` in the environment, the trainer's too);
- ``--middleware`` `stapo.rollout.server_guard.ServerGuard`: every route but ``/health`` needs the
  secret (when set), ``/collective_rpc`` takes stapo's worker methods only, vLLM's other control routes
  are refused (docs/rollout.md, "Security"); vLLM's own ``--api-key`` is refused (it guards ``/v1``
  only, and the secret covers it);
- ``VLLM_SERVER_DEV_MODE=1``: vLLM serves ``/collective_rpc`` and ``/reset_prefix_cache`` only then;
- ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=900`` unless set: a worker inside a weight sync's receive waits up to
  ``rollout.sync_timeout_s`` (300 s) for the trainer, and the engine's next step waits behind it; at vLLM's
  300 s default its watchdog, not the sync, would end a wait for a hung trainer — by killing the engine;
- on vLLM's CPU build, the colocated engine's CPU settings (`cpu_engine_kwargs`): whole-prompt prefill
  and a fixed KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB).

Every other option goes to vLLM unchanged (``--port``, ``--host``, ``--tensor-parallel-size``,
``--dtype``, ``--max-model-len``, ...).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from stapo.rollout.server_guard import GUARD_MIDDLEWARE, TOKEN_ENV
from stapo.rollout.vllm_engine import CPU_KV_CACHE_BYTES
from stapo.rollout.vllm_worker import WORKER_EXTENSION

__all__ = ["SERVER_MODULE", "is_loopback", "serve_command"]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOOPBACK = "127.0.0.1"
# vLLM's limit on one engine step; above rollout.sync_timeout_s (keep it so) so a stalled sync fails first.
STEP_TIMEOUT_ENV, STEP_TIMEOUT_S = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 900


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    if _has(args, "--api-key"):
        raise ValueError(f"stapo serve guards every route with {TOKEN_ENV} (vLLM's --api-key covers /v1 only): "
                         f"drop --api-key and set {TOKEN_ENV}=<secret> for stapo serve and the trainer")
    if env.get("VLLM_API_KEY"):
        raise ValueError(f"VLLM_API_KEY makes vLLM demand its own key on /v1 routes, which the trainer does not send: "
                         f"unset it and use {TOKEN_ENV}, which guards every route")
    host = _value(args, "--host")
    if host is not None and not is_loopback(host) and not env.get(TOKEN_ENV):
        raise ValueError(f"stapo serve --host {host} would let anyone who reaches it change the served weights: "
                         f"set {TOKEN_ENV}=<secret> in the environment of stapo serve and of the trainer "
                         "(docs/rollout.md, \"Security\"), or leave --host out to listen on loopback only")
    if host is None:
        args += ["--host", LOOPBACK]
    args += ["--middleware", GUARD_MIDDLEWARE]
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
    out_env.setdefault(STEP_TIMEOUT_ENV, str(STEP_TIMEOUT_S))
    if on_cpu:
        out_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_BYTES // 2**30))
    return [python, "-m", SERVER_MODULE, "--model", model, *args], out_env
