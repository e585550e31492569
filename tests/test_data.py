"""Prompt datasets (local jsonl / parquet, DAPO-Math-17K preset, errors, length filter) and the
resumable PromptSampler."""

from __future__ import annotations

import json
import logging

import pytest

from stapo.data import (
    balanced_shares,
    PAPER_INSTRUCTION,
    PromptSampler,
    load_prompt_dataset,
    prompt_dataset_from_records,
    strip_dapo_instruction,
)

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_row(problem: str, answer: str, index: str) -> dict:
    """A row exactly in DAPO-Math-17K's format."""
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_PREFIX + problem + DAPO_SUFFIX}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from stapo.tiny import build_tiny_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path_factory.mktemp("data_tok"))))


@pytest.fixture
def load(tok, tmp_path):
    """load_prompt_dataset with the tiny tokenizer and a temp `datasets` cache."""
    def _load(source, **kw):
        return load_prompt_dataset(source, tokenizer=tok, cache_dir=tmp_path / "hf_cache", **kw)
    return _load


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def rendered(tok, content: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def test_jsonl_round_trip(load, tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Compute 1+2.", "answer": 3},
                                              {"prompt": "Compute 2*5.", "answer": "10"}])
    ds = load(path)
    assert len(ds) == 2 and ds.num_filtered == 0
    ex = ds[0]
    assert ex.index == 0 and ex.problem == "Compute 1+2." and ex.ground_truth == "3"
    assert ex.prompt_text == rendered(tok, f"Compute 1+2. {PAPER_INSTRUCTION}")
    assert ex.prompt_ids == tok(ex.prompt_text, add_special_tokens=False)["input_ids"]
    ids, answers = ds.batch([1, 0])
    assert answers == ["10", "3"] and ids[1] == ex.prompt_ids


def test_parquet_round_trip_with_chat_prompt_and_dotted_answer(load, tok, tmp_path):
    import datasets

    rows = [{"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 4-1."}],
             "meta": {"gold": "3"}}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    ex = load(tmp_path / "d.parquet", prompt_field="question", answer_field="meta.gold", instruction=None)[0]
    assert ex.problem == "Compute 4-1." and ex.ground_truth == "3"
    want = tok.apply_chat_template(rows[0]["question"], tokenize=False, add_generation_prompt=True)
    assert ex.prompt_text == want


def test_dapo_preset_on_real_format_rows(load, tok, tmp_path):
    rows = [dapo_row("Find $x$ if $2x = 68$.", "34", "a-1"),
            dapo_row("How many primes are below $10$?\nGive an integer.", "4", "b-2")]
    ds = load(write_jsonl(tmp_path / "dapo.jsonl", rows), preset="dapo_math_17k")
    assert [e.problem for e in ds] == ["Find $x$ if $2x = 68$.", "How many primes are below $10$?\nGive an integer."]
    assert [e.ground_truth for e in ds] == ["34", "4"]
    assert ds[0].prompt_text == rendered(tok, f"Find $x$ if $2x = 68$. {PAPER_INSTRUCTION}")
    assert all("Answer:" not in e.prompt_text and "\\boxed{}" in e.prompt_text for e in ds)


def test_records_in_memory_follow_the_same_rules(load, tok, tmp_path):
    import datasets

    rows = [dapo_row("Find $x$ if $2x = 68$.", "34", "a-1")]
    from_list = prompt_dataset_from_records(rows, preset="dapo_math_17k", tokenizer=tok)
    from_hf = prompt_dataset_from_records(datasets.Dataset.from_list(rows), preset="dapo_math_17k", tokenizer=tok)
    from_file = load(write_jsonl(tmp_path / "dapo.jsonl", rows), preset="dapo_math_17k")
    assert from_list.examples == from_hf.examples == from_file.examples
    with pytest.raises(KeyError, match=r"row 1: missing column 'answer'; available: \['prompt', 'gold'\]"):
        prompt_dataset_from_records([{"prompt": "a", "answer": "1"}, {"prompt": "b", "gold": "2"}], tokenizer=tok)


def test_strip_dapo_instruction_leaves_other_text_alone():
    assert strip_dapo_instruction(DAPO_PREFIX + "What is 1+1?" + DAPO_SUFFIX) == "What is 1+1?"
    assert strip_dapo_instruction("  What is 1+1?  ") == "What is 1+1?"


def test_missing_column_error_lists_columns(load, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Compute 1+2.", "solution": "3"}])
    with pytest.raises(KeyError, match=r"row 0: missing column 'prompt'.*question.*solution"):
        load(path)
    with pytest.raises(KeyError, match=r"row 0: missing key 'gold' of 'solution.gold'"):
        load(path, prompt_field="question", answer_field="solution.gold")


def test_empty_answer_names_the_row(load, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Compute 1+2.", "answer": "3"},
                                              {"prompt": "Compute 2+2.", "answer": "  "}])
    with pytest.raises(ValueError, match="row 1: empty answer in field 'answer'"):
        load(path)


def test_bad_prompt_and_source_errors(load, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 5, "answer": "3"}])
    with pytest.raises(ValueError, match="row 0: field 'prompt' must be a string"):
        load(path)
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported data file"):
        load(tmp_path / "d.csv")
    with pytest.raises(ValueError, match="available: \\['dapo_math_17k'\\]"):
        load(path, preset="nope")


