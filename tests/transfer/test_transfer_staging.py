"""Staging under host faults: a full tmpfs (no SIGBUS), another consumer's live
directory (owner locks, not PIDs), failed allocations (nothing stays booked), an
evicted slot re-staged under the same name (a slow worker never reads the new,
half-written file) and directories or files someone else could write."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_s3.blob.codec import BlobLayout, BlobMeta, encode_blob
from ec_s3.config import ConfigError
from ec_s3.log import logger
from ec_s3.store.client import S3Store
from ec_s3.transfer.staging import StagingArea, map_slot

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, like a container's default-sized /dev/shm after other users."""
    mount = tmp_path / "shm"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def ec_log() -> Iterator[_Records]:
    """ec-s3's log lines (vLLM's logger may not propagate to pytest's root handler)."""
    handler = _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# ---------------------------------------------------------------- 4: full tmpfs
def test_blob_larger_than_free_shm_is_no_space_not_sigbus(
    tiny_tmpfs: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """The fetcher stages a 2 MiB blob into a 1 MiB tmpfs in a child process: before
    slots were reserved, the GET's write through mmap was a SIGBUS (exit -7)."""
    identifier, ns = "img-big", "ns"
    x = torch.ones(1024, 1024, dtype=torch.bfloat16)  # 2 MiB
    key = "k/big.safetensors"
    store = make_store()
    store.run(store.put_async(key, encode_blob(x, BlobMeta(identifier, x.dtype, tuple(x.shape), ns, "p"))))
    proc = _run_python(
        """
        import json, sys, time
        from ec_s3.blob.codec import BlobExpectation
        from ec_s3.config import ECS3Config
        from ec_s3.store.client import S3Store
        from ec_s3.transfer.counters import Counters
        from ec_s3.transfer.fetcher import ItemFetcher
        from ec_s3.transfer.staging import StagingArea

        extra, staging_dir, key, identifier, ns = json.loads(sys.argv[1])
        store = S3Store(ECS3Config.from_extra_config(extra, environ={}))
        area = StagingArea(staging_dir, 64 << 20)
        fetcher = ItemFetcher(store, area, Counters())
        fetcher.start(key, BlobExpectation(identifier=identifier, namespace=ns))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            results = fetcher.drain()
            if results:
                print(type(results[0][1]).__name__, area.used, len(list(area.dir.glob("*.blob"))))
                break
            time.sleep(0.01)
        store.close()
        """,
        json.dumps([extra_config(), str(tiny_tmpfs), key, identifier, ns]),
    )
    assert proc.returncode != -signal.SIGBUS, "staging a blob into a full tmpfs killed the process with SIGBUS"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["NoSpace", "0", "0"], proc.stdout + proc.stderr[-3000:]


def test_full_shm_allocation_books_nothing_and_warns(tiny_tmpfs: Path, ec_log: _Records) -> None:
    from ec_s3.transfer.staging import NoStagingSpace

    area = StagingArea(str(tiny_tmpfs), capacity_bytes=64 * MiB)
    assert any("staging_bytes" in line and "shm" in line for line in ec_log.lines), ec_log.lines
    with pytest.raises(NoStagingSpace) as info:
        area.allocate("big", 2 * MiB)
    assert info.value.nbytes == 2 * MiB
    assert area.used == 0 and len(area) == 0 and list(area.dir.glob("*.blob")) == []
    assert any("full" in line and "shm-size" in line for line in ec_log.lines)
    small = area.allocate("big", 256 * 1024)  # the name is free again, and space is reserved
    assert small is not None and os.stat(small.path).st_blocks * 512 >= 256 * 1024
    area.close()


def test_start_up_is_quiet_when_staging_fits(tmp_path: Path, ec_log: _Records) -> None:
    StagingArea(str(tmp_path), capacity_bytes=MiB).close()
    assert not any("staging_bytes" in line for line in ec_log.lines)


# ---------------------------------------------------------------- 5: owner locks
_HOLDER = """
    import os, sys
    from ec_s3.transfer.staging import StagingArea
    area = StagingArea(sys.argv[1], 1 << 20)
    slot = area.allocate("held", 100)
    # Look like a process of another PID namespace: a PID that does not exist here.
    fake = area.dir.with_name(f"ec-s3-{sys.argv[2]}-{area.dir.name.rsplit('-', 1)[1]}")
    os.rename(area.dir, fake)
    print(fake, flush=True)
    sys.stdin.readline()  # live until the test says so
"""


def _unused_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


def test_live_directory_of_another_pid_namespace_survives_start_up(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), str(tmp_path), str(_unused_pid())],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None
        live = Path(holder.stdout.readline().strip())
        assert live.is_dir() and any(live.glob("held.*.blob"))
        other = StagingArea(str(tmp_path), MiB)  # a second consumer starts on the same /dev/shm
        assert live.is_dir() and any(live.glob("held.*.blob")), "a live consumer's staging was removed"
        other.close()
    finally:
        holder.kill()
        holder.wait(10)
    # Its owner is gone now: the next start-up removes it.
    StagingArea(str(tmp_path), MiB).close()
    assert not live.exists()


