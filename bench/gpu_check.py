"""GPU path check (issue #13 goal 7): ec-s3's device<->host data path on a real GPU,
without vLLM.

Owns: one script that runs on a CUDA host that has torch and this repository but no
vLLM, no network and no package registry, and checks four things through ec-s3's own
code (``BlobPublisher``, the blob codec, ``StagingArea`` and the worker's staged-load
code, ``DeviceLoader``), each against a baseline measured in the same run:

1. step slowdown: a matmul "model step" loop (encoder output made, then matmuls on the
   current stream, then a host sync as a real step ends) alone vs. with every step
   publishing its encoder output (device->pinned copy on a side stream, then upload),
   interleaved repeats, ratio of medians. Goal <= 1.02x;
2. host->device load of a staged blob: the worker's ``load_slot`` (pageable->pinned,
   ``non_blocking`` copy on a side stream, the current stream waits on an event) vs a
   plain ``tensor.to(device)`` of the same mapped file: time until the call returns
   (what the step pays) and until the data is on the device;
3. no default-stream sync: ``torch.cuda.set_sync_debug_mode("error")`` around each
   ec-s3 call site (the plain ``.to(device)`` is run the same way as a positive control:
   it must be flagged, else the check proves nothing);
4. bit-exact round trips, device tensor -> blob -> staging -> device, bf16/fp16/fp32 at
   1, 8, 32 MiB (random bit patterns, compared byte for byte).

Does not own: the upload's network cost (default: a stand-in store that writes each
blob into a ``StagingArea`` slot on /dev/shm, the file the consumer would map; with
``--endpoint-url`` or ``--embedded-s3`` the real ``S3Store``, and the consumer side then
fetches through the real ``ItemFetcher``), nor vLLM's own copies.

The device copies live in :mod:`ec_s3.transfer.device` (vLLM-free, what the worker and
the publisher call), so this script imports the connector's own code. If S3 client
libraries are missing, the S3 side (``ec_s3.store.client``, ``ec_s3.transfer.fetcher``)
cannot be imported: the missing modules are then replaced by inert stand-ins, said so
in the output, and only the /dev/shm store is used.

Without CUDA (or with ``--dry-run-cpu``) the same script runs every step on the CPU:
the CUDA branches of ec-s3 are not exercised and the timings mean nothing; the output
says so. Exit status: 0 ok, 1 a correctness failure (round trip, publish, a sync in
an ec-s3 call site), 2 a check could not run or proved nothing.

    python -m bench.gpu_check --quick           # on the GPU host, < 3 min
    python -m bench.gpu_check --dry-run-cpu     # anywhere: same paths on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import logging
import os
import secrets
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import benchlib as bl

REPO = bl.REPO
DATA_PATH = (
    "ec_s3.config", "ec_s3.loop", "ec_s3.blob.codec", "ec_s3.transfer.counters", "ec_s3.transfer.staging",
    "ec_s3.transfer.device",
    "ec_s3.store.client", "ec_s3.transfer.publisher", "ec_s3.transfer.fetcher",
)
# What --simulate-bare-host hides: vLLM and every third-party module the store needs.
BARE_HOST_HIDDEN = ("vllm", "aioboto3", "aiobotocore", "botocore", "boto3", "aiohttp", "aiofiles", "obstore")
NAMESPACE = "gpu-check"
WIDTH = 4096
STEP_GOAL = 1.02


# --------------------------------------------------------------------------- imports


def _stub_module(name: str) -> types.ModuleType:
    """An inert stand-in for a missing third-party module. What ec-s3 touches at import
    time is exception types (``except`` tuples) and submodules (``from botocore import
    exceptions``): a capitalised attribute is a new exception class, any other a stub
    submodule. Nothing of it works when called; only the /dev/shm store runs then."""
    mod = types.ModuleType(name, f"gpu_check stand-in for the missing module {name!r}")
    mod.__path__ = []  # a package, so "import name.sub" asks for name.sub (stubbed in turn)
    made: dict[str, Any] = {}

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in made:
            if attr[:1].isupper():
                made[attr] = type(attr, (Exception,), {"__module__": name})
            else:
                made[attr] = sys.modules.setdefault(f"{name}.{attr}", _stub_module(f"{name}.{attr}"))
        return made[attr]

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def import_data_path() -> dict[str, Any]:
    """Import the vLLM-free data path, standing in for missing third-party modules.

    Returns what happened: which modules were stubbed and whether vLLM got imported.
    """
    stubbed: list[str] = []
    for _ in range(32):
        try:
            for name in DATA_PATH:
                importlib.import_module(name)
            break
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if not missing or missing.split(".")[0] in ("ec_s3", "torch") or missing in stubbed:
                raise
            parts = missing.split(".")
            for i in range(1, len(parts) + 1):  # the module and any missing parent package
                name = ".".join(parts[:i])
                if sys.modules.get(name) is None:
                    sys.modules[name] = _stub_module(name)
                    stubbed.append(name)
                    if i > 1:
                        setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], sys.modules[name])
    else:
        raise RuntimeError(f"could not import the data path; stubbed so far: {stubbed}")
    return {"stubbed_modules": stubbed, "vllm_imported": sys.modules.get("vllm") is not None}


def hide_modules(names: tuple[str, ...]) -> None:
    """Make ``import <name>`` fail as on a host without it (``None`` in sys.modules)."""
    for name in names:
        for loaded in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[loaded]
        sys.modules[name] = None  # type: ignore[assignment]


def device_loader() -> Any:
    """The worker's own load code (:class:`ec_s3.transfer.device.DeviceLoader`, what
    ``ECS3Worker`` calls), fresh: its first CUDA load creates the side stream."""
    from ec_s3.transfer.device import DeviceLoader

    return DeviceLoader()


# --------------------------------------------------------------------------- device helpers


@dataclasses.dataclass
class Device:
    torch: Any
    dev: Any  # torch.device
    cuda: bool

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def describe(self) -> str:
        if not self.cuda:
            return "cpu"
        props = self.torch.cuda.get_device_properties(self.dev)
        return f"{props.name} ({props.total_memory / bl.GiB:.0f} GiB), torch {self.torch.__version__}, CUDA {self.torch.version.cuda}"


def random_tensor(d: Device, dtype: Any, size_mib: int) -> Any:
    """``size_mib`` MiB of random bit patterns (NaNs, infinities and subnormals
    included) as a (rows, WIDTH) tensor of ``dtype`` on the device."""
    torch = d.torch
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = size_mib * bl.MiB // (WIDTH * itemsize)
    raw = torch.randint(0, 256, (rows * WIDTH * itemsize,), dtype=torch.uint8, device=d.dev)
    return raw.view(dtype).reshape(rows, WIDTH)


def bytes_equal(torch: Any, a: Any, b: Any) -> bool:
    """Bit-exact equality (``torch.equal`` on the raw bytes: NaN == NaN here)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# --------------------------------------------------------------------------- stores