def test_long_prompts_are_filtered_and_counted(load, tok, tmp_path, caplog):
    long_prompt = "Compute " + "+".join(["1"] * 60) + "."
    rows = [{"prompt": "Compute 1+2.", "answer": "3"}, {"prompt": long_prompt, "answer": "60"},
            {"prompt": "Compute 2+2.", "answer": "4"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    limit = len(load(path)[0].prompt_ids) + 5  # short prompts fit, the 60-term one does not
    with caplog.at_level(logging.INFO, logger="stapo.data"):
        ds = load(path, max_prompt_length=limit)
    assert [e.index for e in ds] == [0, 2] and ds.num_filtered == 1
    assert f"filtered 1 of 3 prompts longer than {limit} tokens" in caplog.text
    with pytest.raises(ValueError, match="all 3 prompts"):
        load(path, max_prompt_length=3)


def take(sampler: PromptSampler, k: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(k)]


def test_sampler_is_deterministic_and_covers_each_epoch():
    a, b = PromptSampler(10, 3, seed=1), PromptSampler(10, 3, seed=1)
    batches = take(a, 9)  # 3 epochs of 3 batches (10 // 3; the 10th example is dropped each epoch)
    assert batches == take(b, 9)
    for epoch in range(3):
        flat = sum(batches[3 * epoch: 3 * epoch + 3], [])
        assert len(set(flat)) == 9 and set(flat) <= set(range(10))
        assert flat == a.epoch_order(epoch)[:9].tolist()
    assert batches[:3] != batches[3:6]  # reshuffled per epoch
    assert take(PromptSampler(10, 3, seed=2), 3) != batches[:3]


def test_sampler_without_drop_last_serves_the_remainder():
    s = PromptSampler(5, 2, seed=0, drop_last=False)
    first = take(s, 3)
    assert [len(x) for x in first] == [2, 2, 1] and sorted(sum(first, [])) == [0, 1, 2, 3, 4]
    assert len(s.next_batch()) == 2 and s.epoch == 1


def test_sampler_resume_continues_the_same_order():
    full = PromptSampler(7, 2, seed=5)
    reference = take(full, 8)
    first = PromptSampler(7, 2, seed=5)
    take(first, 5)  # interrupted mid-epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(7, 2, seed=5)
    resumed.load_state_dict(state)
    assert take(resumed, 3) == reference[5:]
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(7, 2, seed=6).load_state_dict(state)


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError, match="batch_size 8 > num_examples 4"):
        PromptSampler(4, 8, seed=0)
    with pytest.raises(ValueError, match=">= 1"):
        PromptSampler(0, 1, seed=0)


def test_rows_carry_their_other_columns_for_reward_functions(tok):
    import datasets

    rows = [{"prompt": "Compute 1+2.", "answer": "3", "level": 1, "source": "gsm8k"},
            {"prompt": "Compute 2*5.", "answer": "10", "level": 4, "source": "math"}]
    for records in (rows, datasets.Dataset.from_list(rows)):
        ds = prompt_dataset_from_records(records, tokenizer=tok)
        assert [e.fields for e in ds] == [{"level": 1, "source": "gsm8k"}, {"level": 4, "source": "math"}]
    # dotted answer field: its top-level column (reward_model) is the answer's, the rest are extra
    dapo = prompt_dataset_from_records([dapo_row("What is 2+2?", "4", "a1")], preset="dapo_math_17k", tokenizer=tok)
    assert dapo[0].fields == {"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": "a1"}}
    # what the trainer hands a reward function: one dict per response row (G rows per prompt)
    from stapo.rewards import CallableScorer

    by_level = CallableScorer(lambda response, answer, level: float(level))
    row_fields = [e.fields for e in ds for _ in range(2)]
    assert by_level.score(["r"] * 4, ["a"] * 4, row_fields) == [1.0, 1.0, 4.0, 4.0]


def test_balanced_shares_hand_built():
    # 9 -> rank 0, 8 -> rank 1, 2 -> rank 1 (load 8 < 9), 1 -> rank 0: 10 and 10 (contiguous: 17 and 3)
    assert balanced_shares([9, 8, 1, 2], 2) == [[0, 2], [1, 3]]
    # a full rank takes no more: 10, 9, 8 go 0, 1, 2; then 1, 1, 1 to the lightest with room: 2, 1, 0
    assert balanced_shares([10, 9, 8, 1, 1, 1], 3) == [[0, 5], [1, 4], [2, 3]]
    assert balanced_shares([3, 1, 2], 1) == [[0, 1, 2]]  # one rank: the batch as it is


def test_balanced_shares_cover_every_prompt_once_deterministically_and_balance():
    import random

    gen = random.Random(0)
    for world in (2, 4, 8):
        costs = [gen.randint(20, 2000) for _ in range(32 * world)]  # prompt tokens of a sampled batch
        shares = balanced_shares(costs, world)
        assert shares == balanced_shares(list(costs), world)  # every rank computes the same deal
        assert sorted(i for s in shares for i in s) == list(range(len(costs)))
        assert {len(s) for s in shares} == {32}
        assert all(s == sorted(s) for s in shares)
        loads = [sum(costs[i] for i in s) for s in shares]
        contiguous = [sum(costs[r * 32:(r + 1) * 32]) for r in range(world)]
        # LPT with equal counts: the spread is at most the largest cost, far below a contiguous slice's
        assert max(loads) - min(loads) <= max(costs)
        assert max(loads) - min(loads) < (max(contiguous) - min(contiguous)) / 4
    with pytest.raises(ValueError, match="5 prompts cannot be dealt evenly to 2 ranks"):
        balanced_shares([1] * 5, 2)
