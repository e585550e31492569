"""Silenced-token table: exactly the silenced tokens, correct left context, safe rendering."""

import random

import pytest
import torch

from stapo.inspect.records import TokenRecord
from stapo.inspect.tables import (silenced_table_html, silenced_table_markdown,
                                  silenced_token_table)


def test_rows_and_context_by_hand(record):
    rows = silenced_token_table([record])
    assert [(r.row, r.position, r.token) for r in rows] == [(0, 1, " answer"), (0, 4, ".")]
    first, second = rows
    assert first.context == "The" and second.context == "The answer is 4"
    assert second.prob == pytest.approx(0.002) and second.entropy == pytest.approx(0.1)
    assert second.advantage == 1.0 and second.reward == 1.0 and second.step == 10
    assert second.top[0] == ("answer", pytest.approx(0.5)) and len(second.top) == 5
    # context cut to the last 5 characters: " is 4" with an ellipsis
    assert silenced_token_table([record], context_chars=5)[1].context == "… is 4"


def test_an_episodes_tool_turns_are_in_the_context(record, tmp_path):
    # row 0 as an episode whose tool turn (positions 2-3, not in the record: context tokens are not
    # trained) came after " answer": the policy's tokens are then at positions 0, 1, 4, 5, 6
    from stapo.inspect.records import read_token_record, write_token_record

    data = record.to_dict()
    data["position"] = torch.tensor([0, 1, 4, 5, 6, 0, 1, 2])
    data["rows"][0]["context"] = [[2, "<tool_response>\n4\n</tool_response>"]]
    episode = TokenRecord(**data)
    rows = silenced_token_table([episode])
    assert rows[1].context == "The answer<tool_response>\n4\n</tool_response> is 4"
    assert rows[0].context == "The"  # the tool turn came after " answer"
    write_token_record(tmp_path / "r.pt", episode)  # the segments survive the file format
    assert read_token_record(tmp_path / "r.pt").rows[0].context == [[2, "<tool_response>\n4\n</tool_response>"]]


def test_context_uses_position_order_not_storage_order(record):
    data = record.to_dict()
    perm = [4, 3, 2, 1, 0, 7, 6, 5]  # reverse each row's tokens in storage
    for k, v in data.items():
        if isinstance(v, torch.Tensor):
            data[k] = v[perm]
    for k in ("token_text", "topk_text"):
        data[k] = [data[k][i] for i in perm]
    rows = silenced_token_table([TokenRecord(**data)])
    assert [r.context for r in rows] == ["The", "The answer is 4"]


def _random_record(seed: int) -> TokenRecord:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 12) for _ in range(rng.randint(1, 5))]
    row = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)])
    pos = torch.tensor([t for n in lengths for t in range(n)])
    n = int(row.numel())
    silenced = torch.tensor([rng.random() < 0.3 for _ in range(n)])
    return TokenRecord(
        step=seed, minibatch=0, mask_name="prob_only", thresholds={"tau_p": 0.5, "tau_h": 1.0},
        rows=[{"row": b, "prompt_text": "", "response_text": "", "reward": 1.0, "advantage": 1.0}
              for b in range(len(lengths))],
        row=row, position=pos, token_id=torch.zeros(n, dtype=torch.long),
        token_text=[rng.choice(["a", " |b|", "$x$", "\n", "<i>"]) for _ in range(n)],
        logprob=torch.full((n,), -1.0), entropy=torch.ones(n), advantage=torch.ones(n),
        kept=~silenced, silenced=silenced, topk_ids=torch.zeros(n, 5, dtype=torch.long),
        topk_probs=torch.zeros(n, 5), topk_text=[["t"] * 5 for _ in range(n)],
        collision=torch.ones(n))


@pytest.mark.parametrize("seed", range(20))
def test_rows_are_exactly_the_silenced_tokens(seed):
    recs = [_random_record(seed), _random_record(seed + 100)]
    got = [(r.step, r.row, r.position) for r in silenced_token_table(recs)]
    want = [(rec.step, int(rec.row[i]), int(rec.position[i]))
            for rec in recs for i in rec.silenced.nonzero().flatten().tolist()]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))
    md = silenced_table_markdown(silenced_token_table(recs))
    assert len(md.strip().splitlines()) == 2 + max(len(want), 1)  # header + one line per token


def test_markdown_escapes_and_highlights(make_record):
    rec = make_record()
    rec.token_text[1] = " a|b$"  # the silenced token
    rows = silenced_token_table([rec])
    md = silenced_table_markdown(rows)
    line = md.splitlines()[2]
    assert "The **a\\|b\\$**" in line  # leading space kept outside the bold markers
    assert line.count(" | ") == 6  # the token's "|" did not add a column
    assert "answer (50.00%)" in line and "\\$ (10.00%)" in line and "0.1000%" in line
    assert "showing 1 of 2" in silenced_table_markdown(rows, max_rows=1)


def test_html_escapes_and_marks(make_record):
    rec = make_record()
    rec.token_text[0] = "<script>"
    html = silenced_table_html(silenced_token_table([rec]))
    assert "<script>" not in html and "&lt;script&gt;<mark> answer</mark>" in html
    assert html.count("<tr>") == 3


def test_empty_table(make_record):
    rows = silenced_token_table([make_record(silenced=[False] * 8)])
    assert rows == []
    assert "no silenced tokens" in silenced_table_markdown(rows)
    assert "no silenced tokens" in silenced_table_html(rows)


def test_later_minibatches_are_labelled_by_step_and_minibatch(record):
    # rows are numbered within a mini-batch, so inspect.record_minibatches=all needs the label
    later = TokenRecord(**{**record.to_dict(), "minibatch": 2})
    md = silenced_table_markdown(silenced_token_table([record, later]))
    html = silenced_table_html(silenced_token_table([record, later]))
    steps = [line.split("|")[1].strip() for line in md.splitlines()[2:]]
    assert steps == ["10", "10", "10/mb2", "10/mb2"]
    assert html.count("<td>10/mb2</td>") == 2 and html.count("<td>10</td>") == 2
