"""bench/gpu_step.py's arithmetic and tables: the lm_head's FLOP share (from the config) and the Markdown report.

FLOP conventions are ``stapo.telemetry.mfu``'s (model FLOPs: forward + backward = 3 x forward, the head at the
response positions only). The chunked head op (``stapo.losses.ops``) executes more than its model FLOPs in the
update: the forward also forms the per-token Jacobian (``softmax @ W``, a second ``2 H V`` per token) and the
backward recomputes the logits before forming the weight gradient, so it runs 4 matmuls of ``2 H V`` per
response token where the model count has 3. All in fp32 (log-probs and entropies are computed in fp32).
"""

from __future__ import annotations

from stapo.telemetry.mfu import causal_context_length, forward_flops, head_params, phase_throughput

HEAD_MATMULS_UPDATE = 4  # logits + Jacobian forward, logits recomputed + weight gradient backward


def head_flop_shares(config, lengths: list[int], response_tokens: int) -> dict[str, float]:
    """The lm_head's share of a pass's FLOPs: of the model FLOPs (either phase: both count 1x or 3x the
    forward for head and body alike), and of the FLOPs the update executes (body 3x, head 4 matmuls)."""
    tokens = sum(lengths)
    total = forward_flops(config, tokens, causal_context_length(lengths) * tokens, head_tokens=response_tokens)
    head = 2.0 * head_params(config) * response_tokens
    executed = HEAD_MATMULS_UPDATE * head / (3 * (total - head) + HEAD_MATMULS_UPDATE * head)
    return {"head_flop_share": head / total, "head_flop_share_update_executed": executed}


def flops_table(configs: dict, seqs: dict) -> str:
    """Markdown: per shape, the head's parameters and FLOP shares on the bench's batch ``seqs``."""
    lengths, response = seqs["lengths"], int(seqs["response_mask"].sum())
    lines = [f"lm_head FLOP share, {len(lengths)} sequences, {sum(lengths):,} tokens ({response:,} response "
             f"tokens: the head runs there only)", "",
             "| shape | vocab | head params | decoder matmul params | head share of model FLOPs (stats and update) "
             "| head share of the update's executed FLOPs |", "|---|---:|---:|---:|---:|---:|"]
    for name, config in configs.items():
        shares = head_flop_shares(config, lengths, response)
        head = head_params(config)
        body = 2 * config.num_hidden_layers * config.hidden_size * config.head_dim * (
            config.num_attention_heads + config.num_key_value_heads) + \
            3 * config.num_hidden_layers * config.hidden_size * config.intermediate_size
        lines.append(f"| {name} | {config.vocab_size:,} | {head / 1e6:,.1f}M | {body / 1e6:,.1f}M "
                     f"| {shares['head_flop_share']:.1%} | {shares['head_flop_share_update_executed']:.1%} |")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ratio(base, value):
    return None if not base or not value else base / value


def report(data: dict) -> str:
    """Markdown table of ``data["rows"]`` (bench/gpu_step.py): seconds, tokens/s, MFU and the head's share per
    phase, peak memory, and step-time ratios vs padded (same attention and ZeRO) and vs sdpa (same layout and
    ZeRO). ``data["forward_flops"]``: one pass over the batch (both phases make one)."""
    rows, tokens, peak = data["rows"], data["tokens"], data["peak"]
    done = [r for r in rows if "error" not in r]
    for r in done:
        r["step_s"] = r["stats_s"] + r["update_s"]
        r.update(phase_throughput("stats", tokens, r["stats_s"], data["forward_flops"], peak, backward=False))
        r.update(phase_throughput("update", tokens, r["update_s"], data["forward_flops"], peak, backward=True))
        r["head_share_stats"] = data["head_stats_s"] / r["stats_s"]
        r["head_share_update"] = data["head_update_s"] / r["update_s"]
    step = {(r["attn"], r["layout"], r["zero"]): r["step_s"] for r in done}
    lines = ["| attention | layout | micro-batch | ZeRO | stats s | stats tok/s | stats MFU | head % stats | update s "
             "| update tok/s | update MFU | head % update | update micro-batches | peak GiB | step s "
             "| × vs padded | × vs sdpa |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['attn']} | {r['layout']} | {r['cut']} | {r['zero']} "
        if "error" in r:
            lines.append(head + f"| {r['error']} |" + " |" * 12)
            continue
        padded = _ratio(step.get((r["attn"], "padded", r["zero"])), r["step_s"])
        sdpa = _ratio(step.get(("sdpa", r["layout"], r["zero"])), r["step_s"])
        lines.append(
            head + f"| {r['stats_s']:.2f} | {r['tokens_per_s_stats']:,.0f} | {_fmt(r.get('mfu_stats'), '.1%')} "
            f"| {r['head_share_stats']:.0%} | {r['update_s']:.2f} | {r['tokens_per_s_update']:,.0f} "
            f"| {_fmt(r.get('mfu_update'), '.1%')} | {r['head_share_update']:.0%} | {r['micro_batches']:.0f} "
            f"| {_fmt(r['peak_gib'], '.1f')} | {r['step_s']:.2f} | {_fmt(padded, '.2f')} | {_fmt(sdpa, '.2f')} |")
    lines += ["", f"lm_head alone on the {data['response_tokens']:,} response tokens: {data['head_stats_s']:.2f} s "
              f"no-grad, {data['head_update_s']:.2f} s forward + backward; its share of the model FLOPs "
              f"{data['head_flop_share']:.1%} (of the update's executed FLOPs {data['head_flop_share_update_executed']:.1%})"]
    ratios = [f"{a} {layout} {step[(a, layout, 3)] / step[(a, layout, 1)]:.2f}×"
              for (a, layout, z) in step if z == 1 and (a, layout, 3) in step]
    if ratios:
        lines += ["", "ZeRO-3 / ZeRO-1 step time: " + ", ".join(ratios)]
    return "\n".join(lines)
