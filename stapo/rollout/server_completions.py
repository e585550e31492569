"""The ``/v1/completions`` wire format of server mode: one prompt's request body, and a reply checked and read
as the ``RequestOutput`` shape `rollout_from_vllm_outputs` takes (`ServerEngine`, partial rollouts' tests).

A reply that is not a complete answer to its request (no choices, a choice without token ids, fewer log-probs
than tokens, an unknown finish reason, missing indices) is a server fault (`MALFORMED`, naming the server),
not a short response: the engine retries it and then fails the server over.
"""

from __future__ import annotations

from types import SimpleNamespace

from stapo.rollout.server_client import MALFORMED, ServerError

__all__ = ["completion_request", "failed_outputs", "outputs_from_completion"]


def completion_request(prompt: list[int], base: dict, seed: int | None) -> dict:
    """The ``/v1/completions`` body of one prompt (``base``: `vllm_sampling_kwargs`' settings)."""
    body = {"prompt": prompt, **base, "return_token_ids": True}
    if seed is not None:
        body["seed"] = seed
    return body


def outputs_from_completion(reply: dict, n: int | None = None, address: str = "?") -> SimpleNamespace:
    """A ``/v1/completions`` reply as the ``RequestOutput`` shape `rollout_from_vllm_outputs` reads;
    ServerError (`MALFORMED`, naming ``address``) when it is not a complete reply of ``n`` choices."""
    def malformed(why: str) -> ServerError:
        return ServerError(address, f"malformed completion reply: {why}", kind=MALFORMED)

    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or (n is not None and len(choices) != n):
        raise malformed(f"{len(choices) if isinstance(choices, list) else 'no'} choices, expected {n}")
    outputs = []
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("token_ids"), list):
            raise malformed("a choice without token_ids")
        ids = choice["token_ids"]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(ids) or choice.get("finish_reason") not in ("stop", "length"):
            raise malformed(f"choice {choice.get('index')}: {len(ids)} tokens, {len(logprobs)} log-probs, "
                            f"finish_reason {choice.get('finish_reason')!r}")
        outputs.append(SimpleNamespace(index=choice.get("index", 0), token_ids=ids, text=choice.get("text", ""),
                                       finish_reason=choice["finish_reason"],
                                       logprobs=[{tok: lp} for tok, lp in zip(ids, logprobs)]))
    if n is not None and sorted(o.index for o in outputs) != list(range(n)):
        raise malformed(f"choice indices {sorted(o.index for o in outputs)}, expected 0..{n - 1}")
    return SimpleNamespace(outputs=outputs)


def failed_outputs(n: int) -> SimpleNamespace:
    """``n`` empty completions of a request that failed (``finish_reason`` ``"error"``)."""
    return SimpleNamespace(outputs=[SimpleNamespace(index=i, token_ids=[], text="", finish_reason="error",
                                                    logprobs=[]) for i in range(n)])
