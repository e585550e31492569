"""The tiny tool-integrated-reasoning demo (``tiny.task: tir``; docs/tir.md, "The tiny demo"): products the
tiny model cannot work out in its head, a calculator it can call, and the warm start's examples.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from stapo.tiny.cache import build_cached
from stapo.tiny.task import CHAT_INSTRUCTION, ArithmeticProblem, make_problem
from stapo.tiny.tokenizer import EOS_TOKEN, IM_START, _train_tokenizer, _write_tokenizer
from stapo.tiny.warmstart import SFTExample, answer_example, prompt_text, train_sft
from stapo.tools import Calculator

__all__ = ["TIR_CHAT_TEMPLATE", "TOOL_TAGS", "build_tir_tokenizer", "encode_tir_examples", "tir_problems",
           "tir_tool_schemas", "tir_warm_start", "tool_call_text"]

TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TIR_VOCAB_SIZE = 512
TIR_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for tool in tools %}{{ ' ' + tool['function']['name'] }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: Seed of the warm-start choices (which examples offer tools, which call them), apart from the model seed.
TIR_CHOICE_SEED = 11


def tir_problems(n: int, seed: int, *, easy_fraction: float = 0.25) -> list[ArithmeticProblem]:
    """``n`` problems, deterministic for ``seed``: about ``easy_fraction`` one-digit sums, the rest
    products of a 3-digit and a 2-digit number. ``solution`` is the answer worked in the head,
    ``347*58=20126. \\boxed{20126}`` (the expression copied, its value, the value copied again)."""
    if n < 0 or not 0.0 <= easy_fraction <= 1.0:
        raise ValueError(f"need n >= 0 and easy_fraction in [0, 1], got {n}, {easy_fraction}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < easy_fraction:
            a, b, op = rng.randint(0, 9), rng.randint(0, 9), "+"
        else:
            a, b, op = rng.randint(100, 999), rng.randint(10, 99), "*"
        out.append(make_problem([a, b], [op]))
    return out


def expression_of(problem: ArithmeticProblem) -> str:
    """``"Compute 347*58."`` -> ``"347*58"``."""
    return problem.question.removeprefix("Compute ").removesuffix(".")


def tool_call_text(expression: str) -> str:
    """The calculator call in Qwen3's format, as its chat template renders an assistant's tool call."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"{TOOL_TAGS[0]}\n{body}\n{TOOL_TAGS[1]}"


def tir_tool_schemas() -> list[dict]:
    """The tools the demo's prompts offer (the calculator's schema)."""
    return [Calculator().schema()]


def _corpus() -> list[str]:
    """Tokenizer training text: prompts with and without the tool line, calls, tool turns, answers."""
    texts = []
    for i, p in enumerate(tir_problems(2000, seed=3000)):
        user = f"{IM_START}user\n{p.question} {CHAT_INSTRUCTION}{EOS_TOKEN}\n{IM_START}assistant\n"
        tools = f"{IM_START}system\nTools: calculator{EOS_TOKEN}\n" if i % 2 else ""
        turn = (f"{tool_call_text(expression_of(p))}{EOS_TOKEN}\n{IM_START}user\n{TOOL_TAGS[2]}\n{p.answer}\n"
                f"{TOOL_TAGS[3]}{EOS_TOKEN}\n{IM_START}assistant\n") if i % 4 == 1 else ""
        texts.append(tools + user + turn + (boxed(p.answer) if turn else p.solution) + EOS_TOKEN)
    return texts


def boxed(answer: str) -> str:
    return f"\\boxed{{{answer}}}"


def build_tir_tokenizer(out_dir: Path | None = None) -> Path:
    """The TIR variant of the tiny tokenizer (cached apart from the default one, keyed by its training
    text); see the module docstring."""
    corpus = _corpus()

    def write(tmp: Path) -> None:
        _write_tokenizer(tmp, _train_tokenizer(corpus, TIR_VOCAB_SIZE, TOOL_TAGS), TIR_CHAT_TEMPLATE)

    payload = {"vocab_size": TIR_VOCAB_SIZE, "variant": "tir", "text": [*corpus, TIR_CHAT_TEMPLATE, *TOOL_TAGS]}
    return build_cached(out_dir, "tokenizer", payload, write)


def _tool_episode(tokenizer, problem: ArithmeticProblem, prompt_text: str) -> SFTExample:
    """Call, tool turn (context), the result copied into ``\\boxed{}``: the segments split where the chat
    template renders them."""
    call, answer = tool_call_text(expression_of(problem)), boxed(problem.answer)
    messages = [{"role": "user", "content": f"{problem.question} {CHAT_INSTRUCTION}"},
                {"role": "assistant", "content": call}, {"role": "tool", "content": problem.answer},
                {"role": "assistant", "content": answer}]
    full = tokenizer.apply_chat_template(messages, tools=tir_tool_schemas(), tokenize=False)
    if not full.startswith(prompt_text + call):
        raise ValueError("the TIR chat template does not render the prompt as a prefix of the episode")
    context = full[len(prompt_text) + len(call): full.rindex(answer)]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    segments = [(encode(call), False), (encode(context), True), (encode(answer) + [tokenizer.eos_token_id], False)]
    return SFTExample(tokenizer(prompt_text, add_special_tokens=False)["input_ids"],
                      [t for ids, _ in segments for t in ids],
                      tuple(flag for ids, flag in segments for _ in ids))


def encode_tir_examples(tokenizer, problems, tool_fraction: float) -> list[SFTExample]:
    """Warm-start examples (see the module docstring): every other problem offers the calculator, and
    about ``tool_fraction`` of those call it."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    rng = random.Random(TIR_CHOICE_SEED)
    out = []
    for i, p in enumerate(problems):
        offered = i % 2 == 1
        text = prompt_text(tokenizer, p.question, tir_tool_schemas() if offered else None)
        if offered and rng.random() < tool_fraction:
            out.append(_tool_episode(tokenizer, p, text))
        else:
            out.append(answer_example(tokenizer, text, p.solution))
    return out


def tir_warm_start(model_dir: Path, problems, *, tool_fraction: float, steps: int, lr: float, seed: int,
                   batch_size: int = 32, progress: bool = True) -> Path:
    """The TIR demo's supervised warm start (cached like `stapo.tiny.warm_start`)."""
    problems = list(problems)
    data = [[p.question, p.answer] for p in problems] + [tool_fraction, "tir", TIR_CHOICE_SEED]
    return train_sft(Path(model_dir), lambda tokenizer: encode_tir_examples(tokenizer, problems, tool_fraction),
                     data, steps=steps, lr=lr, batch_size=batch_size, seed=seed, weight_decay=0.0, progress=progress)
