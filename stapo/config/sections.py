"""The sections of :class:`stapo.config.STAPOConfig`, one dataclass per pipeline stage; the docstring under
each field feeds ``docs/configuration.md``. Defaults are the paper's (Table 6 / App. D) unless it says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from stapo.data import PAPER_INSTRUCTION
from stapo.losses.ops import DEFAULT_CHUNK_SIZE


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (PEFT) instead of every weight (docs/lora.md). Needs ``pip install 'stapo[lora]'``."""
    rank: int = 16
    """r: rank of each adapter ``B A`` (``A``: r x in, ``B``: out x r)."""
    alpha: float = 32.0
    """lora_alpha: the update is scaled by ``alpha / rank`` (2 at the defaults)."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training. 0 keeps the ratio exactly 1 at the first update
    (with dropout the clip sees noise)."""
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"])
    """Module names (suffixes) that get adapters; the default is every projection of a Qwen3 decoder
    block (attention and MLP)."""
    export_merged: bool = False
    """Also write the merged model (base + adapters, loadable with plain ``from_pretrained``) to
    ``output_dir/final/merged``; ``final/`` itself holds the adapter (``trainer.export_hf``)."""


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"
    """HF model directory or hub name of the policy; ``builtin:tiny`` builds the tiny Qwen3 demo model
    (with its supervised warm start, see ``tiny``) offline and caches it."""
    dtype: str = "auto"
    """Training dtype: ``auto`` (bf16 on GPU, fp32 on CPU), ``bf16`` or ``fp32``."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (about a third more compute for one layer's activation memory
    instead of all; docs/benchmarks.md, "Memory knobs")."""
    compile_layers: bool = False
    """``torch.compile`` each decoder layer of the policy (the first micro-batches of a run pay the compilation;
    needs a C++ compiler on CPU). Exact to float rounding; measured in docs/benchmarks.md, "Memory knobs"."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the model and tokenizer."""
    attn_implementation: str = "auto"
    """Attention kernel: ``auto`` (the best that runs here), ``sdpa``, ``eager``, ``flex_attention`` (CUDA only),
    ``flash_attention_2``/``_3`` (docs/gpu.md, "Attention over packed rows")."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (off by default: full fine-tuning, as in the paper)."""


@dataclass
class TinyConfig:
    seed: int = 0
    """Seed of the tiny model's random initialization and of its warm-start data."""
    terms: int = 5
    """Operands per problem of the synthetic arithmetic task (``builtin:arithmetic`` prompts and
    the warm-start data): 5 gives four worked steps, ``7+5=12. 12-3=9. 9+8=17. 17-4=13.``"""
    warm_start_steps: int = 600
    """Supervised warm-start steps on the synthetic arithmetic task before RL (0 disables)."""
    warm_start_lr: float = 3e-3
    """Learning rate of the supervised warm start."""
    warm_start_bare_fraction: float = 0.5
    """Fraction of warm-start examples whose target is the bare answer (``\\boxed{17}``) instead of
    the worked solution; RL then learns which form earns the reward (docs/demo.md)."""
    task: str = "arithmetic"
    """The tiny demo's task: ``arithmetic`` (docs/demo.md) or ``tir`` (products it cannot work out in its head,
    with a calculator to call: its own tokenizer, model, warm start and problems; docs/tir.md)."""
    warm_start_tool_fraction: float = 0.4
    """``task: tir``: fraction of the warm-start examples whose prompt offers the calculator that call it
    (half the examples offer it); the rest answer directly."""


