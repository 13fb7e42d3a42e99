"""Issue 40 item 6: a real-traffic corpus through ec-s3 proxies on real servers (the
shared tiny Qwen2.5-VL stack of support/qwen_stack.py: SeaweedFS, an ec_producer, an
ec_consumer whose vision tower differs from the producer's), each answer compared
EXACTLY (token ids and logprobs, temperature 0) with a plain server's.

The corpus (:func:`_build`), sent through three proxies: serial dispatch, parallel
dispatch, and parallel with ``bucket_lookup`` (a second front of the same fleet: it
learns from HEADs what the first one published):

* a chat client's turns that resend the history's images (A; A+B; A+B and text), and
  the README's three requests (A, A+B, A);
* 2-4 images per request with partial repeats (and one image twice in a request);
* an image with a video; videos of time scale (``second_per_grid_ts``) 0.5, 1.1 and 2.0,
  each sent twice (the repeat is the one that must keep its media: Qwen2.5-VL's video
  metadata is not exact);
* streamed and non-streamed answers;
* an encoder that fails mid-request (it holds the request 1 s, then resets the
  connection: prefill/decode had the request with the item pending), then the repeat;
* a blob deleted between turns (as ``ec-s3 gc`` deletes it; the stack's producers trust
  a blob 1 s, as gc --older-than exceeds the fleet's TTLs), then the chat goes on with
  the consumer holding that item nowhere (encoder cache and staging area flushed, a new
  prefix): the proxy's metadata-only part fails on prefill/decode and the request is sent
  again with the media under a fresh uuid; then the repeat.

All proxies' cases up to the deletion run first, then one deletion and one flush (the
flush costs the most), then the rest.

Exactly means: equal token ids and equal logprobs (no tolerance) to one of the plain
server's own answers for that request: sent once (cold) or at once again (its prefix
cache then holds the prompt, which moved logprobs by up to 3.8e-3 in this corpus: measured,
the bucket-lookup front's replays answer exactly like the warm plain server). Where the
consumer must encode an item itself (its encoder failed, its blob was deleted), it uses
its own vision tower, which differs from the plain server's on purpose: such an answer
must equal the consumer's own answer (cold or warm) for that request sent directly under
fresh uuids (its local encode). At the end the consumer's engine is alive (same
process, /health 200).
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest
from support.qwen_stack import BASELINES, PREFIX, QwenStack

from ec_s3.demo.chat import ChatResult, compare_results, post_chat
from ec_s3.sandbox.metrics import scrape_metrics
from ec_s3.sandbox.tiny_qwen import clip_mp4, photo_jpeg

CORPUS_TIMEOUT_S = 1200
SIZE = 448  # px: grid 1x32x32, 256 image tokens
QUESTIONS = ("What is in this picture?", "And this one?", "Compare them.", "Describe the video.")
# Each proxy's media: serial gets its own set, parallel another, and the bucket-lookup
# front replays the parallel set (it must find those items in the bucket, not encode them).
# The bucket-lookup front gets its own F (the encoder that fails): the consumer's prefix
# cache holds the parallel run's F prompts computed from its own local encode, which a
# blob of the producer's (other) weights must not meet in one prompt.
MEDIA_SETS = {"serial": (1000, 1000), "parallel": (2000, 2000), "bucket-lookup": (2000, 3000)}
# Clips: (fps, frames) -> Qwen2.5-VL's second_per_grid_ts after vLLM's qwen2_vl loader.
CLIPS = {"1.0": (2, 4), "0.5": (8, 8), "1.1": (2, 11), "2.0": (1, 4)}


@functools.cache
def _photo(seed: int) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(photo_jpeg(seed, SIZE)).decode()


@functools.cache
def _clip(seed: int, scale: str) -> str:
    fps, frames = CLIPS[scale]
    return "data:video/mp4;base64," + base64.b64encode(clip_mp4(seed, fps=fps, frames=frames)).decode()


def image(seed: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": _photo(seed)}}


def video(seed: int, scale: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": _clip(seed, scale)}}


def user(parts: list[dict[str, Any]], question: str) -> dict[str, Any]:
    return {"role": "user", "content": [*parts, {"type": "text", "text": question}]}


def request(model: str, messages: list[dict[str, Any]], *, stream: bool = False) -> dict[str, Any]:
    body = {"model": model, "temperature": 0.0, "max_tokens": 5, "logprobs": True, "top_logprobs": 1,
            "return_tokens_as_token_ids": True, "messages": messages}
    if stream:
        body["stream"] = True
    return body


# --------------------------------------------------------------------------- client
def post(url: str, body: dict[str, Any]) -> ChatResult:
    """POST a chat request; a streamed answer is read event by event into one result."""
    if not body.get("stream"):
        return post_chat(url, body)
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    started = time.monotonic()
    result = ChatResult(0, 0.0)
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:  # noqa: S310 - our servers
            result.status = int(resp.status)
            done = False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = json.dumps(event)[:300]
                    break
                for choice in event.get("choices", []):
                    result.text += (choice.get("delta") or {}).get("content") or ""
                    for t in (choice.get("logprobs") or {}).get("content") or []:
                        result.token_ids.append(int(str(t["token"]).split(":", 1)[1]))
                        result.logprobs.append(float(t["logprob"]))
            if not done and result.error is None:
                result.error = "stream ended without [DONE]"
    except urllib.error.HTTPError as exc:
        result.status, result.error = int(exc.code), exc.read().decode("utf-8", "replace")[:300]
    except (OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.monotonic() - started
    return result


# --------------------------------------------------------------------------- the corpus
@dataclass
class Case:
    """One request of the corpus, its plain answer and what happens before it is sent."""

    name: str
    body: dict[str, Any]
    want: ChatResult
    # The plain server's answer to the same request sent again at once (its prefix cache
    # then holds the prompt): the other answer a plain server gives for it.
    warm: ChatResult
    # "encoder_fails": the encoder holds the item's request 1 s, then resets it;
    # "delete_blobs": the blobs the previous request published are deleted, and the
    # consumer's encoder cache and staging area are flushed (:func:`_flush_consumer`).
    before: str | None = None
    # The consumer may encode these media parts itself (their encoder failed, their blob
    # was deleted): the answer may then be its local encode's (module docstring).
    local_ok: bool = False
    local: list[ChatResult] = field(default_factory=list)


def _build(url: str, model: str, base: int, own: int, shared: list[Case] | None = None) -> list[Case]:
    """The corpus of one media set (seeds from ``base``; F from ``own``), answered by the
    plain server at ``url``; a chat's later turns carry the plain server's earlier
    answers. Cases already in ``shared`` (same name and body) are taken from it."""
    cases: list[Case] = []
    known = {case.name: case for case in shared or ()}

    def add(name: str, messages: list[dict[str, Any]], *, stream: bool = False, **kw: Any) -> ChatResult:
        body = request(model, copy.deepcopy(messages), stream=stream)
        if name in known and known[name].body == body:
            cases.append(known[name])
            return known[name].want
        plain = {k: v for k, v in body.items() if k != "stream"}
        want, warm = post_chat(url, plain), post_chat(url, plain)
        assert want.ok and warm.ok, f"{name}: the plain server answered {want}, {warm}"
        cases.append(Case(name, body, want, warm, **kw))
        return want

    a, b, c, d, e, g = (image(base + n) for n in (0, 1, 2, 3, 4, 6))
    f = image(own + 5)
    q = QUESTIONS
    # The README's requests: A, A+B, A.
    add("readme A", [user([a], q[0])])
    add("readme A+B", [user([a, b], q[2])])
    add("readme A again", [user([a], q[0])], stream=True)
    # A chat that resends its history's images.
    chat = [user([c], q[0])]
    chat.append({"role": "assistant", "content": add("chat turn 1 (C)", chat).text})
    chat.append(user([d], q[1]))
    chat.append({"role": "assistant", "content": add("chat turn 2 (C, D)", chat, stream=True).text})
    chat.append({"role": "user", "content": q[2]})
    add("chat turn 3 (C, D, text)", chat)
    # 2-4 images, partial repeats.
    add("images A C E", [user([a, c, e], q[2])])
    add("images E B C D", [user([e, b, c, d], q[2])], stream=True)
    add("images D A D", [user([d, a, d], q[2])])
    # Image + video; videos of time scale 0.5, 1.1, 2.0, each twice.
    add("image + video 1.0", [user([b, video(base, "1.0")], q[3])])
    for n, scale in enumerate(("0.5", "1.1", "2.0"), 1):
        clip = video(base + n, scale)
        add(f"video {scale}", [user([clip], q[3])], stream=n == 2)
        add(f"video {scale} again", [user([clip], q[3])], stream=n != 2)
    add("image + video 1.0 again", [user([video(base, "1.0"), a], q[3])])
    # An encoder that fails mid-request, then the repeat.
    add("encoder fails (F)", [user([f], q[0])], before="encoder_fails", local_ok=True)
    add("after the failure (F)", [user([f], q[0])], stream=True, local_ok=True)
    # A blob deleted between turns (ec-s3 gc), then the chat goes on: the consumer's
    # encoder cache and staging area are flushed meanwhile, and the chat now opens with a
    # system message (so its prefix cache holds none of it): G's embedding is nowhere.
    chat = [user([g], q[0])]
    chat.append({"role": "assistant", "content": add("gc turn 1 (G)", chat).text})
    chat = [{"role": "system", "content": "You answer briefly."}, *chat, user([], q[1])]
    add("gc turn 2 (G's blob deleted)", chat, before="delete_blobs", local_ok=True)
    add("gc repeat (G)", [user([g], q[0])], stream=True, local_ok=True)
    return cases


def _baseline(url: str, model: str) -> dict[str, list[Case]]:
    out: dict[str, list[Case]] = {}
    for name, (base, own) in MEDIA_SETS.items():
        out[name] = _build(url, model, base, own, [c for cases in out.values() for c in cases])
    return out


BASELINES["corpus"] = _baseline


# --------------------------------------------------------------------------- running it
def _fresh_uuids(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a fresh uuid on every media part: new to every cache and to the
    bucket, so the consumer encodes each part itself."""
    body = copy.deepcopy(body)
    body.pop("stream", None)
    for message in body["messages"]:
        if isinstance(message["content"], list):
            for part in message["content"]:
                if part["type"] != "text":
                    part["uuid"] = f"local-{secrets.token_hex(8)}"
    return body


