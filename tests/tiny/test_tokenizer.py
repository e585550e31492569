import hashlib

from transformers import AutoTokenizer

from stapo.tiny import CHAT_INSTRUCTION, arithmetic_problems, build_tiny_tokenizer
from stapo.tiny.task import make_problem
from stapo.tiny.warmstart import encode_examples


def test_round_trips_task_text(tiny_tokenizer):
    texts = [p.solution for p in arithmetic_problems(100, seed=0, digits=3, ops=("+", "-", "*"))]
    texts += ["\\boxed{-48}", "\\frac{1}{2}", "x^2 + 3.25 = 10", CHAT_INSTRUCTION, "unseen wörds ✓"]
    for text in texts:
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tiny_tokenizer.decode(ids) == text


def test_digits_are_single_tokens(tiny_tokenizer):
    tokens = tiny_tokenizer.convert_ids_to_tokens(tiny_tokenizer("1234567890", add_special_tokens=False)["input_ids"])
    assert tokens == list("1234567890")


def test_small_vocab_and_special_tokens(tiny_tokenizer):
    assert 256 < len(tiny_tokenizer) <= 512
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.eos_token_id != tiny_tokenizer.pad_token_id
    # Special tokens are atomic.
    assert len(tiny_tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]) == 1


def test_chat_template(tiny_tokenizer):
    messages = [{"role": "user", "content": "Compute 1+2. " + CHAT_INSTRUCTION}]
    text = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\nCompute 1+2. " + CHAT_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n"
    )
    # The tokenized form (what the data loader uses) equals the warm start's prompt ids.
    out = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    (example,) = encode_examples(tiny_tokenizer, [make_problem([1, 2], ["+"])])
    assert list(ids) == example.prompt_ids


def test_prompt_then_response_tokenizes_like_the_rollout(tiny_tokenizer):
    """Prompt ids + solution ids decode to the same text as the whole string (no merge across)."""
    p = arithmetic_problems(1, seed=0)[0]
    prompt = encode_examples(tiny_tokenizer, [p])[0].prompt_ids
    response = tiny_tokenizer(p.solution, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(response) == p.solution
    assert tiny_tokenizer.decode(prompt + response).endswith("assistant\n" + p.solution)


def test_deterministic_build(tmp_path):
    a = build_tiny_tokenizer(tmp_path / "a")
    b = build_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert hashlib.sha256((a / name).read_bytes()).digest() == hashlib.sha256((b / name).read_bytes()).digest()
    assert len(AutoTokenizer.from_pretrained(str(a))) == len(AutoTokenizer.from_pretrained(str(b)))


def test_cache_reuse(_tiny_cache):
    first = build_tiny_tokenizer()
    assert first.parent == _tiny_cache / "tiny"
    mtime = (first / "tokenizer.json").stat().st_mtime_ns
    assert build_tiny_tokenizer() == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == mtime