class ShmStore:
    """What ``BlobPublisher`` needs of ``S3Store`` (``background``, ``put_async``,
    ``breaker``), writing each blob into a ``StagingArea`` slot instead of the network:
    the file a consumer on this host would map. Writes use ``os.pwrite`` (which releases
    the GIL, as a socket send does), on the loop thread."""

    def __init__(self, staging: Any, loop: Any, put_outcome: Any) -> None:
        self.staging = staging
        self.background = loop
        self.breaker = types.SimpleNamespace(is_open=False)
        self.slots: dict[str, Any] = {}
        self._created = put_outcome.CREATED
        self._exists = put_outcome.ALREADY_EXISTS

    async def put_async(self, key: str, body: Any, *, metadata: dict[str, str] | None = None) -> Any:
        from ec_s3.store.body import BufferChain
        from ec_s3.store.errors import StoreUnavailable

        if key in self.slots:
            return self._exists
        views = body.views if isinstance(body, BufferChain) else [memoryview(body).cast("B")]
        nbytes = sum(len(v) for v in views)
        slot = self.staging.allocate(hashlib.sha256(key.encode()).hexdigest()[:40], nbytes)
        if slot is None:
            raise StoreUnavailable("PUT", key, "stand-in staging area full")
        try:
            fd = os.open(slot.path, os.O_WRONLY)
            try:
                offset = 0
                for view in views:
                    done = 0
                    while done < len(view):
                        done += os.pwrite(fd, view[done:], offset + done)
                    offset += len(view)
            finally:
                os.close(fd)
        except BaseException:
            self.staging.discard(slot.name)
            raise
        self.staging.mark_ready(slot)
        self.slots[key] = slot
        return self._created

    def forget(self, key: str) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.staging.discard(slot.name)


