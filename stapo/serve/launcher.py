"""``stapo serve MODEL [vLLM server options]``: vLLM's own OpenAI-compatible server with what
``rollout.mode: server`` needs added (docs/rollout.md, "Rollout servers", "Security").

Options are read as vLLM's parser reads them (``--api_key`` is ``--api-key``, ``--hos`` is ``--host``): an option
stapo reads must be given once, in full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stapo.serve.guard import GUARD_MIDDLEWARE
from stapo.serve.secret import TOKEN_ENV
from stapo.serve.worker_extension import WORKER_EXTENSION
from stapo.sync.weight_group import STEP_TIMEOUT_ENV

__all__ = ["CPU_KV_CACHE_BYTES", "SERVER_MODULE", "cpu_engine_kwargs", "serve_command", "take_token_file"]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOOPBACK = "127.0.0.1"
CPU_KV_CACHE_BYTES = 2 * 2**30  # vLLM's CPU build: KV cache size when neither the caller nor the env sets one
# vLLM's limit on one engine step; above rollout.server.sync_timeout_s (keep it so) so a stalled sync fails first
STEP_TIMEOUT_S = 900
# options stapo reads, or that change what stapo guards: each given at most once, never abbreviated
_READ = ("--host", "--api-key", "--max-model-len", "--token-file")


def cpu_engine_kwargs(max_model_len: int, env: Mapping[str, str]) -> dict:
    """`vllm.LLM` settings for vLLM's CPU build (0.32), the colocated engine's and `stapo serve`'s: a fixed KV
    cache unless ``VLLM_CPU_KVCACHE_SPACE`` is set (there ``gpu_memory_utilization`` is a fraction of the RAM
    per engine: two ranks at 0.5 ask for all of it), and whole-prompt prefill (a partially prefilled seeded
    request rewinds its generator's offset, which CPU generators refuse)."""
    out = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}
    if "VLLM_CPU_KVCACHE_SPACE" not in env:
        out["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return out


def _name(arg: str) -> str | None:
    """The option ``arg`` names as vLLM's parser reads it (``--api_key=k`` -> ``--api-key``), else None."""
    if not arg.startswith("--"):
        return None
    key = arg.split("=", 1)[0].split(".", 1)[0]  # `--opt.key value`: a field of --opt's JSON
    return "--" + key[2:].replace("_", "-")


def _check_options(args: Sequence[str]) -> None:
    """Every option of `_READ` at most once and in full (vLLM's argparse takes the last one, expands prefixes)."""
    names = [n for n in map(_name, args) if n is not None]
    for name in names:
        full = [o for o in _READ if o != name and o.startswith(name) and len(name) > 3]
        if full:
            raise ValueError(f"vLLM would read {name} as {full[0]}: write {full[0]} in full")
    for option in _READ:
        if names.count(option) > 1:
            raise ValueError(f"{option} is given {names.count(option)} times (vLLM would take the last): "
                             "give it once")


def _has(args: Sequence[str], option: str) -> bool:
    return any(_name(a) == option for a in args)


def _value(args: Sequence[str], option: str) -> str | None:
    for i, a in enumerate(args):
        if _name(a) == option:
            return a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
    return None


def take_token_file(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(--token-file's value or None, the other arguments)``: stapo's own option among vLLM's."""
    _check_options(args)
    path, rest, skip = _value(args, "--token-file"), [], False
    for a in args:
        if skip or _name(a) == "--token-file":
            skip = not skip and "=" not in a
            continue
        rest.append(a)
    return path, rest


def serve_command(model: str, vllm_args: Sequence[str], python: str, env: Mapping[str, str],
                  on_cpu: bool, secret: str | None = None) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of the server process (pure); ``secret``: the one its guard checks."""
    if not model or model.startswith("-"):
        raise ValueError("stapo serve needs the model first: stapo serve MODEL [vLLM server options]")
    args = list(vllm_args)
    _check_options(args)
    if _has(args, "--api-key"):
        raise ValueError("stapo serve guards every route with its shared secret (vLLM's --api-key covers /v1 only): "
                         "drop --api-key (docs/rollout.md, \"Security\")")
    if env.get("VLLM_API_KEY"):
        raise ValueError(f"VLLM_API_KEY makes vLLM demand its own key on /v1 routes, which the trainer does not send: "
                         f"unset it; {TOKEN_ENV} guards every route")
    if _value(args, "--host") is None:
        args += ["--host", LOOPBACK]
    args += ["--middleware", GUARD_MIDDLEWARE]
    defaults = [("--worker-extension-cls", WORKER_EXTENSION), ("--logprobs-mode", "processed_logprobs")]
    if on_cpu:  # the colocated engine's CPU settings: a partially prefilled seeded request breaks the CPU sampler
        given = _value(args, "--max-model-len")
        batched = cpu_engine_kwargs(int(given) if given and given.isdigit() else 0, env)["max_num_batched_tokens"]
        defaults.append(("--max-num-batched-tokens", str(batched)))
    for option, value in defaults:
        if not _has(args, option):
            args += [option, value]
    if on_cpu and not _has(args, "--enable-chunked-prefill") and not _has(args, "--no-enable-chunked-prefill"):
        args.append("--no-enable-chunked-prefill")
    out_env = dict(env)
    if secret is not None:
        out_env[TOKEN_ENV] = secret
    out_env["VLLM_SERVER_DEV_MODE"] = "1"
    # uvicorn takes a caller's address from X-Forwarded-For when it connects from loopback; the guard checks a
    # join's store against the caller's address, so no header may name it (a proxy in front: set this to its IP)
    out_env.setdefault("FORWARDED_ALLOW_IPS", "")
    out_env.setdefault(STEP_TIMEOUT_ENV, str(STEP_TIMEOUT_S))
    if on_cpu:
        out_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_BYTES // 2**30))
    return [python, "-m", SERVER_MODULE, "--model", model, *args], out_env
