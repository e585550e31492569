"""``rollout.mode: server`` as components: the `ServerEngine` (secret, limits, the fingerprint the servers are
checked against) and the longest prompt the servers allow (docs/rollout.md, "Rollout servers").
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from stapo.config import STAPOConfig
from stapo.rollout.engine import RolloutEngine, pad_token_id
from stapo.serve.fingerprint import model_fingerprint, tokenizer_fingerprint
from stapo.serve.secret import trainer_secret
from stapo.servers.engine import ServerEngine, ServerLimits

__all__ = ["build_server_engine", "prompt_length_limit"]

log = logging.getLogger("stapo.trainer")


def build_server_engine(cfg: STAPOConfig, model_path: str, tokenizer, dtype: torch.dtype, dist_rank: int = 0):
    """The listed servers, checked against this model (held in ``dtype``) and tokenizer (docs/rollout.md)."""
    from transformers import AutoConfig, AutoTokenizer

    s = cfg.rollout.server
    trust = cfg.model.trust_remote_code
    fingerprint = {"model": model_fingerprint(AutoConfig.from_pretrained(model_path, trust_remote_code=trust),
                                              dtype),
                   "tokenizer": tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust))}
    limits = ServerLimits(**{f.name: getattr(s, f.name) for f in dataclasses.fields(ServerLimits)})
    log.info("rollout engine: vLLM servers %s", ", ".join(s.addresses))
    return ServerEngine(s.addresses, pad_token_id(tokenizer), sends_weights=dist_rank == 0, limits=limits,
                        token=trainer_secret(os.environ, s.token_file), sync_host=s.sync_host,
                        fingerprint=fingerprint, sync=s.sync, stream=cfg.rollout.partial, tokenizer=tokenizer)


def prompt_length_limit(cfg: STAPOConfig, rollout_engine: RolloutEngine) -> int:
    """``data.max_prompt_length``, or less (with a warning) when a server's ``max_model_len`` leaves less room."""
    limit = cfg.data.max_prompt_length
    served = rollout_engine.max_model_len
    if served is None or served >= limit + cfg.rollout.max_response_length:
        return limit
    room = served - cfg.rollout.max_response_length
    if room < 1:
        raise ValueError(f"a rollout server's max_model_len ({served}) leaves no room for a prompt beside "
                         f"rollout.max_response_length ({cfg.rollout.max_response_length}): start the servers with a "
                         "larger --max-model-len or lower rollout.max_response_length")
    log.warning("a rollout server's max_model_len is %d: prompts longer than %d tokens (max_model_len - "
                "rollout.max_response_length) are filtered, not data.max_prompt_length=%d", served, room, limit)
    return room
