"""Where the time of the demo's disaggregated requests went, read from the servers'
own ``/metrics``.

Owns the reading of vLLM's and ec-s3's histograms (deltas of ``_sum`` and ``_count`` over
three scrapes per step), the cells they print as, and :class:`Snapshot` (one scrape of the
three servers). Does not own the scrapes (:mod:`ec_s3.demo.epd`), the table around them
(:mod:`ec_s3.demo.report`) nor the metrics themselves. Details: docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ec_s3.sandbox.metrics import MetricSamples

__all__ = [
    "H_DOWNLOAD",
    "H_E2E",
    "H_INFERENCE",
    "H_QUEUE",
    "H_UPLOAD",
    "C_TO_ENCODER",
    "C_TO_ENCODER_S",
    "Part",
    "Snapshot",
    "StepTimes",
    "histogram_delta",
    "step_times",
]

# vLLM's own request histograms (arrival to finish; queued to first scheduled; first
# scheduled to last token), and the connector's transfer histograms.
H_E2E = "vllm:e2e_request_latency_seconds"
H_QUEUE = "vllm:request_queue_time_seconds"
H_INFERENCE = "vllm:request_inference_time_seconds"
H_UPLOAD = "vllm:ec_s3_upload_seconds"
H_DOWNLOAD = "vllm:ec_s3_download_seconds"
# The proxy's counters of its requests to the encoder (all outcomes) and their seconds.
C_TO_ENCODER = "ec_s3_proxy_encoder_requests_total"
C_TO_ENCODER_S = "ec_s3_proxy_encoder_seconds_total"


@dataclass
class Snapshot:
    """The three servers' /metrics, and the run's blobs, at one point of the schedule."""

    producer: MetricSamples
    consumer: MetricSamples
    proxy: MetricSamples
    blobs: frozenset[str] | None = None  # blob keys under the run's prefix (bucket listing)


@dataclass(frozen=True)
class Part:
    """One part of a request's time: ``seconds`` (mean over the events of the step),
    ``events`` (how many the histogram counted), or n/a with ``why`` when the server
    does not report it."""

    seconds: float | None
    events: float = 0.0
    why: str = ""

    @property
    def measured(self) -> bool:
        return self.seconds is not None

    def cell(self) -> str:
        if self.seconds is None:
            return "n/a"
        if not self.events:
            return "-"  # nothing of that kind happened in this step
        return f"{1000 * self.seconds:.1f}" if self.seconds < 0.01 else f"{1000 * self.seconds:.0f}"


def histogram_delta(after: MetricSamples, before: MetricSamples, name: str) -> tuple[float, float] | None:
    """(sum, count) a histogram gained between two scrapes; None when ``after`` does
    not export it."""
    total, count = after.get(name + "_sum"), after.get(name + "_count")
    if total is None or count is None:
        return None
    return total - (before.get(name + "_sum") or 0.0), count - (before.get(name + "_count") or 0.0)


def _part(after: MetricSamples, before: MetricSamples, name: str, server: str) -> Part:
    delta = histogram_delta(after, before, name)
    if delta is None:
        return Part(None, why=f"the {server} exports no {name}")
    total, count = delta
    return Part(total / count if count else 0.0, count)


def _proxy_part(after: MetricSamples, before: MetricSamples) -> Part:
    seconds, count = after.get(C_TO_ENCODER_S), after.get(C_TO_ENCODER)
    if seconds is None or count is None:
        return Part(None, why=f"the proxy exports no {C_TO_ENCODER_S}")
    n = count - (before.get(C_TO_ENCODER) or 0.0)
    total = seconds - (before.get(C_TO_ENCODER_S) or 0.0)
    return Part(total / n if n else 0.0, n)


@dataclass(frozen=True)
class StepTimes:
    """Mean time per request of one step, by part."""

    to_encoder: Part  # the proxy's request to the encoder server
    encoder: Part  # inside it, the encoder server's request time: arrival (rendering starts) to finish
    upload: Part  # the encoder's PUT of a blob (after its answer: overlaps the hop to prefill/decode)
    wait: Part  # prefill/decode: queued to first scheduled (waiting for the blob, mostly)
    fetch: Part  # prefill/decode: GET + validation of a blob (inside wait)
    prefill_decode: Part  # prefill/decode: first scheduled to last token
    pd_server: Part  # prefill/decode: arrival (rendering starts) to finish

    def pd_front(self) -> Part:
        """The prefill/decode server's request time beyond wait and prefill + decode:
        rendering and image processing, hand-offs between its front end and engine."""
        parts = (self.pd_server, self.wait, self.prefill_decode)
        if not all(p.measured and p.events for p in parts):
            return Part(None, why="a prefill/decode request time is missing")
        return Part((self.pd_server.seconds or 0.0) - (self.wait.seconds or 0.0)
                    - (self.prefill_decode.seconds or 0.0), 1.0)

    def other(self, latency_s: float, *, parallel: bool = False) -> Part:
        """What the client saw beyond the servers' request times: the proxy and HTTP.
        Serial dispatch adds the hop to the encoder and the prefill/decode server's
        request time; under parallel dispatch the hop runs inside the latter (which
        waits for the blob), so only the prefill/decode server's time is on the path."""
        first = self.to_encoder if self.to_encoder.measured else self.encoder
        # An item the proxy knew was in the bucket made no encoder request: nothing of it on the path.
        skipped = first.measured and not first.events
        if not (first.measured and (first.events or skipped) and self.pd_server.measured and self.pd_server.events):
            return Part(None, why="a server request time is missing")
        on_path = 0.0 if parallel or skipped else (first.seconds or 0.0)
        return Part(latency_s - on_path - (self.pd_server.seconds or 0.0), 1.0)


def step_times(start: Snapshot, answered: Snapshot, flushed: Snapshot, *, uploads_reported: bool,
               uploads_unreported_why: str = "") -> StepTimes:
    """One step's :class:`StepTimes`. vLLM's request histograms are read from ``start``
    to ``answered`` (the scrape after the answers, before the producer was given
    another step, whose request would count too); the connector's from ``start`` to
    ``flushed``. ``uploads_reported`` False makes the upload n/a (the producer reported
    no upload in the whole run), with ``uploads_unreported_why``."""
    upload = (_part(flushed.producer, start.producer, H_UPLOAD, "encoder") if uploads_reported
              else Part(None, why=uploads_unreported_why))
    return StepTimes(
        to_encoder=_proxy_part(answered.proxy, start.proxy),
        encoder=_part(answered.producer, start.producer, H_E2E, "encoder"),
        upload=upload,
        wait=_part(answered.consumer, start.consumer, H_QUEUE, "prefill/decode server"),
        fetch=_part(flushed.consumer, start.consumer, H_DOWNLOAD, "prefill/decode server"),
        prefill_decode=_part(answered.consumer, start.consumer, H_INFERENCE, "prefill/decode server"),
        pd_server=_part(answered.consumer, start.consumer, H_E2E, "prefill/decode server"),
    )
