"""Silenced-token tables in the layout of paper App. C Tables 3–5 (Markdown and HTML).

One row per silenced token: its left context, the token highlighted, p, H, A and the top-k alternatives.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stapo.inspect.analysis import display_token
from stapo.inspect.records import TokenRecord

_MD_SPECIAL = "\\`*_[]<>|$#~"


@dataclass(frozen=True)
class SilencedToken:
    step: int
    minibatch: int
    row: int
    position: int
    token: str                    # exact token text
    context: str                  # left context, "…"-prefixed when cut
    prob: float
    entropy: float
    advantage: float
    reward: float
    top: tuple[tuple[str, float], ...]  # (text, prob) of the top-k alternatives


def _row_texts(record: TokenRecord) -> dict[int, tuple[str, dict[int, int]]]:
    """row -> (concatenated token texts in position order, an episode's tool turns in their places;
    token index -> char offset)."""
    rows, positions = record.row.tolist(), record.position.tolist()
    segments = {r.row: sorted((int(pos), str(text)) for pos, text in r.context) for r in record.rows}
    out: dict[int, tuple[list[str], dict[int, int], list[int]]] = {}
    for i in sorted(range(record.num_tokens), key=lambda i: (rows[i], positions[i])):
        parts, offsets, length = out.setdefault(rows[i], ([], {}, [0]))
        pending = segments.get(rows[i], [])
        while pending and pending[0][0] < positions[i]:  # a tool turn the policy read before this token
            text = pending.pop(0)[1]
            parts.append(text)
            length[0] += len(text)
        offsets[i] = length[0]
        parts.append(record.token_text[i])
        length[0] += len(record.token_text[i])
    return {row: ("".join(parts), offsets) for row, (parts, offsets, _) in out.items()}


def silenced_token_table(records: Sequence[TokenRecord],
                         context_chars: int = 300) -> list[SilencedToken]:
    """One row per silenced token of every record, in (record, row, position) order."""
    table = []
    for rec in records:
        idx = rec.silenced.nonzero(as_tuple=True)[0].tolist()
        if not idx:
            continue
        texts = _row_texts(rec)
        rewards = {r.row: r.reward for r in rec.rows}
        rows, positions = rec.row.tolist(), rec.position.tolist()
        sel = torch.tensor(idx)
        probs = rec.logprob[sel].exp().tolist()
        entropy, adv = rec.entropy[sel].tolist(), rec.advantage[sel].tolist()
        top_p = rec.topk_probs[sel].tolist()
        for j in sorted(range(len(idx)), key=lambda j: (rows[idx[j]], positions[idx[j]])):
            i = idx[j]
            text, offsets = texts[rows[i]]
            start = offsets[i]
            context = text[max(0, start - context_chars):start]
            if start > context_chars:
                context = "…" + context
            table.append(SilencedToken(
                step=rec.step, minibatch=rec.minibatch, row=rows[i], position=positions[i],
                token=rec.token_text[i], context=context, prob=probs[j], entropy=entropy[j],
                advantage=adv[j], reward=rewards[rows[i]],
                top=tuple(zip(rec.topk_text[i], top_p[j]))))
    return table


def _pct(p: float) -> str:
    return f"{100 * p:.4f}%" if p < 0.01 else f"{100 * p:.2f}%"


def _md(text: str) -> str:
    for ch in _MD_SPECIAL:
        text = text.replace(ch, "\\" + ch)
    return text.replace("\r", "").replace("\n", "⏎")


def _md_token(token: str) -> str:
    """Bold the token; whitespace stays outside ``**`` so Markdown still renders it bold."""
    core = token.strip()
    if not core:
        return f"**{display_token(token)}**"
    lead = token[:len(token) - len(token.lstrip())]
    trail = token[len(token.rstrip()):]
    return f"{_md(lead)}**{_md(core)}**{_md(trail)}"


def _step_label(r: SilencedToken) -> str:
    """``step`` for the first mini-batch, ``step/mbK`` for mini-batch K (``inspect.record_minibatches=all``):
    rows are numbered within their mini-batch."""
    return f"{r.step}/mb{r.minibatch}" if r.minibatch else str(r.step)


def _truncation_note(total: int, shown: int) -> str:
    return f"showing {shown} of {total} silenced tokens" if shown < total else ""


def silenced_table_markdown(rows: Sequence[SilencedToken], max_rows: int | None = None) -> str:
    """A GitHub-Markdown table; context and token escaped so math/markup shows verbatim."""
    shown = list(rows[:max_rows] if max_rows is not None else rows)
    lines = ["| step | row:pos | context + **token** | P | H | A | top alternatives |",
             "|---:|---:|---|---:|---:|---:|---|"]
    for r in shown:
        top = ", ".join(f"{_md(display_token(t))} ({_pct(p)})" for t, p in r.top)
        lines.append(f"| {_step_label(r)} | {r.row}:{r.position} | {_md(r.context)}{_md_token(r.token)} "
                     f"| {_pct(r.prob)} | {r.entropy:.3f} | {r.advantage:.2f} | {top} |")
    note = _truncation_note(len(rows), len(shown))
    if not rows:
        lines.append("| – | – | no silenced tokens | | | | |")
    return "\n".join(lines) + (f"\n\n_{note}_\n" if note else "\n")


def silenced_table_html(rows: Sequence[SilencedToken], max_rows: int | None = None) -> str:
    """An HTML ``<table>`` fragment (embed in a page); the token is a ``<mark>``."""
    esc = html.escape
    shown = list(rows[:max_rows] if max_rows is not None else rows)
    out = ['<table class="silenced">',
           "<tr><th>step</th><th>row:pos</th><th>context + token</th><th>P</th><th>H</th>"
           "<th>A</th><th>top alternatives</th></tr>"]
    for r in shown:
        top = "<br>".join(f"<code>{esc(display_token(t))}</code> {_pct(p)}" for t, p in r.top)
        out.append(f"<tr><td>{_step_label(r)}</td><td>{r.row}:{r.position}</td>"
                   f'<td class="ctx">{esc(r.context)}<mark>{esc(r.token)}</mark></td>'
                   f"<td>{_pct(r.prob)}</td><td>{r.entropy:.3f}</td><td>{r.advantage:.2f}</td>"
                   f"<td>{top}</td></tr>")
    if not rows:
        out.append('<tr><td colspan="7">no silenced tokens</td></tr>')
    out.append("</table>")
    note = _truncation_note(len(rows), len(shown))
    return "\n".join(out) + (f"\n<p><em>{note}</em></p>" if note else "")

