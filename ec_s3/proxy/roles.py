"""What a prefill/decode answer may carry to a client, and an answer that shows a
misconfigured fleet. Pure, no I/O.

Owns that screening: ``ec_transfer_params`` never reach a client, and an answer with no
completion tokens and non-empty ``ec_transfer_params`` (an encoder at a ``--pd-url``) is
an error. Does not own relaying or error answers (:mod:`.relay`), nor the consumer's
missing-blob report (:mod:`.skips`, which reads it first).
"""

from __future__ import annotations

import json
from typing import Any

from ec_s3.proxy.answer import PdAnswer
from ec_s3.proxy.media import TooDeeplyNested, dump_body

__all__ = ["screen_answer"]

_FIELD = b'"ec_transfer_params"'


def screen_answer(answer: PdAnswer) -> bool:
    """Null a non-streamed answer's ``ec_transfer_params`` in :attr:`PdAnswer.first`;
    True when the answer is an encoder's (no tokens, params). vLLM sends no params in
    a stream."""
    if answer.stream or answer.resp is None or answer.resp.status != 200 or _FIELD not in answer.first:
        return False
    try:
        payload: Any = json.loads(answer.first)
    except (ValueError, RecursionError):
        return False
    if not isinstance(payload, dict) or payload.get("ec_transfer_params") is None:
        return False
    params = payload["ec_transfer_params"]
    usage = payload.get("usage")
    producer = bool(params) and isinstance(usage, dict) and usage.get("completion_tokens") == 0
    payload["ec_transfer_params"] = None
    try:
        answer.first = dump_body(payload)
    except TooDeeplyNested:
        answer.first = b""
    return producer
