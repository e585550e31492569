"""The context an episode reads after a turn with tool calls (docs/tir.md, "How an episode runs", step 4).

A chat template (``qwen3``) renders the results as ``tool`` messages, so its own rules decide the text, not a
copy of them here; an inline format (a parser with ``render_results``: ``python_block``) writes them into the turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from stapo.tools import ToolCallParser

__all__ = ["ToolTurnRenderer"]

_MARK = "\x00stapo-turn-end\x00"


class ToolTurnRenderer:
    """Tool results -> the context tokens that follow a policy turn. ``template_kwargs``: the prompts' chat-template
    arguments (e.g. ``enable_thinking``), so the next assistant turn opens as the first one did."""

    def __init__(self, tokenizer, parser: ToolCallParser, template_kwargs: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.inline = parser.render_results
        self.template_kwargs = dict(template_kwargs or {})
        if self.inline is None:
            self.text(["probe"])  # a template that cannot render tool messages fails here, once

    def text(self, results: Sequence[str], after_eos: str = "") -> str:
        """The context text for one turn's results (in call order). ``after_eos``: the text of the EOS
        token that ended the turn, if any; the template's own copy of it is then left out."""
        if self.inline is not None:
            return self.inline(list(results))
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        messages += [{"role": "tool", "content": r} for r in results]
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                          **self.template_kwargs)
        except Exception as exc:  # jinja's TemplateError and the template's own raise_exception
            raise ValueError(f"the tokenizer's chat template cannot render tool results ({exc}); use a model "
                             "whose template has a `tool` role (Qwen3) or rollout.tools.parser=python_block") from None
        if rendered.count(_MARK) != 1:
            raise ValueError("the tokenizer's chat template does not render the assistant's content verbatim; "
                             "its tool turns cannot be appended to a generated turn")
        text = rendered.split(_MARK)[1]
        return text[len(after_eos):] if after_eos and text.startswith(after_eos) else text