def _flush_consumer(stack: QwenStack, seed: int) -> float:
    """Push every earlier item out of the consumer's encoder cache (vLLM's holds about
    4,096 tokens here) and out of its staging area (``staging_bytes`` 2 MiB in the
    stack): 4 new 1024² photos (4,900 tokens, 2.5 MB of blobs) through a proxy of their
    own. Returns the seconds it took."""
    started = time.monotonic()
    proxy = stack.proxy("corpus-flush", direct=True)
    for n in range(2):
        parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(
            photo_jpeg(seed + 2 * n + k, 1024)).decode()}} for k in range(2)]
        result = post_chat(proxy.url, request(stack.model, [user(parts, QUESTIONS[0])]))
        assert result.ok, f"flushing the consumer: {result}"
    return time.monotonic() - started


def _keys(stack: QwenStack) -> set[str]:
    async def collect() -> set[str]:
        return {info.key async for info in stack.store.list_async(f"{PREFIX}/")}

    return stack.store.run(collect(), timeout=60)


def _verdict(case: Case, got: ChatResult) -> tuple[bool, str]:
    """Equal, token for token and logprob for logprob, to one of the plain server's two
    answers (cold, or with the prompt in its prefix cache), or where allowed to the
    consumer's local encode."""
    ok, why = compare_results(got, case.want)
    if ok:
        return ok, why
    if compare_results(got, case.warm)[0]:
        return True, "identical to the plain server's answer with its prefix cached"
    if not case.local_ok:
        return False, why
    for local in case.local:
        if compare_results(got, local)[0]:
            return True, "identical to the consumer's local encode"
    return False, f"{why}; and not the consumer's local encode"


