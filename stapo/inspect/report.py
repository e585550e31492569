"""``inspect_run``: every inspector artifact of a run into ``RUN_DIR/inspect/`` (the paper's figures and
tables; docs/inspector.md lists them), linked from ``index.md`` and ``report.html``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path

from stapo.inspect.analysis import (ClassStat, WeightClassStat, grad_norm_by_class, silenced_ratio_over_training,
                                    spurious_mask, token_frequencies, weight_classes)
from stapo.inspect.figures import (plot_grad_norm_by_class, plot_prob_entropy_plane,
                                   plot_silenced_ratio, plot_token_frequencies)
from stapo.inspect.records import TokenRecord, load_records
from stapo.inspect.tables import (silenced_table_html, silenced_table_markdown,
                                  silenced_token_table)
from stapo.run_dir import INSPECT_DIR, METRICS_FILE

_FIGURES = (("prob_entropy.png", "Probability–entropy plane (paper Fig. 2a)"),
            ("grad_norm_by_class.png", "Gradient norm by token class (paper Fig. 2b)"),
            ("silenced_ratio.png", "Silenced-token ratio over training (paper Fig. 6a)"),
            ("token_frequencies.png", "Most frequent silenced vs kept tokens (paper Fig. 6b/c)"),
            ("training_curves.png", "Training curves"))


def _num(x: float, fmt: str) -> str:
    return "–" if math.isnan(x) else format(x, fmt)


def grad_norm_table_markdown(stats: Sequence[ClassStat]) -> str:
    lines = ["| class (Table 1) | tokens | share | silenced | mean A²(1−2p+Σπ²) | mean ‖∇‖ | "
             "vs high-H high-p |", "|---|---:|---:|---:|---:|---:|---:|"]
    for s in stats:
        rel = "–" if math.isnan(s.rel_to_baseline) else f"{100 * s.rel_to_baseline:+.1f}%"
        name = f"**{s.name}** (spurious)" if s.index == 7 else s.name
        lines.append(f"| {name} | {s.count} | {_num(100 * s.frac, '.3f')}% | {s.silenced} | "
                     f"{_num(s.mean_grad_norm_sq, '.4g')} | {_num(s.mean_grad_norm, '.4g')} "
                     f"| {rel} |")
    return "\n".join(lines) + "\n"


def weight_table_markdown(stats: Sequence[WeightClassStat]) -> str:
    """The active mask's weighted tokens as classes next to S2T (docs/inspector.md)."""
    lines = ["| tokens | count | share | also S2T | mean weight | median p | mean H | A > 0 | mean ‖∇‖ |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in stats:
        lines.append(f"| {s.name} | {s.count} | {_num(100 * s.frac, '.4f')}% | {s.s2t_overlap} "
                     f"| {_num(s.mean_weight, '.3g')} | {_num(s.median_prob, '.3g')} | {_num(s.mean_entropy, '.3f')} "
                     f"| {_num(100 * s.positive_frac, '.0f')}{'' if math.isnan(s.positive_frac) else '%'} "
                     f"| {_num(s.mean_grad_norm, '.4g')} |")
    return "\n".join(lines) + "\n"


def _summary_lines(records: Sequence[TokenRecord]) -> list[str]:
    tokens = sum(r.num_tokens for r in records)
    counts = {what: sum(int(select(r).sum()) for r in records) for what, select in (
        ("silenced by the mask", lambda r: r.silenced), ("meeting STAPO's criterion", spurious_mask),
        ("rejected by the off-policy correction", lambda r: r.rejected))}
    steps = sorted({r.step for r in records})
    return [f"- records: {len(records)} (steps {steps[0]}–{steps[-1]}), mask: "
            f"{', '.join(sorted({r.mask_name for r in records}))}, τ_p = {records[0].thresholds['tau_p']:g}",
            f"- valid tokens: {tokens}; " + "; ".join(f"{what}: {n} ({100 * n / max(tokens, 1):.4f}%)"
                                                       for what, n in counts.items())]


def inspect_run(run_dir: str | Path, out_dir: str | Path | None = None, *,
                context_chars: int = 300, max_table_rows: int = 500, top_tokens: int = 20) -> Path:
    """Analyse a run's token records into the output dir (default ``RUN_DIR/inspect``) and return it;
    FileNotFoundError when the run has no records (train with ``inspect.record_every=N``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    records = load_records(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / INSPECT_DIR
    out.mkdir(parents=True, exist_ok=True)

    plot_prob_entropy_plane(records, out / "prob_entropy.png")
    stats = grad_norm_by_class(records)
    plot_grad_norm_by_class(stats, out / "grad_norm_by_class.png")
    grad_md = grad_norm_table_markdown(stats)
    (out / "grad_norm_by_class.md").write_text(grad_md, encoding="utf-8")
    weights_md = weight_table_markdown(weight_classes(records))
    (out / "weighted_tokens.md").write_text(weights_md, encoding="utf-8")
    plot_silenced_ratio(silenced_ratio_over_training(run_dir, records), out / "silenced_ratio.png")
    plot_token_frequencies(*token_frequencies(records), out / "token_frequencies.png",
                           top=top_tokens)
    figures = list(_FIGURES[:4])
    if (run_dir / METRICS_FILE).exists():
        from stapo.plots import plot_training_curves

        try:
            plot_training_curves(run_dir / METRICS_FILE, out / "training_curves.png")
            figures.append(_FIGURES[4])
        except ValueError:  # no plottable keys yet: the rest of the report still stands
            pass

    rows = silenced_token_table(records, context_chars=context_chars)
    table_md = silenced_table_markdown(rows, max_rows=max_table_rows)
    table_html = silenced_table_html(rows, max_rows=max_table_rows)
    (out / "silenced_tokens.md").write_text(f"# Silenced tokens\n\n{table_md}", encoding="utf-8")
    (out / "silenced_tokens.html").write_text(_page("Silenced tokens", table_html),
                                              encoding="utf-8")
    summary = _summary_lines(records)
    _write_index(out, run_dir, summary, figures, grad_md + "\n## Weighted tokens next to S2T\n\n" + weights_md)
    _write_html(out, run_dir, summary, figures, grad_md, table_html, weights_md)
    return out


def _write_index(out: Path, run_dir: Path, summary: list[str], figures, grad_md: str) -> None:
    md = [f"# Spurious-token inspection: {run_dir.name}", "", *summary, ""]
    for name, title in figures:
        md += [f"## {title}", "", f"![{title}]({name})", ""]
    md += ["## Gradient norm by class (table)", "", grad_md,
           "## Silenced tokens", "", "[Markdown](silenced_tokens.md) · "
           "[HTML](silenced_tokens.html) · [full report](report.html)", ""]
    (out / "index.md").write_text("\n".join(md), encoding="utf-8")


def _write_html(out: Path, run_dir: Path, summary: list[str], figures, grad_md: str, table_html: str,
                weights_md: str) -> None:
    esc = html.escape
    body = [f"<h1>Spurious-token inspection: {esc(run_dir.name)}</h1><ul>"]
    body += [f"<li>{esc(line[2:])}</li>" for line in summary] + ["</ul>"]
    for name, title in figures:
        body.append(f'<h2>{esc(title)}</h2><img src="{name}" alt="{esc(title)}">')
    body += ["<h2>Gradient norm by class</h2>", _html_table(grad_md),
             "<h2>Weighted tokens next to S2T</h2>", _html_table(weights_md),
             "<h2>Silenced tokens (paper App. C Tables 3–5)</h2>", table_html]
    (out / "report.html").write_text(_page("stapo inspect", "\n".join(body)), encoding="utf-8")


def _html_table(markdown: str) -> str:
    """One of this module's Markdown tables as HTML, so both reports show the same table."""
    rows = []
    for i, line in enumerate(markdown.strip().splitlines()):
        if i != 1:  # the Markdown separator row
            cell = "th" if i == 0 else "td"
            rows.append("<tr>" + "".join(f"<{cell}>{html.escape(c.strip().replace('**', ''))}</{cell}>"
                                         for c in line.strip("|").split("|")) + "</tr>")
    return "<table>" + "\n".join(rows) + "</table>"


def _page(title: str, body: str) -> str:
    return (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}'
            "</title><style>body{font-family:sans-serif;max-width:1200px;margin:auto}"
            "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
            "padding:3px 6px;vertical-align:top}td.ctx{white-space:pre-wrap;max-width:600px}"
            "mark{background:#ffd54f;font-weight:bold}img{max-width:100%}</style></head>"
            f"<body>\n{body}\n</body></html>\n")