@dataclasses.dataclass
class StagedItem:
    spec: Any  # what the worker's load_slot reads: path, nbytes, data_offset, dtype, shape
    slot: Any
    area: Any


class DataPath:
    """Publisher + store + consumer staging, as a producer and a consumer host use them."""

    def __init__(self, d: Device, store_kind: str, staging_root: str, endpoint: bl.Endpoint | None) -> None:
        from ec_s3.config import ECS3Config
        from ec_s3.loop import BackgroundLoop
        from ec_s3.store.errors import PutOutcome
        from ec_s3.transfer.counters import Counters
        from ec_s3.transfer.staging import StagingArea

        self.d = d
        self.kind = store_kind
        self.counters = Counters()
        self.areas: list[Any] = []
        self.fetcher: Any = None
        self.fetch_area: Any = None
        if store_kind == "s3":
            from ec_s3.store.client import S3Store
            from ec_s3.transfer.fetcher import ItemFetcher

            assert endpoint is not None
            bucket = bl.create_bucket(endpoint)
            self.config = endpoint.config(bucket, max_inflight_bytes=1 * bl.GiB)
            self.store: Any = S3Store(self.config)
            self.fetch_area = self._area(StagingArea, staging_root)
            self.fetcher = ItemFetcher(self.store, self.fetch_area, self.counters)
        else:
            self.config = ECS3Config.from_extra_config({"bucket": "gpu-check", "max_inflight_bytes": 1 * bl.GiB}, environ={})
            self.loop = BackgroundLoop("gpu-check-io")
            self.store = ShmStore(self._area(StagingArea, staging_root), self.loop, PutOutcome)
        self.publisher = self.new_publisher()

    def _area(self, cls: Any, root: str) -> Any:
        area = cls(root, 512 * bl.MiB)
        self.areas.append(area)
        return area

    def new_publisher(self) -> Any:
        from ec_s3.transfer.publisher import BlobPublisher

        return BlobPublisher(self.store, self.config, namespace=NAMESPACE, producer="gpu-check", counters=self.counters)

    def expectation(self, ident: str, tensor: Any) -> Any:
        from ec_s3.blob.codec import BlobExpectation

        return BlobExpectation(
            identifier=ident, namespace=NAMESPACE, dtype=tensor.dtype, rows=tensor.shape[0],
            width=tensor.shape[1], max_bytes=self.config.max_blob_bytes,
        )

    def publish_and_stage(self, ident: str, tensor: Any, publisher: Any = None) -> StagedItem:
        """Publish ``tensor`` (as ``save_caches`` does), wait for the upload, then stage
        the blob as the consumer's scheduler would and return what a worker gets."""
        pub = publisher or self.publisher
        key = f"{NAMESPACE}/{ident}.safetensors"
        failed0 = self.counters.get("upload_failed")
        if not pub.publish(ident, tensor, key):
            raise AssertionError(f"publish({ident}) returned False")
        if pub.flush(120) != 0:
            raise AssertionError(f"upload of {ident} did not finish in 120 s")
        if self.counters.get("upload_failed") != failed0:
            raise AssertionError(f"upload of {ident} failed (see the ec-s3 warning above)")
        expect = self.expectation(ident, tensor)
        return self._stage_s3(key, expect) if self.kind == "s3" else self._stage_shm(key, expect)

    def _stage_shm(self, key: str, expect: Any) -> StagedItem:
        """The stand-in's file is the staged blob: validate it as the fetcher does."""
        from ec_s3.blob.codec import decode_blob
        from ec_s3.transfer.staging import map_slot

        slot = self.store.slots[key]
        mm = map_slot(slot.path)
        try:
            buf = memoryview(mm)
            decoded = decode_blob(buf, expect)
            spec = types.SimpleNamespace(
                identifier=expect.identifier, path=slot.path, nbytes=slot.nbytes, data_offset=decoded.data_offset,
                dtype=str(decoded.tensor.dtype).removeprefix("torch."), shape=tuple(decoded.tensor.shape),
                handle=slot.handle, inode=slot.inode,
            )
            del decoded
            buf.release()
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
        area = self.store.staging
        area.pin(slot)
        return StagedItem(spec, slot, area)

    def _stage_s3(self, key: str, expect: Any) -> StagedItem:
        """The consumer scheduler's path: ``ItemFetcher`` GETs into a staging slot."""
        from ec_s3.transfer.fetcher import Staged

        self.fetcher.start(key, expect)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for got, result in self.fetcher.drain():
                if got != key:
                    continue
                if not isinstance(result, Staged):
                    raise AssertionError(f"fetch of {key}: {result}")
                self.fetch_area.pin(result.slot)
                spec = types.SimpleNamespace(
                    identifier=expect.identifier, path=result.slot.path, nbytes=result.slot.nbytes, data_offset=result.data_offset,
                    dtype=result.dtype, shape=result.shape, handle=result.slot.handle, inode=result.slot.inode,
                )
                return StagedItem(spec, result.slot, self.fetch_area)
            time.sleep(0.002)
        raise AssertionError(f"fetch of {key} did not finish in 60 s")

    def release(self, item: StagedItem) -> None:
        item.area.unpin(item.slot)
        item.area.discard(item.slot.name)
        if self.kind == "shm":
            self.store.slots = {k: s for k, s in self.store.slots.items() if s is not item.slot}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.publisher.flush(30)
        if self.kind == "s3":
            self.store.close(timeout=2)
        else:
            self.loop.stop()
        for area in self.areas:
            area.close()


