"""Producer host buffers: a bounded pool of reusable byte buffers (pinned on CUDA).

Each buffer is allocated once and lent again and again; the pool counts what it holds,
lent or idle, against ``capacity``, so the in-flight bound is real memory whatever the
allocator does. Buffers come in size classes; a caller that sends its own memory takes a
*loan* of the same bound. Owns buffer memory and the bound. Does not own what goes into
a buffer (the publisher), the device copy or the upload. Why: docs/architecture.md.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import torch

__all__ = ["HostBuffer", "HostBufferPool"]

# Below this every request takes the smallest class: tiny blobs share buffers.
_MIN_CLASS = 64 * 1024
_OCTAVE_SHIFT = 4  # 2**4 = 16 classes per octave


class HostBuffer:
    """One buffer of the pool: ``data`` is a flat uint8 tensor of ``nbytes`` bytes, or
    None for a loan (room only: the borrower sends memory of its own)."""

    __slots__ = ("data", "nbytes", "lent")

    def __init__(self, data: torch.Tensor | None, nbytes: int) -> None:
        self.data = data
        self.nbytes = nbytes
        self.lent = False

    def view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the buffer, without a copy."""
        assert self.data is not None, "a loan has no buffer"
        return memoryview(self.data.numpy())[start:end]


def _plain(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class HostBufferPool:
    """Reusable host buffers; what the pool holds never exceeds ``capacity`` bytes.

    ``used`` is the bytes lent out (buffers and loans), ``held`` that plus idle buffers,
    ``peak`` the most ever held, ``allocations`` how many buffers were ever allocated
    (a pool that reuses its buffers stops counting up).
    """

    def __init__(
        self, capacity: int, *, pinned: bool = False, allocate: Callable[[int], torch.Tensor] | None = None
    ) -> None:
        self.capacity = capacity
        self.pinned = pinned
        self._allocate = allocate or (_pinned if pinned else _plain)
        self.used = 0
        self.held = 0
        self.peak = 0
        self.allocations = 0
        # size class -> idle buffers, most recently returned last (reused first: warm pages).
        self._idle: dict[int, list[HostBuffer]] = collections.defaultdict(list)
        # classes in the order their idle buffers were last touched, oldest first (eviction order)
        self._idle_order: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cond = threading.Condition()

    def class_size(self, nbytes: int) -> int:
        """The size of the buffer a request of ``nbytes`` gets."""
        if nbytes <= _MIN_CLASS:
            return _MIN_CLASS
        if self.pinned:
            return 1 << (nbytes - 1).bit_length()
        # nbytes in (2**k, 2**(k+1)]: classes are multiples of 2**k / 16
        step = 1 << ((nbytes - 1).bit_length() - 1 - _OCTAVE_SHIFT)
        return -(-nbytes // step) * step

    def fits(self, nbytes: int, *, buffer: bool = True) -> bool:
        """Whether a request of ``nbytes`` can ever be served (its class fits the bound)."""
        return (self.class_size(nbytes) if buffer else nbytes) <= self.capacity

    # ------------------------------------------------------------------ lending
    def try_acquire(self, nbytes: int, *, buffer: bool = True) -> HostBuffer | None:
        """A buffer of at least ``nbytes`` (a loan of exactly ``nbytes`` without
        ``buffer``), or None at once if the pool has no room."""
        size = self.class_size(nbytes) if buffer else nbytes
        with self._cond:
            return self._take(size, buffer)

    def acquire(self, nbytes: int, timeout: float | None = None, *, buffer: bool = True) -> HostBuffer | None:
        """As :meth:`try_acquire`, waiting up to ``timeout`` s for room."""
        size = self.class_size(nbytes) if buffer else nbytes
        if size > self.capacity:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                buf = self._take(size, buffer)
                if buf is not None:
                    return buf
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def release(self, buf: HostBuffer) -> None:
        """Give ``buf`` back for reuse (once; a second release is ignored)."""
        with self._cond:
            if not buf.lent:
                return
            buf.lent = False
            self.used -= buf.nbytes
            if buf.data is None:  # a loan: nothing to keep
                self.held -= buf.nbytes
                self._cond.notify_all()
                return
            self._idle[buf.nbytes].append(buf)
            self._idle_order[buf.nbytes] = None
            self._idle_order.move_to_end(buf.nbytes)
            self._cond.notify_all()

    def discard(self, buf: HostBuffer) -> None:
        """Give ``buf``'s room back without reusing it (something may still write into
        it, e.g. a device copy that never completed; its memory is freed when the last
        reference goes)."""
        with self._cond:
            if not buf.lent:
                return
            buf.lent = False
            self.used -= buf.nbytes
            self.held -= buf.nbytes
            self._cond.notify_all()

    def clear(self) -> None:
        """Free every idle buffer (shutdown)."""
        with self._cond:
            for size, bufs in self._idle.items():
                self.held -= size * len(bufs)
            self._idle.clear()
            self._idle_order.clear()

    # ------------------------------------------------------------------ inside the lock
    def _take(self, size: int, buffer: bool) -> HostBuffer | None:
        if size > self.capacity:
            return None
        idle = self._idle.get(size) if buffer else None
        if idle:
            buf = idle.pop()
            if not idle:
                del self._idle[size]
                self._idle_order.pop(size, None)
        else:
            if self.held + size > self.capacity and not self._evict_for(size):
                return None
            # Allocated while holding the lock: a concurrent acquire must not count the
            # same room twice. This runs once per buffer, not per blob.
            buf = HostBuffer(self._allocate(size) if buffer else None, size)
            self.allocations += buffer
            self.held += size
            self.peak = max(self.peak, self.held)
        buf.lent = True
        self.used += size
        return buf

    def _evict_for(self, size: int) -> bool:
        """Free idle buffers (least recently used classes first) until ``size`` fits."""
        idle_bytes = sum(s * len(b) for s, b in self._idle.items())
        if self.held - idle_bytes + size > self.capacity:
            return False  # lent-out buffers alone leave no room: wait instead of evicting
        while self.held + size > self.capacity:
            oldest = next(iter(self._idle_order))
            bufs = self._idle[oldest]
            bufs.pop(0)
            self.held -= oldest
            if not bufs:
                del self._idle[oldest]
                del self._idle_order[oldest]
        return True
