"""Staging area: bounded bytes, pinned slots survive, LRU eviction of unpinned ones,
delayed unlink after dispatch, and leftovers of dead processes cleaned at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ec_s3.transfer.staging import StagingArea


def _ready(area: StagingArea, name: str, n: int):
    slot = area.allocate(name, n)
    assert slot is not None
    area.mark_ready(slot)
    return slot


def test_bounded_and_pinned_slots_are_kept(tmp_path: Path) -> None:
    area = StagingArea(str(tmp_path), capacity_bytes=300)
    a = _ready(area, "a", 100)
    assert area.pin(a)
    _ready(area, "b", 100)
    _ready(area, "c", 100)
    assert area.used == 300
    area.advance_step()
    d = area.allocate("d", 150)  # evicts b and c (LRU, unpinned), never the pinned a
    assert d is not None and area.used == 250
    assert area.get("a") is a and area.get("b") is None and area.get("c") is None
    assert os.path.getsize(d.path) == 150 and os.path.exists(a.path)
    assert area.allocate("e", 100) is None  # a pinned, d not ready: no room
    assert area.allocate("huge", 301) is None
    area.close()
    assert not area.dir.exists()


def test_touched_slot_survives_this_step(tmp_path: Path) -> None:
    area = StagingArea(str(tmp_path), capacity_bytes=100)
    a = _ready(area, "a", 100)
    assert area.touch(a)  # has_cache_item said yes in this step
    assert area.allocate("b", 100) is None
    area.advance_step()
    assert area.allocate("b", 100) is not None and a.evicted
    assert not area.pin(a) and not area.touch(a)


def test_dispatched_slot_is_unlinked_after_grace(tmp_path: Path) -> None:
    area = StagingArea(str(tmp_path), capacity_bytes=100)
    a = _ready(area, "a", 100)
    area.mark_dispatched(a)
    area.advance_step()
    b = area.allocate("b", 100)  # a evicted, but a worker may still open it
    assert b is not None and a.evicted and b.path != a.path
    assert os.path.exists(a.path)  # kept at its own path through the grace
    for _ in range(4):
        area.advance_step()
    assert not os.path.exists(a.path) and os.path.exists(b.path)


def test_dead_process_leftovers_are_removed(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", f"from ec_s3.transfer.staging import StagingArea; a = StagingArea({str(tmp_path)!r}, 10); "
         "s = a.allocate('x', 5); print(a.dir)"],
        capture_output=True, text=True, check=True,
    )
    leftover = Path(proc.stdout.strip())
    assert leftover.exists()  # the process died without close()
    live = StagingArea(str(tmp_path), 10)
    assert not leftover.exists() and live.dir.exists()
