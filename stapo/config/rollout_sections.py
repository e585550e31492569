"""The rollout sections of :class:`stapo.config.STAPOConfig`: ``rollout``, ``rollout.server`` and
``rollout.tools``; the docstring under each field feeds ``docs/configuration.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

__all__ = ["RolloutConfig", "ServerConfig", "ToolsConfig"]


@dataclass
class ToolsConfig:
    """Multi-turn tool-integrated episodes (docs/tir.md). Off by default: one prompt, one response."""

    REMOVED_KEYS = {old: (0, f"={{value}} is reward.tool_{old} now: write reward.tool_{old}={{value}} (tool shaping is a reward "
                             "term beside reward.overlong_*: reward.tool_error_penalty, tool_call_budget, tool_call_penalty)")
                    for old in ("error_penalty", "call_budget", "call_penalty")}

    enabled: bool = False
    """Run each rollout row as an episode: the policy's turns alternate with the tools' results (context tokens:
    read, never trained) until a final answer, ``max_turns`` or ``rollout.max_response_length`` tokens."""
    names: list = field(default_factory=lambda: ["python"])
    """Tools the policy may call, from the registry (``stapo tools`` lists them)."""
    parser: str = "qwen3"
    """Tool-call format: ``qwen3`` (``<tool_call>{json}</tool_call>``, results as the chat template's tool
    turn) or ``python_block`` (fenced python blocks, results inline; docs/tools.md)."""
    max_turns: int = 4
    """Policy turns per episode at most (a turn that still calls a tool at the limit ends the episode,
    finish reason ``length``)."""
    stateful: bool = True
    """Tools with state (``python``): one session per episode, so variables persist across its calls."""
    timeout_s: float = 10.0
    """Wall-clock limit of one tool call (a call past it is a tool error)."""
    max_output_chars: int = 2000
    """A tool's output is cut to this many characters (cut output is a tool error)."""
    params: dict = field(default_factory=dict)
    """Further parameters per tool, e.g. ``{python: {memory_mb: 1024}}`` (``stapo tools`` lists them)."""
    max_workers: int = 8
    """Tool calls run at once (across the batch's episodes; one episode's calls run in order)."""
    eval_without_tools: bool = False
    """Evaluation also runs the held-out prompts without tools (prompts that offer none, one turn each):
    ``eval_no_tools_accuracy`` next to ``eval_accuracy``."""

    def settings_of(self, name: str) -> tuple[dict, list[str]]:
        """What tool ``name`` is built with in training: the shared per-call limits, then its own ``params``, which
        win; and a note for each shared limit they replace (logged)."""
        from stapo.tools import tool_params

        shared = {"timeout_s": self.timeout_s, "max_output_chars": self.max_output_chars}
        if "stateful" in tool_params(name):
            shared["stateful"] = self.stateful
        own = self.params.get(name, {})
        notes = [f"rollout.tools.params.{name}.{k}={own[k]!r} replaces rollout.tools.{k}={v!r} for {name}"
                 for k, v in shared.items() if k in own and own[k] != v]
        return {**shared, **own}, notes


@dataclass
class ServerConfig:
    """``rollout.mode: server``: the vLLM servers and how the trainer talks to them (docs/rollout.md, "Rollout
    servers"); not read in colocated mode."""

    addresses: list = field(default_factory=list)
    """``host:port`` of every vLLM server (``stapo serve MODEL``). Requests go to the least loaded one; a server
    that stops answering is left out (a warning names it) until it is back and re-synced."""
    token_file: Union[str, None] = None
    """A file holding the servers' shared secret, read after ``STAPO_SERVER_TOKEN``; default: ``stapo serve``'s
    default file when it exists (never on a command line; docs/rollout.md, "Security")."""
    sync_host: Union[str, None] = None
    """The trainer's address the servers reach for the weight broadcast. Default: 127.0.0.1 when every server is
    local, else this machine's address on the route to them."""
    request_timeout_s: float = 600.0
    """A generation request's time limit is this plus ``request_timeout_per_token_s`` × ``max_response_length`` (a
    server that stops answering its health route is found far sooner: ``down_after_s``)."""
    request_timeout_per_token_s: float = 0.1
    """Seconds added to a request's time limit per token it may generate."""
    request_retries: int = 2
    """Retries of a request that got a 5xx or a malformed reply (each logged) before the server is declared down;
    a refused connection declares it down at once, a 4xx fails that request only."""
    down_after_s: float = 60.0
    """A server that does not answer ``/health`` for this long while requests are in flight is declared down and its
    requests go to the others."""
    health_interval_s: float = 5.0
    """How often the servers with requests in flight are probed."""
    health_timeout_s: float = 5.0
    """The limit of one health probe or state read."""
    sync_timeout_s: float = 300.0
    """The limit of each step of a weight sync; keep it under the servers' ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``
    (``stapo serve`` sets 900 s), past which vLLM's watchdog kills a waiting server."""
    sync_join_timeout_s: float = 30.0
    """Every server checks in for a weight sync within this, or the sync is retried without the ones that did not;
    forming the group after the check-in is bounded by it too. At most 60: a server waits no longer for the
    trainer's go."""
    sync_retries: int = 2
    """Times a failed weight sync is retried (with the servers that still answer) before the run checkpoints and
    stops."""
    sync: str = "full"
    """``full`` sends every bucket whole; ``delta`` sends a bucket's changed elements when that is smaller, checked
    bit-exact per bucket, for one host copy of the policy on rank 0 and each server (docs/rollout.md, "Delta syncs")."""


