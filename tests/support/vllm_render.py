"""vLLM's own front end, in-process and without an engine, as the judge of every body a
fake prefill/decode server is sent: what vLLM refuses, the fake refuses the same way.

:func:`render_check` runs a chat body through what vLLM's API server does before its
engine sees a request: the ``ChatCompletionRequest`` pydantic model, then the
``OnlineRenderer`` of vLLM's GPU-less render server (``vllm/entrypoints/launchers/
render``): the chat parser with its multimodal item tracker (the "Mixing raw image and
embedding inputs" rule of ``_resolve_items``, ``*_embeds`` parsing, uuids, per-prompt
limits), the chat template, tokenisation and the multimodal processor (image decode, HF
processing, a metadata-only item's placeholders). It is configured for the tiny
Qwen2.5-VL of :mod:`ec_s3.sandbox.tiny_qwen` as an ``ec_consumer`` is: vLLM turns on
``enable_mm_embeds`` and ``allow_missing_mm_embeddings`` for consumers.

Two choices differ from a served consumer, so that a body's verdict does not depend on
the bodies before it: the front-end processor cache is off (``mm_processor_cache_gb=0``;
a uuid-only part is then judged as on a fresh server), and the per-prompt limits are
generous (``LIMITS``: the fakes stand for any deployment's limits); per-request
``mm_processor_kwargs`` are trusted (``--trust-request-mm-kwargs``, which a deployment
that sends them sets).

The model config and renderer are built once per process (about 15 s, most of it
importing vLLM), on a thread with its own event loop that every test's loop shares;
one small body then costs a few milliseconds.

Owns the judging. Does not own the fakes (``tests/proxy/test_proxy.py``) or serving vLLM.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

__all__ = ["LIMITS", "Verdict", "render_check", "render_check_async"]

# Items per prompt the judge accepts: the proxy's default max_items_per_request (a served
# tiny Qwen takes 2 images: QWEN_MODEL_ARGS).
LIMITS = {"image": 64, "video": 64}

Verdict = tuple[int, dict[str, Any] | None]  # (HTTP status vLLM answers, its error body or None)

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    from vllm.config import VllmConfig
    from vllm.config.ec_transfer import ECTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer

    from ec_s3.sandbox.tiny_qwen import build_tiny_qwen

    model = build_tiny_qwen(Path(tempfile.gettempdir()) / "ec-s3-render-judge" / "tiny-qwen")
    args = AsyncEngineArgs(model=str(model), max_model_len=4096, enforce_eager=True,
                           limit_mm_per_prompt=dict(LIMITS), mm_processor_cache_gb=0)
    model_config = args.create_model_config()
    model_config.quantization = None
    config = VllmConfig(model_config=model_config,
                        ec_transfer_config=ECTransferConfig(ec_connector="ECS3Connector", ec_role="ec_consumer"))
    mm = model_config.multimodal_config
    assert mm is not None and mm.enable_mm_embeds and mm.allow_missing_mm_embeddings, "not configured as a consumer"
    renderer = OnlineRenderer(model_config, renderer_from_config(config), request_logger=None,
                              chat_template=None, chat_template_content_format="auto",
                              trust_request_mm_kwargs=True)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="vllm-render-judge", daemon=True).start()
    return {"renderer": renderer, "loop": loop}


def _judge() -> dict[str, Any]:
    with _lock:
        if not _state:
            _state.update(_build())
        return _state


async def _render(renderer: Any, body: Any) -> Verdict:
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    if not isinstance(body, dict):
        return 400, create_error_response("request body is not a JSON object").model_dump()
    try:
        request = ChatCompletionRequest.model_validate(body)
        result = await renderer.render_chat(request)
    except ValidationError as exc:  # vLLM's handler of FastAPI's validation errors: a 400
        result = create_error_response(str(exc))
    except Exception as exc:  # noqa: BLE001 - mapped exactly as vLLM's API server maps it
        result = create_error_response(exc)
    if isinstance(result, ErrorResponse):
        return int(result.error.code), result.model_dump()
    return 200, None


def _submit(body: Any) -> Future[Verdict]:
    state = _judge()
    return asyncio.run_coroutine_threadsafe(_render(state["renderer"], body), state["loop"])


def render_check(body: Any, timeout: float = 120.0) -> Verdict:
    """What vLLM's front end (tiny Qwen2.5-VL, ``ec_consumer``) answers before its engine
    for ``body`` (a parsed JSON value): 200, or the status and error body it refuses with."""
    return _submit(body).result(timeout)


async def render_check_async(body: Any) -> Verdict:
    """:func:`render_check` from an event loop (the judge runs on its own)."""
    return await asyncio.wrap_future(_submit(body))
