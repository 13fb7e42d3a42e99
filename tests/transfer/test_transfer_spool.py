"""The producer spool against a real S3 server: private directory and files, any key
length, only this producer's keys ever uploaded, and a re-upload task that outlives
whatever goes wrong."""

from __future__ import annotations

import base64
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ec_s3.blob.keys import KeySpace, model_namespace
from ec_s3.config import ConfigError
from ec_s3.store.client import S3Store
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.spool import Spool

MiB = 1 << 20
KEYS = KeySpace("ec-s3", model_namespace("org/model", revision=None, dtype="bfloat16", encoder_width=128))


def _spool(directory: Path, store: S3Store, counters: Counters | None = None, *, retry_s: float = 0.05,
           owns: Callable[[str], bool] = KEYS.owns) -> Spool:
    return Spool(str(directory), 64 * MiB, retry_s, store, counters or Counters(), owns=owns)


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _present(store: S3Store, key: str) -> bool:
    return store.run(store.head_async(key)) is not None


def test_spool_directory_and_files_are_private(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    store = make_store()
    spool = _spool(tmp_path / "spool", store)
    assert store.run(spool.save(KEYS.key_for("img"), b"blob bytes"))
    assert stat.S_IMODE(os.stat(spool.dir).st_mode) == 0o700
    [path] = spool.pending()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_spool_directory_writable_by_others_is_refused(
    tmp_path: Path, make_store: Callable[..., S3Store], mode: int
) -> None:
    directory = tmp_path / "spool"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(ConfigError, match="spool_dir") as info:
        _spool(directory, make_store())
    assert getattr(info.value, "key", None) == "spool_dir" and "0700" in str(info.value)


def test_spool_directory_of_another_user_is_refused(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    directory = tmp_path / "spool"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        _spool(directory, make_store())


def test_long_keys_are_spooled_and_delivered(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    """A tenant-salted key under a long prefix is > 190 characters: as base64 in a file
    name it exceeded 255 bytes (ENAMETOOLONG) and the blob was silently dropped."""
    model = "org/llava-onevision-qwen2-72b-ov-chat-hf-instruct-finetuned-v2"
    namespace = model_namespace(model, revision=None, dtype="bfloat16", encoder_width=8192)
    keys = KeySpace("team-a/encoder-cache/production", namespace)
    key = keys.key_for("img-long", cache_salt="tenant-42")
    old_name = f"{time.time_ns():020d}__{base64.urlsafe_b64encode(key.encode()).decode().rstrip('=')}.blob"
    assert len(old_name) > 255
    store = make_store()
    spool = _spool(tmp_path / "spool", store, owns=keys.owns)
    assert store.run(spool.save(key, b"long-key blob")), "the blob was not spooled"
    assert all(len(p.name) < 100 for p in spool.pending())
    assert store.run(spool.drain_once()) == 1
    assert store.run(store.get_async(key)).tobytes() == b"long-key blob"
    assert spool.pending() == [] and spool.used == 0


def test_only_this_producers_keys_leave_the_spool(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    """Files dropped into the spool directory cannot make ec-s3 write a key: an old-style
    name decoding to a foreign key, a well-formed file with a foreign key, a symlink."""
    store = make_store()
    directory = tmp_path / "spool"
    counters = Counters()
    spool = _spool(directory, store, counters)
    evil = "other-tenant/namespace/" + "0" * 64 + ".safetensors"
    legacy = directory / f"{0:020d}__{base64.urlsafe_b64encode(evil.encode()).decode().rstrip('=')}.blob"
    legacy.write_bytes(b"poison")
    target = tmp_path / "target"
    target.write_bytes(b"x")
    (directory / f"{1:020d}-{'0' * 32}-00000000.blob").symlink_to(target)
    foreign = _spool(directory, store, owns=lambda key: True)  # another writer, another key space
    assert store.run(foreign.save(evil, b"poison"))
    good = KEYS.key_for("img-good")
    assert store.run(spool.save(good, b"good blob"))
    assert store.run(spool.drain_once()) == 1
    assert not _present(store, evil), "a file dropped into the spool wrote a foreign key"
    assert _present(store, good)
    assert spool.pending() == []
    assert len(list(directory.glob("*.rejected"))) == 3 and target.read_bytes() == b"x"
    assert counters.get("spool_rejected") == 3
    assert not store.run(spool.save(evil, b"poison")), "save must refuse a foreign key too"


def test_drain_task_survives_a_file_it_cannot_read(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    """A directory named like a spool file, oldest of all, used to kill the re-upload
    task (IsADirectoryError): nothing spooled after it was ever delivered."""
    store = make_store()
    directory = tmp_path / "spool"
    directory.mkdir(mode=0o700)
    (directory / f"{0:020d}__{'A' * 8}.blob").mkdir()
    spool = _spool(directory, store)
    spool.start()
    try:
        time.sleep(0.3)  # the task has met the directory by now
        key = KEYS.key_for("img-after")
        assert store.run(spool.save(key, b"after"))
        assert _wait_for(lambda: _present(store, key)), "the re-upload task died"
    finally:
        spool.stop()


def test_drain_task_survives_an_unexpected_error(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    """Its creator's callable raises once: the task logs, backs off and carries on."""
    calls = {"n": 0}

    def flaky_owns(key: str) -> bool:
        calls["n"] += 1
        if calls["n"] == 2:  # the first check while draining
            raise RuntimeError("injected")
        return KEYS.owns(key)

    store = make_store()
    counters = Counters()
    spool = _spool(tmp_path / "spool", store, counters, owns=flaky_owns)
    key = KEYS.key_for("img-flaky")
    assert store.run(spool.save(key, b"flaky"))
    spool.start()
    try:
        assert _wait_for(lambda: _present(store, key)), "the re-upload task died"
        assert counters.get("spool_drain_errors") == 1
    finally:
        spool.stop()


def test_leftovers_of_an_earlier_process_are_resumed(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    store = make_store()
    first = _spool(tmp_path / "spool", store)
    key = KEYS.key_for("img-resume")
    assert store.run(first.save(key, b"resume"))
    (tmp_path / "spool" / "torn.blob.0000.tmp").write_bytes(b"half")
    second = _spool(tmp_path / "spool", store)
    assert second.used == first.used > 0
    assert not list((tmp_path / "spool").glob("*.tmp"))
    assert store.run(second.drain_once()) == 1 and _present(store, key) and second.used == 0