def test_start_up_leaves_directories_it_cannot_judge(tmp_path: Path) -> None:
    no_lock = tmp_path / f"ec-s3-{_unused_pid()}-0000abcd"  # being created, or an older ec-s3's
    no_lock.mkdir()
    foreign = tmp_path / f"ec-s3-{_unused_pid()}-0000beef"  # another user's, lock free
    foreign.mkdir()
    (foreign / ".owner.lock").touch()
    os.chown(foreign, 65534, 65534)
    StagingArea(str(tmp_path), MiB).close()
    assert no_lock.is_dir() and foreign.is_dir()


# ---------------------------------------------------------------- 6: rollback
def test_failed_allocation_books_nothing(tmp_path: Path) -> None:
    area = StagingArea(str(tmp_path), capacity_bytes=1000)
    shutil.rmtree(area.dir)  # e.g. a cleaner removed the directory under us
    with pytest.raises(OSError):
        area.allocate("k", 100)
    assert area.used == 0 and area.get("k") is None
    area.dir.mkdir(mode=0o700)
    slot = area.allocate("k", 1000)  # neither the bytes nor the name are stuck
    assert slot is not None and area.used == 1000
    area.close()


def test_bad_slot_name_is_refused_before_booking(tmp_path: Path) -> None:
    area = StagingArea(str(tmp_path), capacity_bytes=1000)
    for name in ("../x", "a/b", "", ".owner.lock"):
        with pytest.raises(ValueError):
            area.allocate(name, 10)
    assert area.used == 0
    area.close()


# ---------------------------------------------------------------- 10: files and dirs
def test_slot_files_are_private(tmp_path: Path) -> None:
    area = StagingArea(str(tmp_path / "staging"), capacity_bytes=1000)
    slot = area.allocate("k", 10)
    assert slot is not None
    assert stat.S_IMODE(os.stat(area.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(slot.path).st_mode) == 0o600
    area.close()


def test_staging_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone could replace our directory
    with pytest.raises(ConfigError, match="staging_dir") as info:
        StagingArea(str(shared), 1000)
    assert getattr(info.value, "key", None) == "staging_dir" and "0700" in str(info.value)
    assert str(shared / "ec-s3") in str(info.value)  # the way out it suggests (e.g. a k8s emptyDir) works:
    StagingArea(str(shared / "ec-s3"), 1000).close()
    assert stat.S_IMODE(os.stat(shared / "ec-s3").st_mode) == 0o700
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        StagingArea(str(theirs), 1000)
    sticky = tmp_path / "shm-like"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /dev/shm: accepted, our own subdirectory is private
    StagingArea(str(sticky), 1000).close()


def test_map_slot_never_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 10)
    link = tmp_path / "slot.blob"
    link.symlink_to(target)
    with pytest.raises(OSError):
        map_slot(str(link))


# ---------------------------------------------------------------- 7: generations
def _blob(identifier: str, ns: str) -> tuple[torch.Tensor, BlobMeta, bytes]:
    x = torch.arange(16 * 128, dtype=torch.float32).reshape(16, 128).to(torch.bfloat16) + 1
    meta = BlobMeta(identifier, torch.bfloat16, (16, 128), ns, "p")
    return x, meta, bytes(encode_blob(x, meta))


def _stage(area: StagingArea, name: str, data: bytes):
    slot = area.allocate(name, len(data))
    assert slot is not None
    mm = map_slot(slot.path, writable=True)
    mm[:] = data
    mm.close()
    area.mark_ready(slot)
    return slot


