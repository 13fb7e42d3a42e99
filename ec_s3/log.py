"""ec-s3's logger, following vLLM's logger conventions.

Inside vLLM (which always imports itself before loading a connector) this is vLLM's
``init_logger`` under the ``vllm.`` namespace, so ec-s3 lines get the engine's
handler, format and ``VLLM_LOGGING_LEVEL``. Standalone (CLI, bench) it is a plain
stdlib logger of the same name, which avoids importing vLLM (seconds) for nothing.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["logger"]

_NAME = "vllm.ec_s3"

if "vllm" in sys.modules:
    try:
        from vllm.logger import init_logger

        logger = init_logger(_NAME)
    except Exception:  # pragma: no cover - a broken vLLM must not break ec-s3's logging
        logger = logging.getLogger(_NAME)
else:
    logger = logging.getLogger(_NAME)