@dataclass
class DataConfig:
    source: str = "builtin:arithmetic"
    """Training prompts: an HF dataset name, a local .jsonl/.json/.parquet file, or
    ``builtin:arithmetic`` (the synthetic task of the tiny demo)."""
    preset: Union[str, None] = None
    """Dataset preset that fixes the field mapping, e.g. ``dapo_math_17k``."""
    split: str = "train"
    """Dataset split to read."""
    prompt_field: str = "prompt"
    """Column holding the problem (a string or chat messages); dotted paths allowed."""
    answer_field: str = "answer"
    """Column holding the ground-truth answer; dotted paths allowed (``reward_model.ground_truth``)."""
    instruction: str = PAPER_INSTRUCTION
    """Instruction appended to each problem (paper §5.1)."""
    max_prompt_length: int = 1024
    """Prompts longer than this many tokens are dropped (the count is logged)."""
    num_builtin_problems: int = 20000
    """Number of synthetic problems when ``source`` is ``builtin:arithmetic``."""
    eval_source: Union[str, None] = None
    """Held-out prompts for periodic evaluation (same formats as ``source``); ``builtin:arithmetic``
    draws a disjoint held-out set."""
    eval_size: int = 200
    """Number of held-out prompts evaluated (greedy decoding)."""


@dataclass
class RewardConfig:
    mode: str = "math"
    """Verifier: ``math`` (extraction + normalization + exact/symbolic equivalence), ``dapo`` (DAPO's
    original verifier: last ``Answer:`` line, exact string match) or ``dapo_boxed`` (verl's later DAPO
    verifier with a ``\\boxed{}`` fallback, the one that suits the paper's boxed prompt)."""
    timeout_s: float = 5.0
    """Hard wall-clock limit per answer for symbolic comparison (a timeout scores -1); for
    ``reward.function``, per call (per item, or per batch when batched)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (Eq. 13), L_cache in tokens: responses longer than
    ``rollout.max_response_length - overlong_buffer`` lose up to ``overlong_penalty``, linearly; 0 = off."""
    overlong_penalty: float = 1.0
    """Largest soft overlong penalty (reached at ``rollout.max_response_length``), added to the score."""
    tool_error_penalty: float = 0.0
    """Tool shaping of tool-integrated episodes (docs/tir.md): subtracted once per tool error of an
    episode (0: off, the verifier alone)."""
    tool_call_budget: int = 0
    """Tool shaping: tool calls per episode that cost nothing; each call beyond costs ``tool_call_penalty``."""
    tool_call_penalty: float = 0.0
    """Tool shaping: subtracted per tool call beyond ``tool_call_budget`` (0: off)."""
    function: Union[str, None] = None
    """User reward function, ``pkg.module:callable`` or ``path/to/file.py:callable``, run in killable
    worker processes; it replaces the verifier (``reward.mode`` then reads ``function`` or stays ``math``)."""
    function_batched: bool = False
    """``reward.function`` takes the whole batch: ``(responses, ground_truths, **columns) -> list[float]``;
    otherwise one call per item: ``(response, ground_truth, **fields) -> float``."""
    failure_value: float = -1.0
    """Reward of an item whose ``reward.function`` call raised, hung past ``timeout_s`` or crashed."""

    @property
    def scorer_mode(self) -> str:
        """The registry mode that scores: ``function`` whenever ``reward.function`` is set."""
        return "function" if self.function else self.mode


@dataclass
class MaskConfig:
    name: str = "stapo"
    """Token mask from the registry (``stapo masks`` lists them), e.g. ``stapo``, ``none``, the token-weighting
    ``stare`` and ``clip_cov``, or a user-registered one."""
    params: dict = field(default_factory=dict)
    """Keyword parameters of the mask, e.g. ``{tau_p: 0.002, entropy_quantile: 0.8}`` (the paper's "tau_h = 20%");
    overriding ``mask.name`` drops the recipe's params unless set again (docs/custom_masks.md)."""
    stats_source: str = "fresh"
    """Stats the mask sees for mini-batches after the first: ``fresh`` (a no-grad pass of the current
    policy, exact per Algorithm 1 line 8) or ``old`` (reuse the rollout-time pass; cheaper approximation)."""


