"""Device copies of the data path: host → device for a load, device → pinned host for
an upload, each on a side stream that the host never waits for.

:class:`DeviceLoader` (consumer worker) and :class:`HostCopier` (producer publisher).
Imports torch and nothing of vLLM or the S3 store (tests/test_gpu_path.py). Owns the side
streams and the order of the copies on them. Does not own host buffers
(:mod:`ec_s3.transfer.hostpool`), load specs or devices (:mod:`ec_s3.connector.worker`),
nor when an upload reads the buffer (:mod:`ec_s3.transfer.publisher`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ec_s3.transfer.slot_reader import map_verified_slot

__all__ = ["DeviceLoader", "HostCopier", "SlotRef"]


class SlotRef(Protocol):
    """What a load names of a slot and the blob staged in it (``LoadSpec`` in the connector has these)."""

    @property
    def path(self) -> str: ...
    @property
    def identifier(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def handle(self) -> str: ...
    @property
    def inode(self) -> tuple[int, int]: ...


class DeviceLoader:
    """Host → device copies for loads; keeps one side stream (created at the first CUDA
    load, so a CPU-only host never touches CUDA)."""

    def __init__(self) -> None:
        self._stream: Any = None

    def load_slot(self, blob: SlotRef, device: torch.device, on_reopen: Callable[[], None] | None = None) -> torch.Tensor:
        """The staged blob's tensor on ``device``. Raises ``OSError`` or
        :class:`~ec_s3.transfer.slot_reader.SlotMismatch` when the file is gone
        or is another blob. ``on_reopen`` is called when the blob was read through
        the scheduler's handle because its path no longer led to it."""
        dtype = getattr(torch, blob.dtype)
        # The path names one generation of a slot; the header must name this item.
        mm, reopened = map_verified_slot(
            blob.path, identifier=blob.identifier, nbytes=blob.nbytes, data_offset=blob.data_offset,
            dtype=blob.dtype, shape=blob.shape, handle=blob.handle, inode=blob.inode,
        )
        if reopened and on_reopen is not None:
            on_reopen()
        try:
            count = blob.nbytes - blob.data_offset
            mapped = torch.frombuffer(mm, dtype=torch.uint8, count=count, offset=blob.data_offset)
            return self.to_device(mapped.view(dtype).reshape(blob.shape), device)
        finally:
            with contextlib.suppress(BufferError):
                mm.close()

    def to_device(self, source: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of the CPU tensor ``source`` on ``device`` that owns its memory (the
        source may be a mapping about to close)."""
        if device.type != "cuda":
            return source.clone() if device.type == "cpu" else source.to(device)
        # Pageable → pinned (a host memcpy), then an async H2D copy on a side stream;
        # the compute stream waits on an event, not the host. The caching host
        # allocator keeps the pinned block alive until the copy has run.
        pinned = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        pinned.copy_(source)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            out = pinned.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        current.wait_event(done)
        out.record_stream(current)
        return out


class HostCopier:
    """Device → pinned host copies for uploads; keeps one side stream (created at the
    first copy)."""

    def __init__(self) -> None:
        self._stream: Any = None

    def start(self, tensor: torch.Tensor, dst: torch.Tensor) -> Any:
        """Queue the copy of CUDA ``tensor``'s bytes into ``dst`` (pinned uint8 of the
        same byte length) after the current stream's work; returns the CUDA event that
        completes with it. Never syncs the host."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        current = torch.cuda.current_stream(tensor.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            src = tensor.detach()
            if not src.is_contiguous():
                src = src.contiguous()
            dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # The caching allocator must not reuse the tensor's memory before the copy.
        tensor.record_stream(self._stream)
        return event
