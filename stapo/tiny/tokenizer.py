"""A small byte-level BPE tokenizer for the synthetic arithmetic task, trained offline on task text.

Digits are split before BPE (as in Qwen's tokenizer); the chat template is Qwen's with ``<|im_end|>`` as EOS.
"""

from __future__ import annotations

from pathlib import Path

from stapo.tiny.cache import build_cached
from stapo.tiny.task import CHAT_INSTRUCTION, arithmetic_problems

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Target vocabulary size (256 byte symbols + specials + merges learned on the task text).
VOCAB_SIZE = 384


def _training_corpus() -> list[str]:
    """Deterministic task text covering every difficulty the demo may use."""
    texts = []
    for i, (digits, terms, ops) in enumerate(
        [(1, 2, "+-"), (2, 2, "+-"), (2, 3, "+-"), (3, 3, "+-*"), (2, 4, "+-*"), (3, 2, "*")]
    ):
        for p in arithmetic_problems(300, seed=1000 + i, digits=digits, terms=terms, ops=tuple(ops)):
            prompt = f"{IM_START}user\n{p.question} {CHAT_INSTRUCTION}{EOS_TOKEN}\n{IM_START}assistant\n"
            texts.append(prompt + p.solution + EOS_TOKEN)
    texts.append(f"{IM_START}system\nYou are a helpful assistant.{EOS_TOKEN}\n")
    return texts


def _train_tokenizer(corpus: list[str] | None = None, vocab_size: int = VOCAB_SIZE, added: tuple[str, ...] = ()):
    """BPE over ``corpus`` (default: the arithmetic task's); ``added``: extra whole tokens that are not
    special (a variant's tags, e.g. the TIR demo's ``<tool_call>``: they stay in decoded text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus() if corpus is None else corpus, trainer=trainer)
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def _write_tokenizer(out_dir: Path, tokenizer=None, chat_template: str = CHAT_TEMPLATE) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer() if tokenizer is None else tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = chat_template
    hf_tok.save_pretrained(str(out_dir))


def build_tiny_tokenizer(out_dir: Path | None = None) -> Path:
    """Train (or reuse from the cache, ``stapo.tiny.cache``) the tiny tokenizer as an HF tokenizer dir."""
    return build_cached(out_dir, "tokenizer", {"vocab_size": VOCAB_SIZE}, _write_tokenizer)
