"""Start-up checks: fail fast on misconfiguration, degrade on an unreachable store.

One attempt each: every role GETs a probe key (its error code tells a missing bucket,
wrong credentials and missing permission apart); a producer also makes a conditional PUT.
Misconfiguration raises :class:`StartupCheckError` (or warns, ``startup_check="warn"``);
an unreachable store only warns. :func:`check_engine_start` adds warnings about vLLM
settings that defeat ec-s3. Owns the checks and their wording. Does not own the store
client or the diagnosis (:mod:`ec_s3.store.diagnose`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ec_s3.loop import BackgroundLoop
from ec_s3.config import ECS3Config
from ec_s3.blob.keys import probe_key
from ec_s3.log import logger
from ec_s3.store.connection import resolve_endpoint
from ec_s3.store.diagnose import diagnose
from ec_s3.store.client import ObjectNotFound, S3Store, StoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["StartupCheckError", "check_engine_start", "run_startup_checks"]

_PROBE_BODY = b"ec-s3 write probe\n"
# Diagnoses that mean "the store is not answering", not "the configuration is wrong".
_DEGRADED_KINDS = frozenset({"endpoint", "server"})


class StartupCheckError(RuntimeError):
    """ec-s3 cannot work with this store configuration; the message says how to fix it."""


def check_engine_start(vllm_config: VllmConfig, config: ECS3Config, *, producer: bool, consumer: bool) -> None:
    """Once per engine, before any traffic: a bad bucket or credentials fail here with
    a message that says what to fix; settings that lose data are warned about."""
    run_startup_checks(config, producer=producer, consumer=consumer)
    if producer and not getattr(vllm_config, "shutdown_timeout", 0):
        logger.warning(
            "ec-s3: vLLM runs with --shutdown-timeout 0, so on SIGTERM it kills the engine at "
            "once and uploads still pending are lost%s; start producers with "
            "--shutdown-timeout %d (and VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS >= that)",
            " (spool_dir keeps only what already failed)" if config.spool_dir else "",
            int(config.shutdown_timeout_s) + 2,
        )


def run_startup_checks(config: ECS3Config, *, producer: bool, consumer: bool, loop: BackgroundLoop | None = None) -> list[str]:
    """Run the checks for these roles; returns the problems found (empty = healthy).

    Raises :class:`StartupCheckError` for misconfiguration when
    ``config.startup_check == "fatal"``.
    """
    if config.startup_check == "off":
        return []
    store = S3Store(dataclasses.replace(config, max_attempts=1), loop=loop)
    where = f"s3://{config.bucket}/{config.prefix}/ at {config.endpoint_url or 'AWS ' + resolve_endpoint(config).region}"
    timeout = 3 * (config.connect_timeout_s + config.read_timeout_s)
    role = "ec_producer" if producer else "ec_consumer"
    fatal: list[str] = []
    degraded: list[str] = []
    steps = [("GET", store.get_async)] + ([("PUT", None)] if producer else [])
    try:
        for op, _ in steps:
            try:
                if op == "GET":
                    store.run(store.get_async(probe_key(config.prefix)), timeout)
                else:
                    store.run(store.put_async(probe_key(config.prefix), bytearray(_PROBE_BODY)), timeout)
            except ObjectNotFound:
                continue
            except (StoreError, TimeoutError) as exc:
                diagnosis = diagnose(exc, config, op=op)
                problem = f"{role} {op} check: {diagnosis.cause}; fix: {diagnosis.fix}"
                (degraded if diagnosis.kind in _DEGRADED_KINDS else fatal).append(problem)
                break
    finally:
        store.close(timeout=1.0)
    for problem in degraded:
        logger.warning("ec-s3: %s is not usable (%s); starting degraded: items are encoded locally until it answers",
                       where, problem)
    if fatal:
        message = f"ec-s3 start-up check of {where} failed: " + "; ".join(fatal) + " (startup_check='warn' starts anyway)"
        if config.startup_check == "fatal":
            raise StartupCheckError(message)
        logger.error("%s", message)
    elif not degraded:
        logger.info("ec-s3: start-up check of %s passed (%s)", where, role)
    return fatal + degraded