@dataclass
class LossConfig:
    REMOVED_KEYS = {"tis_cap": (None, "={value} was removed: write loss.rollout_is=token loss.rollout_is_threshold={value} "
                                      "(the same truncated importance weights)")}
    clip_low: float = 0.2
    """epsilon_low of the clipped surrogate (ratio floor 1 - clip_low)."""
    clip_high: float = 0.28
    """epsilon_high of the clipped surrogate (clip-higher, ratio ceiling 1 + clip_high)."""
    clip_c: Union[float, None] = None
    """Dual-clip constant (> 1) for negative advantages; None disables (the default, as in the paper's
    Eq. 1; verl enables it by default with ``clip_ratio_c = 3``)."""
    agg: str = "token-mean"
    """Loss aggregation: ``token-mean`` (paper Eq. 1, over kept tokens of the whole mini-batch),
    ``seq-mean-token-mean`` (original GRPO) or ``seq-mean-token-sum-norm`` (Dr.GRPO)."""
    advantage_scale: str = "group"
    """``group``: divide by the group's reward std (Eq. 2); ``none``: Dr.GRPO's R - mean."""
    advantage_eps: float = 1e-6
    """Added to the group std in Eq. 2."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen initial policy (logged as ``kl``); 0 builds no reference model
    (the paper: no KL)."""
    log_ratio_clamp: float = 20.0
    """|log rho| is clamped to this before exponentiation (numerical safety only)."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Response tokens per chunk of the logprob/entropy op (one ``(chunk_size, vocab)`` fp32 buffer; tuned in
    ``bench/token_stats.py``, docs/losses.md)."""
    rollout_is: Union[str, None] = "auto"
    """Importance weights ``pi_old / pi_sampler`` (verl's ``rollout_is``; docs/losses.md, "Off-policy corrections"):
    ``token``, ``sequence``, null, or ``auto`` (``token`` when ``rollout.max_staleness >= 1``, else off)."""
    rollout_is_threshold: Union[float, str] = 2.0
    """A number ``C``: weights truncated at ``min(w, C)`` (TIS); ``"lo_hi"`` (e.g. ``"0.5_2.0"``): weights outside
    ``[lo, hi]`` zeroed, still in the normalizer (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the IS weights by their mean over the mini-batch on all ranks (valid tokens for ``token``,
    responses for ``sequence``), after the threshold (verl's ``rollout_is_batch_normalize``)."""
    rollout_rs: Union[str, None] = None
    """Rejection by divergences of ``log pi_old - log pi_sampler`` (verl's ``rollout_rs``), comma-separated:
    ``token_k1..3``, ``seq_sum_k1..3``, ``seq_mean_k1..3``, ``seq_max_k2..3``; null: off (docs/losses.md)."""
    rollout_rs_threshold: Union[float, str, None] = None
    """Bounds of ``rollout_rs``, one per option or one for all: an upper bound for k2/k3, a ratio band ``"lo_hi"``
    for k1 (a single ``hi``: ``[1/hi, hi]``)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: responses cut at ``rollout.max_response_length`` (finish reason
    ``length``) leave the loss and its normalizer."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``loss -= entropy_coef * token-mean entropy of the kept tokens`` (PPO's entropy
    term, verl's ``entropy_coeff``; the paper uses none)."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """AdamW learning rate (paper: 1e-6)."""
    warmup_steps: int = 10
    """Linear warm-up over the first N iterations (rollout steps, counted in optimizer steps), then
    constant (paper §5.1: 10)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (paper: 1.0)."""


@dataclass
class TrainerConfig:
    output_dir: str = "outputs/stapo"
    """Where metrics, checkpoints, plots and the exported model go; nothing is written elsewhere."""
    seed: int = 42
    """Seed of data order, sampling and initialization."""
    total_steps: int = 500
    """Training iterations (rollout steps) of Algorithm 1."""
    train_batch_size: int = 256
    """Prompts per iteration, over all ranks (paper: 256)."""
    mini_batch_size: int = 64
    """Prompts per optimizer step, over all ranks (paper: 64, i.e. 4 updates per rollout)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank (gradient accumulation; paper: 1); used when
    ``max_tokens_per_micro_batch`` is 0."""
    packing: bool = True
    """Pack each micro-batch's sequences into padding-free rows (equal to the padded path up to float rounding);
    ``false``: pad rows to the longest."""
    max_tokens_per_micro_batch: int = 0
    """Token budget (prompt + response) of one update micro-batch on one rank, balanced by length; 0: count
    rows with ``micro_batch_size`` instead."""
    max_tokens_per_stats_micro_batch: int = 0
    """Token budget of the no-grad stats pass (it holds no activations for backward, so it can take
    more); 0: twice ``max_tokens_per_micro_batch`` (or ``micro_batch_size`` rows when that is 0)."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage: 3 shards across ranks; 1 on one GPU (bf16 gradients accumulate in fp32); 0 only
    with fp32 weights."""
    offload: bool = False
    """Offload the optimizer state (and its step, DeepSpeedCPUAdam) to CPU (ZeRO-Offload); parameters
    stay on the accelerator."""
    save_every: int = 50
    """Checkpoint every N iterations (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Number of complete checkpoints kept."""
    resume: str = "auto"
    """``auto`` (continue the last checkpoint of the same experiment in output_dir), ``never``, ``force``, or a
    checkpoint path (docs/distributed.md, "Resuming")."""
    max_consecutive_skips: int = 5
    """Abort after this many consecutive steps skipped for a non-finite loss or grad norm."""
    eval_every: int = 0
    """Evaluate on the held-out set every N iterations (0: only before and after training)."""
    export_hf: bool = True
    """Write the final policy as a plain HF directory ``output_dir/final``."""
    collective_timeout_minutes: int = 120
    """How long a collective waits for the slowest rank before the run fails (DeepSpeed's 10 minutes is short
    when ranks generate uneven shares of long responses)."""


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO communication settings, tuned for one node (docs/distributed.md, "ZeRO-3 on one node";
    DeepSpeed's defaults in parentheses); stage-3 keys apply only at ``trainer.zero_stage`` 3."""

    param_persistence_threshold: int = 1_000_000
    """Parameters with fewer elements stay whole on every rank (DeepSpeed: 1e5): their gathers would be
    latency-bound; 1M keeps every Qwen3 norm and bias whole and partitions every projection."""
    prefetch_bucket_size: int = 200_000_000
    """Elements all-gathered ahead of use (DeepSpeed: 5e7): about two decoder layers of Qwen3-4B, so the next
    layer's gather overlaps this one's compute. 0 disables prefetching."""
    max_live_parameters: int = 1_000_000_000
    """Gathered elements a rank may hold before it releases some (DeepSpeed: 1e9); must be >=
    ``prefetch_bucket_size``."""
    max_reuse_distance: int = 1_000_000_000
    """A parameter used again within this many elements is kept, not re-gathered (DeepSpeed: 1e9): the last
    layers are not gathered twice at the forward/backward turn."""
    reduce_bucket_size: int = 100_000_000
    """Gradient elements reduce-scattered together (DeepSpeed: 5e8): bandwidth-bound on NVLink, yet the first
    reduction starts early in the backward."""
    overlap_comm: bool = True
    """Reduce gradients on a side stream while the backward continues (DeepSpeed: true at stage 3, false
    at stages 1-2)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (no fragmentation over many
    micro-batches; DeepSpeed: true)."""


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars to ``output_dir/tensorboard``."""
    wandb_project: Union[str, None] = None
    """Log to this Weights & Biases project (needs wandb installed)."""
    log_samples_every: int = 10
    """Log a few sample completions (silenced tokens highlighted) every N iterations (0: never)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    plot: bool = True
    """Write ``output_dir/curves.png`` at the end of training."""


@dataclass
class InspectConfig:
    record_every: int = 0
    """Record per-token statistics of the first mini-batch every N iterations for ``stapo inspect``
    (0: off)."""
    record_minibatches: str = "first"
    """Which mini-batches of a recorded iteration: ``first`` or ``all`` (one record file each; for rare
    classes such as the ~0.01% S2T tokens)."""