@pytest.fixture
def worker(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_s3.connector.facade import ECS3Connector
    from support.vllm_rig import make_vllm_config

    cfg = make_vllm_config(tiny_model_dir, {
        "ec_connector": "ECS3Connector", "ec_connector_module_path": "ec_s3", "ec_role": "ec_consumer",
        "ec_connector_extra_config": extra_config()})
    conn = ECS3Connector(cfg, ECConnectorRole.WORKER)
    yield conn
    conn.shutdown()


def _load(conn: Any, spec: Any) -> dict[str, torch.Tensor]:
    from ec_s3.connector.messages import ECS3ConnectorMetadata

    cache: dict[str, torch.Tensor] = {}
    conn.bind_connector_metadata(ECS3ConnectorMetadata(loads=[spec]))
    conn.start_load_caches(cache)
    return cache


def _spec(conn: Any, identifier: str, path: str, meta: BlobMeta) -> Any:
    from ec_s3.connector.messages import LoadSpec
    from ec_s3.connector.model import host_id

    layout = BlobLayout.plan(meta)
    return LoadSpec(identifier, conn.model.keyspace.key_for(identifier), path, layout.data_offset, layout.total_nbytes,
                    "bfloat16", (16, 128), host_id())


def test_slow_worker_never_reads_a_restaged_half_written_slot(worker: Any, tmp_path: Path) -> None:
    """Evict a slot in its grace period, stage the same name again (not yet written):
    a worker holding the old spec must get the old blob, never the new zeros."""
    identifier = "img-race"
    x, meta, data = _blob(identifier, worker.model.keyspace.namespace)
    area = StagingArea(str(tmp_path), capacity_bytes=len(data))  # room for one slot
    old = _stage(area, "k", data)
    spec = _spec(worker, identifier, old.path, meta)  # sent to workers in this step's metadata
    area.mark_dispatched(old)
    area.advance_step()
    _stage(area, "other", data)  # evicts k inside its grace
    area.discard("other")
    assert old.evicted
    new = area.allocate("k", len(data))  # the same key staged again; its GET has not written yet
    assert new is not None
    cache = _load(worker, spec)  # the slow worker opens its spec now
    assert identifier in cache, "the old generation must still be readable during its grace"
    assert torch.equal(cache[identifier], x), "read the re-staged, half-written slot instead of the old blob"
    assert worker.counters.get("staging_read_failures") == 0
    area.close()


def test_worker_refuses_another_items_blob_and_symlinks(
    worker: Any, tmp_path: Path, make_store: Callable[..., S3Store]
) -> None:
    """A staging file that is not this item's blob (another identifier, zeros, a
    symlink) is never loaded: the worker reports it and fetches from S3."""
    ns = worker.model.keyspace.namespace
    identifier = "img-mine"
    x, meta, data = _blob(identifier, ns)
    store = make_store()
    store.run(store.put_async(worker.model.keyspace.key_for(identifier), data))
    _, _, other = _blob("img-theirs", ns)
    wrong = tmp_path / "wrong.blob"
    wrong.write_bytes(other)  # same size, same layout, another item
    zeros = tmp_path / "zeros.blob"
    zeros.write_bytes(bytes(len(data)))
    good = tmp_path / "good.blob"
    good.write_bytes(data)
    link = tmp_path / "link.blob"
    link.symlink_to(good)
    for n, path in enumerate((wrong, zeros, link), start=1):
        cache = _load(worker, _spec(worker, identifier, str(path), meta))
        assert torch.equal(cache[identifier], x), path.name  # from S3, not from the file
        assert worker.counters.get("staging_read_failures") == n, path.name
    cache = _load(worker, _spec(worker, identifier, str(good), meta))
    assert torch.equal(cache[identifier], x) and worker.counters.get("staging_read_failures") == 3


# ---------------------------------------------------------------- a peer cleans staging_dir
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_slot_is_read_through_its_handle_by_another_process_once_its_name_is_gone(tmp_path: Path) -> None:
    """A worker process maps the scheduler's open file (``/proc/<pid>/fd/<n>``) when a
    peer deleted the slot's name, or put another file there; the inode proves it is
    the slot. Before, both were unreadable (and with the store down, fatal)."""
    x, meta, data = _blob("img-kept", "ns")
    area = StagingArea(str(tmp_path), capacity_bytes=2 * len(data))
    try:
        layout = BlobLayout.plan(meta)
        for fault in ("deleted", "replaced"):
            slot = _stage(area, f"k-{fault}", data)
            assert slot.handle == f"/proc/{os.getpid()}/fd/{slot.fd}" and slot.inode != (0, 0)
            os.unlink(slot.path)
            if fault == "replaced":
                Path(slot.path).write_bytes(data)  # the same bytes, but not the slot's file
            proc = _run_python(
                """
                import sys, torch
                from ec_s3.transfer.slot_reader import map_verified_slot
                path, handle, dev, ino, nbytes, offset = sys.argv[1:7]
                mm, reopened = map_verified_slot(path, identifier="img-kept", nbytes=int(nbytes),
                    data_offset=int(offset), dtype="bfloat16", shape=(16, 128), handle=handle, inode=(int(dev), int(ino)))
                t = torch.frombuffer(mm, dtype=torch.uint8, offset=int(offset)).view(torch.bfloat16)
                print(reopened, float(t.float().sum()))
                """,
                slot.path, slot.handle, str(slot.inode[0]), str(slot.inode[1]), str(layout.total_nbytes),
                str(layout.data_offset),
            )
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.split() == ["True", str(float(x.float().sum()))], fault
    finally:
        area.close()


def test_a_handle_whose_number_names_another_file_is_refused(tmp_path: Path) -> None:
    """Once the area releases a slot its descriptor number is free, and the next open
    gets it: a worker that reads the stale handle gets an error, never that file's bytes
    (the inode check; and should a file system reuse the inode number, the header)."""
    from ec_s3.transfer.slot_reader import SlotMismatch, map_verified_slot
    from ec_s3.transfer.staging import map_handle

    _, meta, data = _blob("img-gone", "ns")
    layout = BlobLayout.plan(meta)
    area = StagingArea(str(tmp_path), capacity_bytes=2 * len(data))
    try:
        live = _stage(area, "live", data)
        with pytest.raises(OSError) as info:
            map_handle(live.handle, (live.inode[0], live.inode[1] + 1))
        assert info.value.errno == errno.ESTALE
        slot = _stage(area, "k", data)
        handle, inode, number = slot.handle, slot.inode, slot.fd
        area.discard(slot)
        assert slot.fd == -1 and slot.handle == ""
        other = tmp_path / "other.bin"
        other.write_bytes(bytes(len(data)))
        fd = os.open(other, os.O_RDONLY)
        try:
            assert fd == number  # the lowest free number: the slot's old one
            with pytest.raises((OSError, SlotMismatch)):
                map_verified_slot(slot.path, identifier="img-gone", nbytes=layout.total_nbytes,
                                  data_offset=layout.data_offset, dtype="bfloat16", shape=(16, 128),
                                  handle=handle, inode=inode)
        finally:
            os.close(fd)
    finally:
        area.close()


def test_open_slot_files_stay_within_their_budget_and_close_with_their_slots(tmp_path: Path) -> None:
    """The area holds at most ``fd_budget`` slot files open; each closes when its slot's
    file is removed (discard, eviction, expiry) or the area closes: none leaks."""
    _, _, data = _blob("img-many", "ns")
    before = _open_fds()
    area = StagingArea(str(tmp_path), capacity_bytes=3 * len(data), fd_budget=2)
    base = _open_fds()  # the area's own owner lock
    slots = [_stage(area, f"k{n}", data) for n in range(3)]
    assert [bool(s.handle) for s in slots] == [True, True, False] and area.held_fds == 2
    assert _open_fds() == base + 2
    area.discard(slots[0])
    assert area.held_fds == 1 and _open_fds() == base + 1
    assert _stage(area, "k3", data).handle and area.held_fds == 2  # the freed budget
    k4 = _stage(area, "k4", data)  # evicts k1 (least recently used, never dispatched): unlinked now
    assert slots[1].evicted and slots[1].fd == -1 and k4.handle
    assert area.held_fds == 2 and _open_fds() == base + 2
    area.close()
    assert area.held_fds == 0 and _open_fds() == before