# --------------------------------------------------------------------------- 4. round trips


def round_trips(d: Device, dp: DataPath, h2d: Any, sizes: list[int]) -> list[dict[str, Any]]:
    torch = d.torch
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for size in sizes:
            name = str(dtype).removeprefix("torch.")
            ident = f"rt-{name}-{size}-{secrets.token_hex(4)}"
            row: dict[str, Any] = {"dtype": name, "size_mib": size}
            try:
                src = random_tensor(d, dtype, size)
                item = dp.publish_and_stage(ident, src)
                try:
                    out = h2d.load_slot(item.spec, d.dev)
                    d.sync()
                    row["device"] = str(out.device)
                    row["bit_exact"] = bytes_equal(torch, out, src)
                finally:
                    dp.release(item)
            except Exception as exc:  # noqa: BLE001 - reported as a failed round trip
                row["bit_exact"] = False
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            bl.log(f"round trip {row['dtype']} {size} MiB: {'ok' if row['bit_exact'] else 'FAILED ' + row.get('error', '')}")
    return rows


# --------------------------------------------------------------------------- 3. sync checks


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _under_sync_error(d: Device, fn: Callable[[], Any]) -> tuple[Any, str | None, list[str]]:
    """Run ``fn`` with CUDA sync debugging set to raise; returns (value, error, ec-s3 warnings)."""
    from ec_s3.log import logger

    captured = _Captured()
    logger.addHandler(captured)
    d.torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(), None, captured.messages
    except RuntimeError as exc:
        return None, str(exc).splitlines()[0], captured.messages
    finally:
        d.torch.cuda.set_sync_debug_mode("default")
        logger.removeHandler(captured)


