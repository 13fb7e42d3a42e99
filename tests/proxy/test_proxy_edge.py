"""The proxy at the edge (issue 33): no slot, byte or socket a client can hold, and memory
bounded under any input.

Real sockets on loopback play the slow and hostile clients (slow bodies, half-sent heads,
compressed bombs, bytes that are not UTF-8); the upstreams are the fakes of
tests/proxy/test_proxy.py. Times are asserted only where time is the property, with wide
margins.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import zlib
from collections.abc import Iterator

import pytest

from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.limits import BODY_COST_FACTOR, ByteBudget, NoRoom
from test_proxy import FakePD, Rig, chat, image, rig, run
from test_proxy_limits import error_of

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


# --------------------------------------------------------------------------- helpers
async def open_raw(r: Rig) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", r.proxy.port)


def head(length: int | None = None, **headers: str) -> bytes:
    """The head of a chat request; with ``length`` its Content-Length."""
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: proxy", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def answer_of(reader: asyncio.StreamReader, timeout: float) -> tuple[int, bytes]:
    """Status and body of the answer on a raw connection (0, b"" when it was closed
    with no answer)."""
    async with asyncio.timeout(timeout):
        try:
            head_bytes = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return 0, b""
            raise
        length = 0
        for line in head_bytes.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(head_bytes.split()[1]), await reader.readexactly(length)


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    try:
        await asyncio.wait_for(reader.read(), timeout)
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def trickle(writer: asyncio.StreamWriter, every: float) -> None:
    """One byte of body every ``every`` seconds, until the proxy hangs up."""
    with contextlib.suppress(ConnectionError, OSError):
        while not writer.is_closing():
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(every)


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def rss_peak() -> Iterator[dict[str, int]]:
    """The process's RSS before and its peak during the block, sampled every 5 ms."""
    out = {"before": rss_bytes(), "peak": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            out["peak"] = max(out["peak"], rss_bytes())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out["peak"] = max(out["peak"], rss_bytes())


# --------------------------------------------------------------------------- 1. slow bodies
def test_slow_bodies_take_no_slot_and_are_cut_at_the_body_deadline() -> None:
    """Six clients trickling bodies into a proxy with two slots: normal requests are
    served meanwhile, and every slow one gets a 408 once body_timeout_s has passed."""
    async def scenario() -> None:
        async with rig(max_in_flight=2, body_timeout_s=1.0) as r:
            slow = [await open_raw(r) for _ in range(6)]
            trickles = []
            for _, writer in slow:
                writer.write(head(length=10_000) + b"{")
                trickles.append(asyncio.create_task(trickle(writer, 0.2)))
            await asyncio.sleep(0.3)
            for i in range(3):
                status, body, _ = await r.post(chat(image(i)))
                assert status == 200, body
            started = time.monotonic()
            answers = await asyncio.gather(*(answer_of(reader, 10) for reader, _ in slow))
            assert time.monotonic() - started < 5
            for status, body in answers:
                assert status == 408 and error_of(408, body)["type"] == "RequestTimeout"
            # ... and their connections are closed soon after, although bytes keep coming.
            assert all(await asyncio.gather(*(closed_within(reader, 10) for reader, _ in slow)))
            for task in trickles:
                task.cancel()
            assert r.metric("ec_s3_proxy_rejected_total", reason="body_timeout") == 6
            assert r.metric("ec_s3_proxy_requests_in_flight") == 0
            assert r.proxy.budget.used == 0
            for _, writer in slow:
                writer.close()

    run(scenario())


# --------------------------------------------------------------------------- 7. slowloris
def test_half_sent_heads_are_cut_and_connections_are_capped() -> None:
    async def scenario() -> None:
        async with rig(header_timeout_s=0.5, max_connections=20) as r:
            loris = [await open_raw(r) for _ in range(20)]
            for _, writer in loris:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n")
            await asyncio.sleep(0.1)
            # Beyond the cap: a 503 in JSON, at once.
            reader, writer = await open_raw(r)
            status, body = await answer_of(reader, 2)
            assert status == 503 and error_of(503, body)["type"] == "ServiceUnavailable"
            writer.close()
            # Every half-sent head is cut at the head deadline, although bytes keep coming.
            for _, w in loris:
                w.write(b"X-Slow: 1\r\n")
            results = await asyncio.gather(*(closed_within(rd, 5) for rd, _ in loris))
            assert all(results), results
            for _, w in loris:
                w.close()
            # ... and the slots are free again.
            status, _, _ = await r.post(chat(image(1)))
            assert status == 200
            await asyncio.sleep(0.1)
            site = r.proxy._site
            assert site is not None and site.open <= 1

    run(scenario())


def test_a_burst_the_loop_has_not_accepted_yet_waits_in_the_kernels_queue() -> None:
    """While the proxy's loop is busy (here: the process stopped), a burst of 400
    connections completes its handshakes in the kernel's accept queue, sized to
    ``max_connections``. With aiohttp's default of 128 the rest lost their SYNs and
    retried 1, 3, 7 s later: the 1,000-request test's /health probe once timed out."""
    import signal
    import socket

    from test_proxy import proxy_process

    n = 400
    with open("/proc/sys/net/core/somaxconn") as f:
        if int(f.read()) < n:
            pytest.skip("net.core.somaxconn caps every listen queue below the burst")

    async def scenario() -> None:
        async with proxy_process(FakePD("pd0")) as (proc, url, _):
            port = int(url.rsplit(":", 1)[1])
            socks: list[socket.socket] = []
            proc.send_signal(signal.SIGSTOP)
            try:
                for _ in range(n):
                    sock = socket.socket()
                    sock.setblocking(False)
                    socks.append(sock)
                    sock.connect_ex(("127.0.0.1", port))
                await asyncio.sleep(0.5)  # under the first SYN retry (1 s)
                established = 0
                for sock in socks:
                    with contextlib.suppress(OSError):  # ENOTCONN: its SYN was dropped
                        sock.getpeername()
                        established += 1
            finally:
                proc.send_signal(signal.SIGCONT)
                for sock in socks:
                    sock.close()
            assert established == n, f"{established} of {n} handshakes completed"

    run(scenario())


# --------------------------------------------------------------------------- 2. compressed bodies
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_are_refused_without_being_inflated(encoding: str) -> None:
    """A body of 512 MiB of zeros, compressed to ~0.5 MB: refused with a JSON 415 before
    anything is inflated; the process's memory does not move."""
    wbits = 31 if encoding == "gzip" else 15
    comp = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = bytes(MiB)
    bomb = b"".join(comp.compress(zeros) for _ in range(512)) + comp.flush()

    async def scenario() -> None:
        async with rig() as r:
            url = f"{r.url}/v1/chat/completions"
            with rss_peak() as rss:
                async with r.session.post(url, data=bomb, headers={
                        "Content-Type": "application/json", "Content-Encoding": encoding}) as resp:
                    body = await resp.read()
                    assert resp.status == 415, (resp.status, body[:200])
                    assert encoding in error_of(415, body)["message"]
                await asyncio.sleep(0.5)  # what aiohttp would have inflated after the answer
            print(f"\n{encoding} bomb of {len(bomb) >> 10} KiB: RSS {rss['before'] >> 20} -> "
                  f"peak {rss['peak'] >> 20} MiB")
            assert rss["peak"] - rss["before"] < 64 * MiB, rss
            assert r.pds[0].bodies == []
            # An identity encoding is no encoding.
            status, _, _ = await r.post(chat(), headers={"Content-Encoding": "identity"})
            assert status == 200

    run(scenario())


# --------------------------------------------------------------------------- 3. byte budget
def test_bodies_in_flight_share_one_byte_budget() -> None:
    """A budget with room for one 3 MB body: three sent at once reach prefill/decode one
    after the other; the budget is all given back, and past the deadline a body that
    found no room gets a JSON 503."""
    async def scenario() -> None:
        body = chat(image("big", extra="x" * (3 * MiB)))
        pd = FakePD("pd0", delay=0.3)
        async with rig(pds=[pd], max_body_bytes=4 * MiB, body_budget_bytes=BODY_COST_FACTOR * 4 * MiB) as r:
            statuses = await asyncio.gather(*(r.post(body) for _ in range(3)))
            assert [s for s, _, _ in statuses] == [200, 200, 200]
            assert pd.gauge.peak == 1
            assert r.proxy.budget.used == 0
        pd = FakePD("pd0", delay=2.0)
        async with rig(pds=[pd], max_body_bytes=4 * MiB, body_budget_bytes=BODY_COST_FACTOR * 4 * MiB,
                       body_timeout_s=0.5) as r:
            answers = await asyncio.gather(*(r.post(body) for _ in range(2)))
            assert sorted(s for s, _, _ in answers) == [200, 503]
            ((_, refused, headers),) = [a for a in answers if a[0] == 503]
            assert error_of(503, refused)["type"] == "ServiceUnavailable" and headers["Retry-After"]
            assert r.proxy.budget.used == 0

    run(scenario())


def test_byte_budget_is_given_back_on_every_exit() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        budget = ByteBudget(100)
        async with budget.hold(60, loop.time() + 1) as res:
            res.shrink(40)
            assert budget.used == 40
            with pytest.raises(NoRoom):
                async with budget.hold(70, loop.time() + 0.05):
                    pass
            waiter = asyncio.create_task(budget.hold(70, loop.time() + 5).__aenter__())
            await asyncio.sleep(0.01)
            waiter.cancel()  # a client that leaves while waiting holds nothing
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        assert budget.used == 0
        with pytest.raises(RuntimeError):
            async with budget.hold(100, loop.time() + 1):
                raise RuntimeError("handler failed")
        assert budget.used == 0
        with pytest.raises(ValueError, match="never fit"):
            async with budget.hold(101, loop.time() + 1):
                pass

    run(scenario())


# --------------------------------------------------------------------------- 4. upstream deadlines
def test_a_silent_prefill_decode_is_cut_at_the_read_timeout() -> None:
    async def scenario() -> None:
        assert ProxyConfig(encoder_urls=[], pd_urls=["http://pd:1"]).read_timeout_s is not None  # on by default
        never = asyncio.Event()
        hangs = FakePD("hangs", chunks=3, gate_after_first=never)
        async with rig(pds=[hangs], read_timeout_s=0.5) as r:
            started = time.monotonic()
            status, body, _ = await r.post(chat(image(1), stream=True))
            assert time.monotonic() - started < 5
            assert status == 200
            events = [json.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
            assert events[0]["choices"][0]["delta"]["content"] == "tok0 "
            assert events[-1]["error"]["code"] == 502 and "timeout" in events[-1]["error"]["message"]
            assert r.metric("ec_s3_proxy_requests_in_flight") == 0
        async with rig(pds=[FakePD("silent", delay=30)], read_timeout_s=0.5) as r:
            started = time.monotonic()
            status, body, _ = await r.post(chat(image(1)))
            assert time.monotonic() - started < 5
            assert status == 504 and error_of(504, body)["type"] == "GatewayTimeout"
            assert r.metric("ec_s3_proxy_requests_in_flight") == 0

    run(scenario())


def test_a_client_that_reads_nothing_of_its_stream_is_cut_off() -> None:
    """A client that asks for a stream of 64 MB and reads none of it: cut off once it has
    accepted nothing for send_timeout_s; its slot and bytes are freed and the prefill/decode
    request aborted."""
    async def scenario() -> None:
        pd = FakePD("pd0", chunks=64, pad_bytes=MiB)
        async with rig(pds=[pd], send_timeout_s=0.5) as r:
            reader, writer = await open_raw(r)
            raw = json.dumps(chat(stream=True)).encode()
            writer.write(head(length=len(raw)) + raw)
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # then reads nothing more
            await asyncio.wait_for(pd.aborted.wait(), 10)
            assert r.metric("ec_s3_proxy_client_disconnects_total") == 1
            assert r.metric("ec_s3_proxy_requests_in_flight") == 0 and r.proxy.budget.used == 0
            writer.close()

    run(scenario())


# --------------------------------------------------------------------------- 6. no 500 for a client's input
def test_a_key_that_is_not_utf8_is_a_401() -> None:
    async def scenario() -> None:
        async with rig(api_key="client-secret") as r:
            reader, writer = await open_raw(r)
            raw = json.dumps(chat()).encode()
            writer.write(head(length=len(raw)).replace(b"\r\n\r\n", b"\r\nAuthorization: Bearer \xff\xfe\xc3\r\n\r\n")
                         + raw)
            status, body = await answer_of(reader, 5)
            writer.close()
            assert status == 401 and error_of(401, body)["type"] == "AuthenticationError"
            assert r.metric("ec_s3_proxy_internal_errors_total") == 0

    run(scenario())


@pytest.mark.parametrize("dispatch", ["serial", "parallel"])
def test_kwargs_nested_just_within_the_parsers_limit_are_a_400(dispatch: str) -> None:
    """From nesting the parser refuses down to nesting every step takes, each twice (a
    repeat is looked up as known, where the key's JSON nests deeper than the parse did):
    400 or 200, never a 500 (main answered 500 at a few depths just below the limit)."""
    import sys

    def nested(depth: int) -> bytes:
        body = json.dumps(chat(image(1), mm_processor_kwargs={"k": "@"}))
        return body.replace('"@"', "[" * depth + "]" * depth).encode()

    async def scenario() -> None:
        async with rig(dispatch=dispatch) as r:
            statuses: dict[int, int] = {}
            depth, ok_in_a_row, forwarded = sys.getrecursionlimit() + 20, 0, 0
            while ok_in_a_row < 20:
                for _ in (0, 1):
                    before = len(r.pds[0].bodies)
                    async with r.session.post(f"{r.url}/v1/chat/completions", data=nested(depth),
                                              headers={"Content-Type": "application/json"}) as resp:
                        body = await resp.read()
                        statuses[resp.status] = statuses.get(resp.status, 0) + 1
                        assert resp.status in (200, 400), (depth, resp.status, body[:300])
                        if resp.status == 400:
                            assert error_of(400, body)["type"] == "BadRequestError"
                # Passed by the proxy: vLLM itself refuses nested kwargs ("unhashable type").
                passed = len(r.pds[0].bodies) > before
                forwarded += passed
                ok_in_a_row = ok_in_a_row + 1 if passed else 0
                depth -= 1
            assert statuses.get(400) and forwarded, statuses
            assert r.metric("ec_s3_proxy_internal_errors_total") == 0

    run(scenario())


# --------------------------------------------------------------------------- 5. /health
def test_health_is_cached_and_a_flood_costs_one_probe() -> None:
    async def scenario() -> None:
        pd = FakePD("pd0", health_delay=0.2)
        async with rig(pds=[pd]) as r:
            async def health() -> int:
                async with r.session.get(f"{r.url}/health") as resp:
                    return resp.status

            statuses = await asyncio.gather(*(health() for _ in range(200)))
            assert set(statuses) == {200}
            assert pd.health_calls == 1
            assert await health() == 200 and pd.health_calls == 1  # cached
        async with rig(pds=[pd], health_cache_s=0) as r:
            before = pd.health_calls
            for _ in range(3):
                async with r.session.get(f"{r.url}/health") as resp:
                    assert resp.status == 200
            assert pd.health_calls - before == 3

    run(scenario())


def test_a_slow_upstream_probe_does_not_slow_the_proxys_own_health() -> None:
    """Once the cache has expired, /health gives its last answer while the next probe
    runs (a p/d's /health takes 1.5 s here, more than Kubernetes' default 1 s probe
    timeout), and the probe's new answer once it is in."""
    async def scenario() -> None:
        pd = FakePD("pd0")
        async with rig(pds=[pd], health_cache_s=0.2, health_timeout_s=3) as r:
            async def health() -> tuple[int, float]:
                started = time.monotonic()
                async with r.session.get(f"{r.url}/health") as resp:
                    return resp.status, time.monotonic() - started

            assert (await health())[0] == 200  # the first answer waits for its probe
            pd.health_delay, pd.health_status = 1.5, 503
            await asyncio.sleep(0.3)
            status, took = await health()
            assert status == 200 and took < 0.5, (status, took)
            await asyncio.sleep(1.6)  # the probe that call started is in
            status, took = await health()
            assert status == 503 and took < 0.5, (status, took)

    run(scenario())


# --------------------------------------------------------------------------- 8. request ids
def test_a_request_id_is_passed_on_only_when_short_and_plain() -> None:
    async def scenario() -> None:
        async with rig() as r:
            for given, kept in [("req-42.a:b", True), ("x" * 8000, False), ("has space", False),
                                ("tab\tin", False), ("ünï", False)]:
                status, _, headers = await r.post(chat(), headers={"X-Request-Id": given.encode().decode("latin-1")})
                assert status == 200
                sent = r.pds[0].headers[-1]["X-Request-Id"]
                assert (sent == given) is kept and len(sent) <= 128, sent[:200]
                assert headers["X-Request-Id"] == sent

    run(scenario())


def test_status_endpoints_can_ask_for_the_key() -> None:
    async def scenario() -> None:
        async with rig(api_key="client-secret", protect_status=True) as r:
            key = {"Authorization": "Bearer client-secret"}
            async with r.session.get(f"{r.url}/metrics") as resp:
                assert resp.status == 401
                error_of(401, await resp.read())
            async with r.session.get(f"{r.url}/metrics", headers=key) as resp:
                assert resp.status == 200 and "ec_s3_proxy_requests_total" in await resp.text()
            async with r.session.get(f"{r.url}/health") as resp:
                assert resp.status == 200 and await resp.json() == {"status": "ok"}
            async with r.session.get(f"{r.url}/health", headers=key) as resp:
                assert list((await resp.json())["prefill_decode"]) == [r.pds[0].url]

    run(scenario())


# --------------------------------------------------------------------------- settings
def test_edge_flags_and_their_validation() -> None:
    from ec_s3.proxy.main import build_parser, config_from_args

    args = build_parser().parse_args([
        "--pd-url", "http://pd:1", "--max-connections", "10", "--header-timeout", "3", "--body-timeout", "4",
        "--body-budget", "1GiB", "--max-body-bytes", "100MiB", "--read-timeout", "0", "--health-cache", "0.5",
        "--protect-status", "--api-key-file", "/dev/null",
    ])
    with pytest.raises(ValueError, match="api_key"):  # /dev/null holds no key
        config_from_args(args)
    args.api_key_file = None
    args.api_key = "k"
    config = config_from_args(args)
    assert (config.max_connections, config.header_timeout_s, config.body_timeout_s) == (10, 3.0, 4.0)
    assert (config.body_budget_bytes, config.max_body_bytes) == (1 << 30, 100 << 20)
    assert (config.read_timeout_s, config.health_cache_s, config.protect_status) == (None, 0.5, True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--pd-url", "http://pd:1", "--body-budget", "lots"])
    base = {"encoder_urls": [], "pd_urls": ["http://pd:1"]}
    for key, value in [("max_connections", 0), ("header_timeout_s", 0), ("body_timeout_s", -1),
                       ("read_timeout_s", 0), ("health_cache_s", -1), ("send_timeout_s", 0), ("protect_status", True),
                       ("body_budget_bytes", 64 * MiB)]:
        with pytest.raises(ValueError, match=key):
            ProxyConfig(**base, **{key: value})


# --------------------------------------------------------------------------- the goal
_WATCH_HEALTH = """
import sys, time, urllib.request
url, out, errors = sys.argv[1], [], []
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    t = time.monotonic()
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert resp.status == 200, resp.status
    except Exception as exc:  # reported, not fatal: the test names what went wrong
        errors.append(repr(exc))
    out.append(time.monotonic() - t)
    time.sleep(0.05)
out.sort()
print(f"{len(out)} {out[len(out) // 2] * 1000:.1f} {out[-1] * 1000:.1f}")
for error in errors:
    print(error)
"""


def _proc_rss_fds(pid: int) -> tuple[int, int]:
    return rss_bytes(pid), len(os.listdir(f"/proc/{pid}/fd"))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_thousand_concurrent_requests_are_answered_and_leave_nothing_behind() -> None:
    """Issue 33's goal, as far as it holds: 1,000 concurrent requests (half streamed)
    against upstreams that take 2-2.5 s are all answered, /health (watched from another
    process) answers in under 100 ms at the median, the proxy's fds come back to their
    baseline and a second wave adds nothing to its RSS (the first wave's peak is kept by
    the allocator, not leaked), and no probe fails. The worst /health latency is printed,
    not asserted: the burst's own arrival holds the loop for longer than 100 ms on this
    2-core host."""
    import sys

    import aiohttp

    from test_proxy import FakeEncoder, proxy_process, serve

    async def scenario() -> None:
        pd = FakePD("pd0", delay=2.5, chunks=4)
        enc = FakeEncoder("e0", delay=2.0)
        enc_runner, enc.url = await serve(enc.app())
        try:
            # The fakes answer from this test's own loop, which its 1,000 clients hold for
            # seconds on 2 cores (a p/d's /health took over 2 s here: 503); a real vLLM
            # answers its /health from a process of its own.
            async with proxy_process(pd, "--encoder-url", enc.url, "--max-connections-per-upstream", "1100",
                                     "--encode-timeout", "4", "--health-timeout", "10") as (proc, url, output):
                async def wave(numbers: range) -> list[bool]:
                    """One client per request, all at once; their connections closed at the end."""
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                     timeout=aiohttp.ClientTimeout(total=90)) as session:
                        async def one(i: int) -> bool:
                            stream = i % 2 == 0
                            async with session.post(f"{url}/v1/chat/completions",
                                                    json=chat(image(i % 100), stream=stream)) as resp:
                                body = await resp.read()
                                return resp.status == 200 and (body.endswith(b"data: [DONE]\n\n") if stream
                                                               else b"hello from pd0" in body)

                        return await asyncio.gather(*(one(i) for i in numbers))

                assert await wave(range(1))
                await asyncio.sleep(5)  # idle upstream connections are dropped after 4 s
                base_rss, base_fds = _proc_rss_fds(proc.pid)
                watcher = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _WATCH_HEALTH, url, "8", stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE)
                started, cpu_proxy, cpu_test = time.monotonic(), _cpu_s(proc.pid), _cpu_s(os.getpid())
                first = asyncio.create_task(wave(range(1000)))
                peak_rss, peak_fds = base_rss, base_fds
                while not first.done():
                    rss, fds = _proc_rss_fds(proc.pid)
                    peak_rss, peak_fds = max(peak_rss, rss), max(peak_fds, fds)
                    await asyncio.sleep(0.05)
                results = await first
                elapsed = time.monotonic() - started
                cpu_proxy, cpu_test = _cpu_s(proc.pid) - cpu_proxy, _cpu_s(os.getpid()) - cpu_test
                out, watcher_err = await watcher.communicate()
                # aiohttp's pool closes an idle upstream connection at its next sweep, within
                # twice keepalive_timeout_s (4 s) of its last use.
                await asyncio.sleep(9)
                wave1_rss, wave1_fds = _proc_rss_fds(proc.pid)
                # A second wave: what the first left behind is reused, not added to.
                again = await wave(range(1000, 2000))
                await asyncio.sleep(9)
                end_rss, end_fds = _proc_rss_fds(proc.pid)
        finally:
            await enc_runner.cleanup()
        assert watcher.returncode == 0 and out, watcher_err.decode()
        first_line, *health_errors = out.decode().splitlines()
        n_health, median_ms, worst_ms = first_line.split()
        print(f"\nproxy output: {len(output)} bytes, {output.count(b'WARNING')} warnings")
        print(f"\n1000 requests in {elapsed:.1f} s (CPU: proxy {cpu_proxy:.1f} s, test {cpu_test:.1f} s); /health x{n_health}: median {float(median_ms):.0f} ms, "
              f"worst {float(worst_ms):.0f} ms; proxy RSS {base_rss >> 20} -> {peak_rss >> 20} -> {wave1_rss >> 20} "
              f"-> (second wave) {end_rss >> 20} MiB; fds {base_fds} -> {peak_fds} -> {wave1_fds} -> {end_fds}")
        assert all(results) and all(again), (results.count(False), again.count(False))
        assert float(median_ms) < 100
        assert not health_errors, health_errors
        assert wave1_fds <= base_fds + 2 and end_fds <= base_fds + 2
        assert end_rss < wave1_rss + 16 * MiB  # no growth per wave
        assert peak_rss < base_rss + 200 * MiB

    run(scenario(), timeout=110)


@pytest.mark.slow
def test_big_bodies_at_once_stay_within_the_byte_budget() -> None:
    """Six 59 MB image bodies at once (main peaked at 2.3 GB here): the proxy process's
    RSS stays under its byte budget + 200 MB, and every request is answered."""
    import sys

    import aiohttp

    from test_proxy import proxy_process

    body = json.dumps(chat(image("big", extra="x" * (59 * 10**6)))).encode()

    async def scenario() -> None:
        async with proxy_process(FakePD("pd0"), "--body-budget", "512MiB", "--max-body-bytes", "64MiB") as (proc, url, _output):
            base_rss, _ = _proc_rss_fds(proc.pid)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=100)) as session:
                async def one() -> int:
                    async with session.post(f"{url}/v1/chat/completions", data=body,
                                            headers={"Content-Type": "application/json"}) as resp:
                        await resp.read()
                        return resp.status

                task = asyncio.gather(*(one() for _ in range(6)))
                peak = base_rss
                while not task.done():
                    peak = max(peak, _proc_rss_fds(proc.pid)[0])
                    await asyncio.sleep(0.01)
                statuses = await task
        print(f"\nsix {len(body) / 1e6:.0f} MB bodies at once, --body-budget 512MiB: proxy RSS {base_rss >> 20} -> "
              f"peak {peak >> 20} MiB; statuses {statuses}; {sys.platform}")
        assert statuses == [200] * 6
        assert peak < 512 * MiB + 200 * MiB

    run(scenario(), timeout=110)


def test_heads_aiohttp_refuses_are_answered_in_json() -> None:
    async def scenario() -> None:
        async with rig() as r:
            for raw in (b"NOT-HTTP\r\n\r\n",
                        b"GET /health HTTP/1.1\r\nHost: proxy\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n"):
                reader, writer = await open_raw(r)
                writer.write(raw)
                status, body = await answer_of(reader, 5)
                writer.close()
                assert 400 <= status < 500 and error_of(status, body)["message"], (status, body)
            assert r.metric("ec_s3_proxy_internal_errors_total") == 0

    run(scenario())
