"""inspect_run end to end on a synthetic run dir, and each figure on its own."""

import json
import re
from collections import Counter

import pytest

from stapo.inspect import (grad_norm_by_class, inspect_run, plot_grad_norm_by_class,
                           plot_prob_entropy_plane, plot_silenced_ratio, plot_token_frequencies,
                           write_token_record)
from stapo.run_dir import token_record_path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_dir(tmp_path, make_record, with_metrics=True):
    run = tmp_path / "run"
    write_token_record(token_record_path(run, 10), make_record(10, tau_h=0.5))
    write_token_record(token_record_path(run, 20), make_record(20, tau_h=0.55))
    if with_metrics:
        rows = [{"step": s, "reward_mean": s / 20, "entropy_mean": 0.5,
                 "silenced_frac": 1e-4 * s, "spurious_frac": 1e-4} for s in range(1, 21)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_inspect_run_writes_everything(tmp_path, make_record):
    run = _run_dir(tmp_path, make_record)
    out = inspect_run(run)
    assert out == run / "inspect"
    for name in ("prob_entropy.png", "grad_norm_by_class.png", "silenced_ratio.png",
                 "token_frequencies.png", "training_curves.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    index = (out / "index.md").read_text()
    for link in re.findall(r"\]\(([^)]+)\)", index):  # every link resolves
        assert (out / link).exists(), link
    assert "silenced by the mask: 4 (25.0000%)" in index  # 2 of 8 tokens in each of 2 records
    assert "**low H, low p, A>0** (spurious) | 4 |" in index
    report = (out / "report.html").read_text()
    assert report.count("<mark>") == 4 and 'src="prob_entropy.png"' in report
    table = (out / "silenced_tokens.md").read_text()
    assert table.count("**answer**") == 2 and table.count("**.**") == 2


def test_inspect_run_without_metrics_and_custom_out(tmp_path, make_record):
    run = _run_dir(tmp_path, make_record, with_metrics=False)
    out = inspect_run(run, tmp_path / "elsewhere")
    assert not (out / "training_curves.png").exists()
    assert "training_curves.png" not in (out / "index.md").read_text()
    assert not (run / "inspect").exists()


def test_inspect_run_without_records_is_a_clear_error(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match="inspect.record_every=N"):
        inspect_run(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        inspect_run(tmp_path / "missing")


def test_figures_individually(tmp_path, make_record):
    recs = [make_record(10), make_record(20, silenced=[False] * 8)]
    assert plot_prob_entropy_plane(recs, tmp_path / "a.png", max_points=3).exists()
    assert plot_grad_norm_by_class(grad_norm_by_class(recs), tmp_path / "b.png").exists()
    assert plot_token_frequencies(Counter(), Counter({"x": 1}), tmp_path / "c.png").exists()
    assert plot_silenced_ratio([], tmp_path / "d.png").exists()
    with pytest.raises(ValueError, match="at least one"):
        plot_prob_entropy_plane([], tmp_path / "e.png")


def test_inspect_run_on_an_empty_record(tmp_path, make_record):
    # a mini-batch whose responses are all empty: no tokens, but the report still renders
    data = make_record().to_dict()
    keep = []
    for k, v in data.items():
        if hasattr(v, "shape"):
            data[k] = v[keep]
    data.update(token_text=[], topk_text=[], thresholds={})
    rec = type(make_record())(**data)
    write_token_record(token_record_path(tmp_path, 1), rec)
    out = inspect_run(tmp_path)
    assert "valid tokens: 0; silenced by the mask: 0" in (out / "index.md").read_text()