def sync_checks(d: Device, dp: DataPath, h2d: Any) -> list[dict[str, Any]]:
    if not d.cuda:
        return [{"site": s, "result": "n/a (no CUDA)", "ok": None}
                for s in ("BlobPublisher.publish (cold)", "BlobPublisher.publish (warm)", "worker load_slot",
                          "control: tensor.to(device) from pageable")]
    torch = d.torch
    out: list[dict[str, Any]] = []
    pub = dp.new_publisher()  # fresh: its first call also creates the side stream
    for label in ("cold", "warm"):
        src = random_tensor(d, torch.bfloat16, 8)
        ident = f"sync-{label}-{secrets.token_hex(4)}"
        key = f"{NAMESPACE}/{ident}.safetensors"
        failed0 = dp.counters.get("upload_failed")
        accepted, err, warned = _under_sync_error(d, lambda: pub.publish(ident, src, key))  # noqa: B023
        pub.flush(60)
        failed = dp.counters.get("upload_failed") != failed0
        ok = err is None and bool(accepted) and not warned and not failed
        detail = err or ("; ".join(warned) if warned else "") or ("upload failed" if failed else "")
        out.append({"site": f"BlobPublisher.publish ({label})", "ok": ok,
                    "result": "pass" if ok else f"FAIL: {detail or 'publish returned False'}"})
        if dp.kind == "shm":
            dp.store.forget(key)
    src = random_tensor(d, torch.bfloat16, 8)
    item = dp.publish_and_stage(f"sync-load-{secrets.token_hex(4)}", src)
    try:
        loaded, err, _ = _under_sync_error(d, lambda: h2d.load_slot(item.spec, d.dev))
        d.sync()
        exact = loaded is not None and bytes_equal(torch, loaded, src)
        ok = err is None and exact
        out.append({"site": "worker load_slot", "ok": ok,
                    "result": "pass" if ok else f"FAIL: {err or 'wrong tensor'}"})
        _, err, _ = _under_sync_error(d, lambda: _plain_load(d, item.spec))
        out.append({"site": "control: tensor.to(device) from pageable", "ok": None, "control_flagged": err is not None,
                    "result": "flagged (expected: the check works)" if err else "NOT flagged: sync debugging is inert here"})
    finally:
        dp.release(item)
    return out


# --------------------------------------------------------------------------- 2. host->device


def _plain_load(d: Device, spec: Any) -> Any:
    """The baseline: map the same staged file and ``.to(device)`` (pageable source)."""
    from ec_s3.transfer.staging import map_slot

    torch = d.torch
    mm = map_slot(spec.path)
    try:
        host = torch.frombuffer(mm, dtype=torch.uint8, count=spec.nbytes - spec.data_offset, offset=spec.data_offset)
        host = host.view(getattr(torch, spec.dtype)).reshape(spec.shape)
        return host.to(d.dev, copy=True)  # copy=True: on the CPU dry run .to("cpu") would be a no-op
    finally:
        with contextlib.suppress(BufferError):
            mm.close()


def h2d_loads(d: Device, dp: DataPath, h2d: Any, sizes: list[int], samples: int) -> list[dict[str, Any]]:
    torch = d.torch
    rows = []
    for size in sizes:
        src = random_tensor(d, torch.bfloat16, size)
        item = dp.publish_and_stage(f"h2d-{size}-{secrets.token_hex(4)}", src)
        variants: dict[str, Callable[[], Any]] = {
            "worker": lambda: h2d.load_slot(item.spec, d.dev),  # noqa: B023
            "plain": lambda: _plain_load(d, item.spec),  # noqa: B023
        }
        call: dict[str, list[float]] = {k: [] for k in variants}
        ready: dict[str, list[float]] = {k: [] for k in variants}
        try:
            for name, fn in variants.items():  # warm-up: pinned host cache, side stream
                fn()
            for i in range(samples):
                for name in (("worker", "plain") if i % 2 == 0 else ("plain", "worker")):
                    d.sync()
                    t0 = time.perf_counter()
                    got = variants[name]()
                    t1 = time.perf_counter()
                    d.sync()
                    t2 = time.perf_counter()
                    call[name].append(t1 - t0)
                    ready[name].append(t2 - t0)
                    del got
        finally:
            dp.release(item)
        row = {
            "size_mib": size,
            "worker_call_s": bl.summary(call["worker"]), "worker_ready_s": bl.summary(ready["worker"]),
            "plain_call_s": bl.summary(call["plain"]), "plain_ready_s": bl.summary(ready["plain"]),
            "call_ratio": bl.ratio_summary(call["worker"], call["plain"]),
            "ready_ratio": bl.ratio_summary(ready["worker"], ready["plain"]),
        }
        rows.append(row)
        bl.log(f"H2D {size} MiB: worker call {row['worker_call_s']['median'] * 1e3:.2f} ms, ready "
               f"{row['worker_ready_s']['median'] * 1e3:.2f} ms; plain .to() {row['plain_ready_s']['median'] * 1e3:.2f} ms")
    return rows