@pytest.mark.slow
@pytest.mark.timeout(CORPUS_TIMEOUT_S)
def test_the_corpus_answers_like_a_plain_server(qwen_stack: QwenStack) -> None:
    stack = qwen_stack
    pid = stack.consumer.pid
    corpus: dict[str, list[Case]] = stack.baseline["corpus"]
    # The consumer's own answers for what it may have to encode itself.
    for cases in corpus.values():
        for case in cases:
            if case.local_ok:
                fresh = _fresh_uuids(case.body)
                for _ in range(2):  # cold, then with the prompt in its prefix cache
                    local = post_chat(stack.consumer.url, fresh)
                    assert local.ok, f"{case.name}: the consumer answered {local}"
                    case.local.append(local)
    proxies = {
        "serial": stack.proxy("corpus-serial", dispatch="serial"),
        # The README's command (its defaults; the encoder limit sized for CPU cores, as
        # ec-s3 demo sizes it): repeats within known_settle_s go with the encoder's promise.
        "parallel": stack.proxy("corpus-parallel", dispatch="parallel", known_settle_s=5.0),
        "bucket-lookup": stack.proxy("corpus-bucket-lookup", dispatch="parallel", bucket_lookup=stack.bucket_lookup(),
                                     bucket_lookup_timeout_s=2.0),
    }
    failures: list[str] = []
    lines: list[str] = []
    started = time.monotonic()
    sent = 0
    flushed = 0.0

    def send(proxy_name: str, case: Case) -> None:
        nonlocal sent
        if case.before == "encoder_fails":
            stack.encoder_front.set_latency(1.0, methods=["POST"])
            stack.encoder_front.reset_next(1, methods=["POST"])
        got = post(proxies[proxy_name].url, case.body)
        stack.encoder_front.clear()
        sent += 1
        ok, why = _verdict(case, got)
        lines.append(f"  {proxy_name:13s} {case.name:32s} {got.status} {got.latency_s * 1000:6.0f} ms  {why}")
        print(lines[-1], file=sys.stderr)
        if not ok:
            failures.append(f"{proxy_name}: {case.name}: {why}: {got}")

    # Every proxy's cases up to the turn before the deletion; the blobs that turn
    # published (G's) are deleted, the consumer is flushed once, then the rest.
    gone: set[str] = set()
    for proxy_name in proxies:
        cases = corpus[proxy_name]
        cut = next(n for n, case in enumerate(cases) if case.before == "delete_blobs")
        for case in cases[:cut - 1]:
            send(proxy_name, case)
        before = _keys(stack)
        send(proxy_name, cases[cut - 1])
        time.sleep(1.0)  # its upload lands
        gone |= _keys(stack) - before
    stack.store.run(stack.store.delete_many_async(sorted(gone)), timeout=60)
    flushed = _flush_consumer(stack, 9000)
    print(f"  ({len(gone)} blobs deleted; consumer flushed in {flushed:.1f} s)", file=sys.stderr)
    for proxy_name in proxies:
        cases = corpus[proxy_name]
        cut = next(n for n, case in enumerate(cases) if case.before == "delete_blobs")
        for case in cases[cut:]:
            send(proxy_name, case)
    elapsed = time.monotonic() - started
    metrics = {name: scrape_metrics(f"{p.url}/metrics") for name, p in proxies.items()}
    print(f"\ncorpus: {sent} requests through {len(proxies)} proxies in {elapsed:.1f} s", file=sys.stderr)
    print(f"  blobs deleted between turns: {len(gone)} (G of each media set); flushing took {flushed:.1f} s",
          file=sys.stderr)
    for name, m in metrics.items():
        print(f"  {name}: metadata-only items {m.get('ec_s3_proxy_metadata_only_items_total') or 0:g}, "
              f"resends after an encoder failed {m.get('ec_s3_proxy_pd_resends_total') or 0:g}, "
              f"resends with the media of metadata-only items "
              f"{m.get('ec_s3_proxy_pd_retries_total', reason='metadata_only_failed') or 0:g}", file=sys.stderr)
    # No engine death: the same consumer process serves.
    stack.consumer_health()
    assert stack.consumer.pid == pid, "the consumer was restarted"
    assert not failures, "\n".join(failures)
