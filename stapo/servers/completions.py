"""The ``/v1/completions`` wire format of server mode: a segment's request body, and a reply read as a `Segment`.

A reply that is not a complete answer to its request is a server fault (`MALFORMED`), not a short response:
the pool retries it and then fails the server over (`ServerPool.run`).
"""

from __future__ import annotations

from stapo.rollout.engine import Segment, SegmentRequest
from stapo.servers.client import MALFORMED, ServerError

__all__ = ["completion_body", "read_chunk", "segment_from_reply"]


def completion_body(request: SegmentRequest, base: dict) -> dict:
    """The ``/v1/completions`` body of one segment (``base``: `vllm_request_kwargs`' settings): token-id
    prompt, one sample, its token limit and seed, the token ids of the answer."""
    body = {**base, "prompt": list(request.context), "max_tokens": request.max_new_tokens, "return_token_ids": True}
    if request.seed is not None:
        body["seed"] = request.seed
    return body


def _malformed(address: str, why: str) -> ServerError:
    return ServerError(address, f"malformed completion reply: {why}", kind=MALFORMED)


def read_chunk(choice, address: str) -> tuple[list[int], list[float], str, str | None]:
    """``(token ids, log-probs, text, finish reason or None)`` of one choice: a whole reply's or one streamed
    event's (whose finish reason is None until the last)."""
    if not isinstance(choice, dict) or not isinstance(choice.get("token_ids"), list):
        raise _malformed(address, "a choice without token_ids")
    ids = [int(t) for t in choice["token_ids"]]
    logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    finish = choice.get("finish_reason")
    if len(logprobs) != len(ids) or finish not in ("stop", "length", None):
        raise _malformed(address, f"choice {choice.get('index')}: {len(ids)} tokens, {len(logprobs)} log-probs, "
                                  f"finish_reason {finish!r}")
    return ids, logprobs, choice.get("text") or "", finish


def segment_from_reply(reply: dict, address: str = "?", version: int | None = None) -> Segment:
    """A whole ``/v1/completions`` reply of one sample as a `Segment`; `MALFORMED` (naming ``address``) when it
    is not one complete choice."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != 1:
        raise _malformed(address, f"{len(choices) if isinstance(choices, list) else 'no'} choices, expected 1")
    ids, logprobs, text, finish = read_chunk(choices[0], address)
    if finish is None:
        raise _malformed(address, "choice 0: no finish_reason")
    return Segment(ids, logprobs, text, finish, version)