# --------------------------------------------------------------------------- 1. step slowdown


class StepLoop:
    """A stand-in model step: make this step's encoder output (a fresh tensor), hand it
    to ``publish`` if given (where ``save_caches`` runs), run ``n_mm`` matmuls on the
    current stream, then wait for them (a real step ends by reading sampled tokens)."""

    def __init__(self, d: Device, step_ms: float) -> None:
        torch = d.torch
        self.d = d
        n, dtype = (4096, torch.bfloat16) if d.cuda else (256, torch.float32)
        self.a = torch.randn(n, n, device=d.dev).to(dtype)
        self.b = torch.randn(n, n, device=d.dev).to(dtype)
        self.c = torch.empty_like(self.a)
        self.n_mm = 1
        self._mm(5)
        d.sync()
        batches = []
        for _ in range(3):  # the least disturbed of three batches
            t0 = time.perf_counter()
            self._mm(10)
            d.sync()
            batches.append((time.perf_counter() - t0) / 10)
        self.mm_s = min(batches)
        self.n_mm = max(1, round(step_ms / 1e3 / self.mm_s))

    def _mm(self, n: int) -> None:
        for _ in range(n):
            self.d.torch.mm(self.a, self.b, out=self.c)

    def step(self, encoder_source: Any, publish: Callable[[Any], None] | None) -> float:
        t0 = time.perf_counter()
        encoder_output = encoder_source.mul(1.0)
        if publish is not None:
            publish(encoder_output)
        del encoder_output
        self._mm(self.n_mm)
        self.d.sync()
        return time.perf_counter() - t0


def step_slowdown(d: Device, dp: DataPath, loop: StepLoop, size: int, reps: int, steps: int) -> dict[str, Any]:
    torch = d.torch
    source = torch.randn(size * bl.MiB // (WIDTH * 2), WIDTH, device=d.dev).to(torch.bfloat16)
    pub = dp.publisher
    tag = secrets.token_hex(3)
    seq = [0]
    keys: list[str] = []

    def publish(tensor: Any) -> None:
        seq[0] += 1
        ident = f"step-{size}-{tag}-{seq[0]}"
        key = f"{NAMESPACE}/{ident}.safetensors"
        keys.append(key)
        pub.publish(ident, tensor, key)

    c0 = dp.counters.snapshot()
    alone: list[float] = []
    busy: list[float] = []
    per_rep: list[float] = []
    for r in range(reps):
        times: dict[str, list[float]] = {}
        for phase in (("alone", "busy") if r % 2 == 0 else ("busy", "alone")):
            pub.flush(300)  # nothing of the previous phase still in flight
            if dp.kind == "shm":
                for key in keys:
                    dp.store.forget(key)
                keys.clear()
            fn = publish if phase == "busy" else None
            loop.step(source, fn)  # warm-up, not counted
            times[phase] = [loop.step(source, fn) for _ in range(steps)]
        alone += times["alone"]
        busy += times["busy"]
        per_rep.append(statistics.median(times["busy"]) / statistics.median(times["alone"]))
    pub.flush(300)
    c1 = dp.counters.snapshot()
    delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("blobs_uploaded", "upload_failed", "upload_dropped",
                                                       "save_blocked_seconds")}
    ratio = statistics.median(busy) / statistics.median(alone)
    bl.log(f"step {size} MiB/step: alone {statistics.median(alone) * 1e3:.2f} ms, publishing "
           f"{statistics.median(busy) * 1e3:.2f} ms -> {ratio:.4f}x")
    return {
        "size_mib": size, "reps": reps, "steps_per_phase": steps, "matmuls_per_step": loop.n_mm,
        "alone_s": bl.summary(alone), "busy_s": bl.summary(busy),
        "ratio": ratio, "ratio_min": min(per_rep), "ratio_max": max(per_rep), "per_rep_ratios": per_rep,
        "publish_mib_per_s": size / statistics.median(busy), "counters": delta,
    }