#: the flat ``rollout.*`` keys that are ``rollout.server.*`` now (old name -> new name)
MOVED_TO_SERVER = {"servers": "addresses", "server_token_file": "token_file", "server_down_after_s": "down_after_s",
                   **{k: k for k in ("sync_host", "sync", "sync_timeout_s", "sync_join_timeout_s", "sync_retries",
                                     "request_timeout_s", "request_timeout_per_token_s", "request_retries",
                                     "health_interval_s", "health_timeout_s")}}


@dataclass
class RolloutConfig:
    # a secret in a config or an override sits in /proc/PID/cmdline, which every local process reads; an old
    # flat server key still holding its default (a run directory's saved config) is read as nothing
    REMOVED_KEYS = {"server_token": (None, "is no longer read (a secret on a command line is readable by every local "
                                           "process): put it in a file only you can read and set "
                                           "rollout.server.token_file, or export STAPO_SERVER_TOKEN"),
                    **{old: (getattr(ServerConfig(), new), f"moved: use rollout.server.{new}")
                       for old, new in MOVED_TO_SERVER.items()}}
    engine: str = "auto"
    """Rollout engine from the registry: ``hf`` (transformers), ``vllm`` (colocated, GPU), a user-registered one,
    or ``auto`` (vLLM when a GPU and vllm are available, else HF)."""
    group_size: int = 8
    """G: responses sampled per prompt (paper: 8)."""
    temperature: float = 1.0
    """Sampling temperature during training (paper: 1.0); token stats use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold during training (paper: 1.0)."""
    top_k: int = -1
    """Top-k sampling (-1 disables)."""
    max_response_length: int = 15360
    """Maximum generated tokens per response (paper: 15k)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take while awake (colocated with training)."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size: each group of this many consecutive ranks shares one engine (it must divide the
    number of ranks; docs/gpu.md). 1: one engine per rank."""
    sleep_level: int = 1
    """vLLM sleep level between rollouts: 1 copies the weights to pinned host memory at every sleep; 2 discards
    them and pushes them again before the next generation (docs/gpu.md)."""
    offload_training_state: bool = False
    """Colocated vLLM: move the training side's ZeRO state to pinned host memory while vLLM generates, bit-identical,
    so ``gpu_memory_utilization`` (the KV cache) can grow (docs/gpu.md, "Colocated memory")."""
    sync_bucket_mb: int = 256
    """Size of the buckets in which ZeRO-3 shards are gathered and pushed into the engine."""
    max_batch_size: int = 256
    """HF engine: sequences decoded together."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose G rewards are all equal and generate more until the batch is
    full (off in the paper; docs/grpo_options.md)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: generation rounds per step at most; then the step trains on the informative
    groups every rank could fill (a warning and the ``sampling_capped`` metric)."""
    mode: str = "colocated"
    """``colocated`` (the paper's): each rank owns an engine and takes turns on its devices; ``server``: the
    ``stapo serve`` processes of ``rollout.server.addresses`` (docs/rollout.md, "Rollout servers")."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """``server`` mode: the servers, the secret, time limits and retries, the weight sync's transport."""
    partial: bool = False
    """``server`` mode with ``max_staleness`` >= 1: a sync cuts the requests under way, which keep their tokens and
    continue with the new weights (tool episodes too; docs/rollout.md, "Partial rollouts")."""
    producer_close_timeout_s: float = 60.0
    """``server`` mode with ``max_staleness`` >= 1: how long the end of a run waits for a generation in
    flight to finish."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Tool-integrated reasoning: multi-turn episodes with tool calls (off by default; docs/tir.md)."""
    max_staleness: int = 0
    """k: 0 (the paper's) runs in lock-step; k >= 1 (``server`` mode) generates ahead with a policy at most k
    versions old (docs/algorithm.md, "Asynchronous training")."""
