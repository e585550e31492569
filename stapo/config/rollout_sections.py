"""The rollout sections of :class:`stapo.config.STAPOConfig`: ``rollout`` and its ``rollout.tools``.

The largest section (engines, rollout servers and their limits, asynchronous and partial rollouts, weight
syncs, tool-integrated episodes), kept apart from the other stages' sections in :mod:`stapo.config.sections`;
every field carries its docstring, from which ``docs/configuration.md`` is generated.
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
    """Run each rollout row as an episode: the policy's turns, stopped at a tool call, alternate with the
    tools' results (context tokens: read, never trained), until a final answer, ``max_turns`` or
    ``rollout.max_response_length`` tokens (policy + context). Prompts list the tools (chat template)."""
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
        """What tool ``name`` is built with in training: the shared per-call limits (``timeout_s``,
        ``max_output_chars``; ``stateful`` for a tool that has state), then its own ``params``, which win; and
        a note for each shared limit its own params replace (the trainer logs them, ``stapo tools`` shows them)."""
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
    """A file holding the servers' shared secret (the one ``stapo serve`` names on its first line; only its owner
    may read it). Read after ``STAPO_SERVER_TOKEN``; default: ``stapo serve``'s default file
    (``$STAPO_CACHE/server_token``, else ``~/.cache/stapo/server_token``) when it exists. A secret is never given on
    a command line, where every local process can read it (docs/rollout.md, "Security")."""
    sync_host: Union[str, None] = None
    """The trainer's address the servers reach for the weight broadcast (its TCPStore and gloo sockets bind it,
    nothing else). Default: 127.0.0.1 when every server is local, else this machine's address on the route to
    them."""
    request_timeout_s: float = 600.0
    """A generation request's time limit is this plus ``request_timeout_per_token_s`` × ``max_response_length`` (a
    server that stops answering its health route is found far sooner: ``down_after_s``)."""
    request_timeout_per_token_s: float = 0.1
    """Seconds added to a request's time limit per token it may generate."""
    request_retries: int = 2
    """Retries of a request that got a 5xx or a malformed reply from a server (each logged) before the server is
    declared down and its requests go to the others; a refused connection declares it down at once, and a 4xx fails
    that request only (its rows come back empty)."""
    down_after_s: float = 60.0
    """A server that does not answer ``/health`` for this long while requests are in flight is declared down and its
    requests go to the others."""
    health_interval_s: float = 5.0
    """How often the servers with requests in flight are probed."""
    health_timeout_s: float = 5.0
    """The limit of one health probe or state read."""
    sync_timeout_s: float = 300.0
    """The limit of each step of a weight sync (the weight group forming, one bucket, the servers loading what they
    received). Keep it under the servers' ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (``stapo serve`` sets 900 s): a
    server waiting longer for a stalled trainer is killed by vLLM's watchdog."""
    sync_join_timeout_s: float = 30.0
    """Every server checks in for a weight sync within this, or the sync is called off and retried without the ones
    that did not (a server lost while joining never leaves the others waiting). At most 60: a server waits no longer
    for the trainer's go."""
    sync_retries: int = 2
    """Times a failed weight sync is retried (with the servers that still answer) before the run checkpoints and
    stops."""
    sync: str = "full"
    """``full`` sends every bucket whole at each sync; ``delta`` sends a bucket's changed elements (positions and
    values) when that is smaller, which at RL learning rates on bf16 weights is most of them, and proves every sync
    bit-exact with a checksum per bucket. It costs rank 0 one host copy of the policy in the servers' dtype and each
    server worker one more (docs/rollout.md, "Delta syncs")."""


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
    """Rollout engine from the registry (``stapo.rollout.registry``): ``hf`` (transformers, CPU or
    GPU), ``vllm`` (colocated, GPU), a user-registered one, or ``auto`` (vLLM when a GPU and vllm are
    available, else HF)."""
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
    """vLLM tensor-parallel size: each group of this many consecutive ranks shares one engine (it must
    divide the number of ranks); the group generates the union of its ranks' prompts and each rank keeps
    its own (docs/gpu.md). 1: one engine per rank."""
    sleep_level: int = 1
    """vLLM sleep level between rollouts. 1: the weights are copied into pinned host memory at every
    sleep (28 GB per rank for 14B in bf16: ~236 GB of host RAM on a node of 8), though every sync
    overwrites them; 2: they are discarded (vLLM's mode for weight updates) and pushed again before the
    next generation (one extra sync after an evaluation or a dynamic-sampling round). docs/gpu.md."""
    offload_training_state: bool = False
    """Colocated vLLM: move the training side's ZeRO state (parameter and gradient shards, fp32 master
    weights, AdamW moments: ~29.5 GB per rank for 14B on 8 ranks under ZeRO-3) to pinned host memory
    while vLLM starts and generates, and back before the update; training is bit-identical. The memory
    it frees lets ``gpu_memory_utilization`` grow, i.e. the KV cache (docs/gpu.md, "Colocated memory")."""
    sync_bucket_mb: int = 256
    """Size of the buckets in which ZeRO-3 shards are gathered and pushed into the engine."""
    max_batch_size: int = 256
    """HF engine: sequences decoded together."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling ("filter groups"): drop groups whose G rewards are all equal and
    generate more prompts until the batch holds ``trainer.train_batch_size`` informative groups (off
    in the paper: "not applied to any of the baselines"; docs/grpo_options.md)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling: generation rounds per step at most; then the step trains on the informative
    groups every rank could fill (a warning and the ``sampling_capped`` metric)."""
    mode: str = "colocated"
    """Where rollouts run. ``colocated`` (the paper's setup): each trainer rank owns an engine
    (``rollout.engine``) and generation, training and the weight sync take turns on the same devices.
    ``server``: vLLM server processes of their own (``stapo serve MODEL``, any node), listed in
    ``rollout.server.addresses``; the trainer's global rank 0 broadcasts the weights into them after every step,
    and ``rollout.engine`` is not used (docs/rollout.md, "Rollout servers")."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """``server`` mode: the servers, the secret, time limits and retries, the weight sync's transport."""
    partial: bool = False
    """``server`` mode with ``max_staleness`` >= 1: partial rollouts. The weight sync does not wait for the
    batch under way: its requests are cut, keep the tokens they produced (each labelled with the policy
    version that sampled it), and go on after the sync from prompt + those tokens with the new weights, so
    the long tail of long responses no longer stalls the sync (docs/rollout.md, "Partial rollouts"). With
    ``tools.enabled`` a tool episode cut in the middle of a turn continues that turn the same way."""
    producer_close_timeout_s: float = 60.0
    """``server`` mode with ``max_staleness`` >= 1: how long the end of a run waits for a generation in
    flight to finish."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Tool-integrated reasoning: multi-turn episodes with tool calls (off by default; docs/tir.md)."""
    max_staleness: int = 0
    """k: asynchronous training, ``server`` mode. 0 (the default and the paper's setting): generate, train,
    sync in lock-step. k >= 1: a producer generates the next iterations' batches while the trainer updates;
    a batch is sampled by a policy at most k versions older than the one it trains (docs/algorithm.md,
    "Asynchronous training")."""