# --------------------------------------------------------------------------- main


def staging_root(min_free: int) -> tuple[str, str]:
    """/dev/shm when it has room (containers often give it 64 MiB), else a temp dir."""
    for root in ("/dev/shm", tempfile.gettempdir()):
        with contextlib.suppress(OSError):
            st = os.statvfs(root)
            if os.access(root, os.W_OK) and st.f_bavail * st.f_frsize >= min_free:
                return root, "tmpfs" if root == "/dev/shm" else "disk (no room on /dev/shm)"
    return tempfile.gettempdir(), "disk"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    parser.add_argument("--dry-run-cpu", action="store_true", help="run on the CPU even if CUDA is there (timings meaningless)")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=None, help="interleaved alone/publishing repeats per size")
    parser.add_argument("--steps", type=int, default=None, help="steps per phase")
    parser.add_argument("--step-ms", type=float, default=None, help="target step time alone (default 20 on GPU, 10 on CPU)")
    parser.add_argument("--samples", type=int, default=None, help="host->device load samples per size and variant")
    parser.add_argument("--endpoint-url", default=None,
                        help="upload to this S3 endpoint (keys: EC_S3_BENCH_ACCESS_KEY_ID/SECRET_ACCESS_KEY) instead of /dev/shm")
    parser.add_argument("--embedded-s3", action="store_true", help="start a SeaweedFS (benchlib) and upload there")
    parser.add_argument("--simulate-bare-host", action="store_true",
                        help=f"hide {', '.join(BARE_HOST_HIDDEN)} first, as on the GPU host (to test this script)")
    args = parser.parse_args()
    started = time.monotonic()
    q = args.quick
    reps = args.reps or (3 if q else 5)
    steps = args.steps or (15 if q else 30)
    samples = args.samples or (8 if q else 20)

    if args.simulate_bare_host:
        hide_modules(BARE_HOST_HIDDEN)
    imports = import_data_path()
    if imports["stubbed_modules"]:
        bl.log(f"missing here, replaced by inert stand-ins: {', '.join(imports['stubbed_modules'])} "
               "(only the /dev/shm store can run)")
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run_cpu
    d = Device(torch, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), cuda)
    mode_note = "CUDA" if cuda else ("CPU dry run (--dry-run-cpu)" if args.dry_run_cpu else "CPU fallback (no CUDA)")
    if not cuda:
        bl.log(f"{mode_note}: ec-s3's CUDA branches are NOT exercised and timings mean nothing")
        torch.set_num_threads(1)  # OpenMP threads spinning on a shared host make a CPU run crawl
    torch.manual_seed(0)

    store_kind = "s3" if (args.endpoint_url or args.embedded_s3) else "shm"
    if store_kind == "s3" and imports["stubbed_modules"]:
        raise SystemExit(f"--endpoint-url/--embedded-s3 need the S3 client libraries ({imports['stubbed_modules']} missing)")
    root, root_kind = staging_root(1 * bl.GiB)
    failed = unavailable = False  # exit 1 / exit 2
    problems: list[str] = []
    result: dict[str, Any] = {
        "mode": mode_note, "device": d.describe(), "timings_meaningful": cuda, "store": store_kind,
        "staging_root": f"{root} ({root_kind})", "imports": imports,
        "params": {"sizes_mib": args.sizes_mib, "reps": reps, "steps": steps, "samples": samples, "quick": q},
    }
    name = "gpu_check" if cuda else "gpu_check_cpu"

    with contextlib.ExitStack() as stack:
        endpoint = None
        if args.endpoint_url:
            endpoint = bl.Endpoint(args.endpoint_url, os.environ.get("EC_S3_BENCH_ACCESS_KEY_ID", ""),
                                   os.environ.get("EC_S3_BENCH_SECRET_ACCESS_KEY", ""))
        elif args.embedded_s3:
            endpoint = stack.enter_context(bl.s3_endpoint("gpucheck"))
        dp = DataPath(d, store_kind, root, endpoint)
        stack.callback(dp.close)
        h2d = device_loader()
        result["h2d_code"] = "ec_s3/transfer/device.py: DeviceLoader.load_slot (ECS3Worker's load code)"
        result["round_trips"] = round_trips(d, dp, h2d, args.sizes_mib)
        result["sync_checks"] = sync_checks(d, dp, h2d)
        result["h2d"] = h2d_loads(d, dp, h2d, args.sizes_mib, samples)
        loop = StepLoop(d, args.step_ms or (20.0 if cuda else 10.0))
        result["step_loop"] = {"matmul_s": loop.mm_s, "matmuls_per_step": loop.n_mm}
        result["steps"] = [step_slowdown(d, dp, loop, s, reps, steps) for s in args.sizes_mib]
    result["elapsed_s"] = time.monotonic() - started

    rows: list[list[Any]] = []
    suffix = "" if cuda else " (CPU: meaningless)"
    for r in result.get("steps", []):
        rows.append([f"1. step time publishing / alone{suffix}", f"{r['size_mib']} MiB every step",
                     f"{r['ratio']:.4f}x [{r['ratio_min']:.3f}-{r['ratio_max']:.3f}] "
                     f"({r['busy_s']['median'] * 1e3:.2f} vs {r['alone_s']['median'] * 1e3:.2f} ms)"
                     + (f", saves blocked {r['counters']['save_blocked_seconds']:.2f} s"
                        if r["counters"]["save_blocked_seconds"] else ""),
                     f"<= {STEP_GOAL}x", "yes" if r["ratio"] <= STEP_GOAL else "NO"])
    for r in result.get("h2d", []):
        rows.append([f"2. H2D worker / plain .to(){suffix}", f"{r['size_mib']} MiB bf16",
                     f"call {r['call_ratio']['ratio']:.3f}x ({r['worker_call_s']['median'] * 1e3:.2f} ms), "
                     f"ready {r['ready_ratio']['ratio']:.3f}x ({r['worker_ready_s']['median'] * 1e3:.2f} vs "
                     f"{r['plain_ready_s']['median'] * 1e3:.2f} ms)", "-", ""])
    for r in result.get("sync_checks", []):
        rows.append(["3. no default-stream sync", r["site"], r["result"], "pass", "" if r["ok"] is None else
                     ("yes" if r["ok"] else "NO")])
        if r["ok"] is False:
            failed = True
            problems.append(f"sync in {r['site']}: {r['result']}")
        if r.get("control_flagged") is False:
            problems.append("sync-debug control was not flagged: the sync check proves nothing on this build")
            unavailable = True
    for r in result.get("round_trips", []):
        rows.append(["4. bit-exact round trip", f"{r['dtype']} {r['size_mib']} MiB",
                     "equal" if r["bit_exact"] else f"DIFFERENT {r.get('error', '')}", "equal",
                     "yes" if r["bit_exact"] else "NO"])
        if not r["bit_exact"]:
            failed = True
            problems.append(f"round trip {r['dtype']} {r['size_mib']} MiB: {r.get('error', 'bytes differ')}")
    exit_code = 1 if failed else 2 if unavailable else 0
    result["problems"] = problems
    result["exit_code"] = exit_code
    print(bl.table(["check", "case", "result", "goal", "met"], rows,
                   title=f"GPU path check: {mode_note}, {d.describe()}, store {store_kind}, "
                         f"{result['elapsed_s']:.0f} s"))
    if not cuda:
        print("\nCPU run: ec-s3's CUDA branches (pinned copy, side streams, events) were not exercised; "
              "the timings mean nothing. Run on a CUDA host for the real check.")
    if imports["stubbed_modules"]:
        print(f"\nS3 client libraries missing ({', '.join(imports['stubbed_modules'])}): uploads went to /dev/shm.")
    print(f"\nimporting the data path imported vLLM: {imports['vllm_imported']}")
    for p in problems:
        print(f"PROBLEM: {p}")
    bl.write_json(name, result, args.out_dir)
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
