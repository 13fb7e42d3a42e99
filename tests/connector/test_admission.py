"""Admission as a table: each row is what the scheduler knows of one item of one request
(the role, the item's last answer, the promise, the media, how long the request has
waited, whether the workers read staging) and the one decision it must get. Pure: no
S3, no vLLM engine, no clock. The scheduler applying these decisions is tested with
the real vLLM Scheduler in test_consumer*.py and test_producer.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ec_s3.config import ECS3Config
from ec_s3.connector import items
from ec_s3.connector.admission import (
    Action,
    Admission,
    Ask,
    ConsumerAdmission,
    LATER,
    Decision,
    ProducerAdmission,
    promise_poll_interval,
)
from ec_s3.connector.items import Item, ItemState
from ec_s3.connector.transfer_params import Promise

NOW = 1000.0
STAGING = 1 << 20
# The defaults, spelled out: the rows below depend on them.
CONFIG = ECS3Config(
    bucket="b", lookup="always", promised_wait_s=5.0, lookup_wait_s=2.0, producer_lookup_wait_s=0.0,
    negative_cache_ttl_s=5.0, present_ttl_s=300.0,
)
PROMISE = Promise(key="k", size_bytes=4096)
S = ItemState
A = Action


@pytest.fixture(autouse=True)
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(items, "STRICT", True)


def item(state: ItemState, *, checked: float = 0.0, started: float | None = None, repeats: int = 1,
         reason: str = "", outage: bool = False) -> Item:
    """An item whose last answer was ``state``, ``checked`` seconds ago."""
    it = Item(key="k", identifier="img")
    it.state, it.checked_at, it.repeats, it.reason, it.outage = state, NOW - checked, repeats, reason, outage
    it.started_at = NOW - (checked if started is None else started)
    return it


def consumer(**config: Any) -> Admission:
    return ConsumerAdmission(dataclasses.replace(CONFIG, **config), STAGING)


def producer(**config: Any) -> Admission:
    return ProducerAdmission(dataclasses.replace(CONFIG, **config))


def ask(it: Item | None = None, *, promise: Promise | None = None, media: bool = True, waited: float | None = None,
        workers_read_staging: bool = True) -> Ask:
    since = None if waited is None else NOW - waited
    return Ask(item=it, promise=promise, has_media=media, since=since, now=NOW, workers_read_staging=workers_read_staging)


def D(action: Action, *, lookup: bool = False, renew: bool = False, clock: bool = True, uses_item: bool = True,
      counter: str | None = None, outcome: str | None = None) -> Decision:
    return Decision(action, lookup=lookup, renew=renew, clock=clock, uses_item=uses_item, counter=counter,
                    outcome=outcome)


WAIT_LOOKUP = D(A.WAIT, lookup=True)
HIT = D(A.HIT, clock=False, outcome="hit")

ROWS: list[tuple[str, Admission, Ask, Decision, str]] = [
    # --- consumer: workers on another host can never be served from staging
    ("unreadable staging, nobody promised: as a miss", consumer(), ask(workers_read_staging=False),
     D(A.PROCEED, clock=False, uses_item=False), ""),
    ("unreadable staging, promised", consumer(), ask(promise=PROMISE, workers_read_staging=False),
     D(A.UNAVAILABLE, clock=False, uses_item=False), "cannot read its staging area"),
    ("unreadable staging, no media", consumer(), ask(media=False, workers_read_staging=False),
     D(A.UNAVAILABLE, clock=False, uses_item=False), "cannot read its staging area"),
    ("unreadable staging wins over a staged item", consumer(), ask(item(S.STAGED), workers_read_staging=False),
     D(A.PROCEED, clock=False, uses_item=False), ""),
    # --- consumer: lookup promised vs always
    ("lookup=promised, nobody promised, media: vLLM encodes", consumer(lookup="promised"), ask(),
     D(A.PROCEED, clock=False), ""),
    ("lookup=promised, no media: the bucket is the only source", consumer(lookup="promised"), ask(media=False),
     WAIT_LOOKUP, ""),
    ("lookup=promised, promised: fetched", consumer(lookup="promised"), ask(promise=PROMISE), WAIT_LOOKUP, ""),
    ("lookup=always, unknown item: looked up", consumer(), ask(), WAIT_LOOKUP, ""),
    # --- consumer: hits
    ("staged: hit", consumer(), ask(item(S.STAGED), promise=PROMISE), HIT, ""),
    ("staged, nobody promised: hit", consumer(), ask(item(S.STAGED)), HIT, ""),
    ("present (a HEAD's answer) is no consumer hit", consumer(), ask(item(S.PRESENT), waited=0.0), D(A.PROCEED), ""),
    # --- consumer: a blob larger than staging
    ("promised blob larger than staging", consumer(), ask(promise=Promise("k", STAGING + 1)),
     D(A.UNAVAILABLE, clock=False), f"larger than staging_bytes={STAGING}"),
    ("promised blob exactly staging's size", consumer(), ask(promise=Promise("k", STAGING)), WAIT_LOOKUP, ""),
    ("promise without a size", consumer(), ask(promise=Promise("k", None)), WAIT_LOOKUP, ""),
    # --- consumer: waiting for a lookup in flight
    ("promised, looking, within promised_wait_s", consumer(), ask(item(S.LOOKING), promise=PROMISE, waited=4.9),
     D(A.WAIT), ""),
    ("promised, looking, promised_wait_s over", consumer(), ask(item(S.LOOKING), promise=PROMISE, waited=5.0),
     D(A.UNAVAILABLE, counter="promise_timeouts", outcome="timeout"), "did not arrive within promised_wait_s=5s"),
    ("lookup, within lookup_wait_s", consumer(), ask(item(S.LOOKING), waited=1.9), D(A.WAIT), ""),
    ("lookup timed out, media: encoded locally", consumer(), ask(item(S.LOOKING), waited=2.0),
     D(A.ENCODE_LOCALLY, outcome="timeout"), ""),
    ("lookup timed out, no media", consumer(), ask(item(S.LOOKING), media=False, waited=2.0),
     D(A.UNAVAILABLE, outcome="timeout"), "did not finish within lookup_wait_s=2s"),
    ("lookup_wait_s=0: a new lookup times out at once", consumer(lookup_wait_s=0.0), ask(),
     D(A.ENCODE_LOCALLY, lookup=True, outcome="timeout"), ""),
    ("promised_wait_s=0: a new lookup of a promise times out at once", consumer(promised_wait_s=0.0),
     ask(promise=PROMISE), D(A.UNAVAILABLE, lookup=True, counter="promise_timeouts", outcome="timeout"), "promised_wait_s=0s"),
    # --- consumer: answers of items nobody promised (negative cache)
    ("miss, remembered: vLLM encodes", consumer(), ask(item(S.MISSING, checked=4.9)), D(A.PROCEED, outcome="miss"), ""),
    ("miss, forgotten: looked up again", consumer(), ask(item(S.MISSING, checked=5.0)), WAIT_LOOKUP, ""),
    ("miss, no media", consumer(), ask(item(S.MISSING, checked=1.0), media=False),
     D(A.UNAVAILABLE, outcome="miss"), "nobody promised it and the bucket lookup came back missing"),
    ("failed lookup, nobody promised: vLLM encodes", consumer(), ask(item(S.FAILED, checked=1.0, outage=True)),
     D(A.PROCEED, outcome="error"), ""),
    # --- consumer: answers of promised items
    ("promised, invalid blob", consumer(), ask(item(S.INVALID, reason="bad width"), promise=PROMISE, waited=0.01),
     D(A.UNAVAILABLE, outcome="error"), "the stored blob is invalid (bad width)"),
    ("promised, invalid, poll due: looked at again", consumer(),
     ask(item(S.INVALID, checked=0.05), promise=PROMISE, waited=0.05), WAIT_LOOKUP, ""),
    ("promised, outage", consumer(), ask(item(S.FAILED, reason="down", outage=True), promise=PROMISE, waited=0.01),
     D(A.UNAVAILABLE, outcome="error"), "the store is unavailable (down)"),
    ("promised, one failed answer (no outage): wait", consumer(),
     ask(item(S.FAILED, reason="503"), promise=PROMISE, waited=0.01), D(A.WAIT), ""),
    ("promised, missing, poll not due", consumer(), ask(item(S.MISSING, started=0.001), promise=PROMISE, waited=0.05),
     D(A.WAIT), ""),
    ("promised, missing, poll due", consumer(), ask(item(S.MISSING, started=0.002), promise=PROMISE, waited=0.05),
     WAIT_LOOKUP, ""),
    ("promised, missing, poll not due, promised_wait_s over", consumer(),
     ask(item(S.MISSING, checked=0.1, started=0.2, reason="not found"), promise=PROMISE, waited=5.0),
     D(A.UNAVAILABLE, counter="promise_timeouts", outcome="timeout"), "still missing (not found) after promised_wait_s=5s"),
    ("promised, missing, poll due, promised_wait_s over", consumer(),
     ask(item(S.MISSING, started=1.0), promise=PROMISE, waited=5.0),
     D(A.UNAVAILABLE, lookup=True, counter="promise_timeouts", outcome="timeout"), "did not arrive within"),
    ("no space, backing off", consumer(), ask(item(S.NO_SPACE, checked=0.04), promise=PROMISE, waited=0.1),
     D(A.WAIT), ""),
    ("no space, back-off over", consumer(), ask(item(S.NO_SPACE, checked=0.05), promise=PROMISE, waited=0.1),
     WAIT_LOOKUP, ""),
    ("no space a third time: 4x the back-off", consumer(),
     ask(item(S.NO_SPACE, checked=0.19, repeats=3), promise=PROMISE, waited=0.5), D(A.WAIT), ""),
    # --- producer (no consumer): the encoder goes first
    ("producer, media, unknown: HEAD in the background, encode now", producer(), ask(),
     D(A.ENCODE_LOCALLY, lookup=True, outcome=LATER), ""),
    ("producer, media, promised: the promise is not waited for", producer(), ask(promise=PROMISE),
     D(A.ENCODE_LOCALLY, lookup=True, outcome=LATER), ""),
    ("producer, unreadable staging does not matter", producer(), ask(workers_read_staging=False),
     D(A.ENCODE_LOCALLY, lookup=True, outcome=LATER), ""),
    ("producer_lookup_wait_s>0: wait for the HEAD", producer(producer_lookup_wait_s=1.0), ask(), WAIT_LOOKUP, ""),
    ("producer_lookup_wait_s>0: HEAD late", producer(producer_lookup_wait_s=1.0), ask(item(S.LOOKING), waited=1.0),
     D(A.ENCODE_LOCALLY, outcome="timeout"), ""),
    ("producer_lookup_wait_s=0, HEAD still running", producer(), ask(item(S.LOOKING), waited=0.5),
     D(A.ENCODE_LOCALLY, outcome=LATER), ""),
    ("producer, present: hit (the encoder is skipped)", producer(), ask(item(S.PRESENT, checked=299.0)), HIT, ""),
    ("producer, present_ttl_s over: renewed and looked up", producer(), ask(item(S.PRESENT, checked=301.0)),
     D(A.ENCODE_LOCALLY, lookup=True, renew=True, outcome=LATER), ""),
    ("producer, present_ttl_s over, no media", producer(), ask(item(S.PRESENT, checked=301.0), media=False),
     D(A.WAIT, lookup=True, renew=True), ""),
    ("producer, miss remembered", producer(), ask(item(S.MISSING, checked=1.0)), D(A.PROCEED, outcome="miss"), ""),
    ("producer, lookup=promised, media", producer(lookup="promised"), ask(), D(A.PROCEED, clock=False), ""),
    ("producer, staged is no producer hit", producer(), ask(item(S.STAGED), waited=0.0), D(A.PROCEED), ""),
    # --- producer without media: only the bucket can provide it
    ("producer, no media: waits for the lookup", producer(), ask(media=False), WAIT_LOOKUP, ""),
    ("producer, no media, promised, late", producer(), ask(item(S.LOOKING), promise=PROMISE, media=False, waited=5.0),
     D(A.UNAVAILABLE, counter="promise_timeouts", outcome="timeout"), "promised_wait_s=5s"),
    ("producer, no media, lookup late", producer(), ask(item(S.LOOKING), media=False, waited=2.0),
     D(A.UNAVAILABLE, outcome="timeout"), "lookup_wait_s=2s"),
    ("producer, no media, blob larger than any staging: a producer stages nothing", producer(),
     ask(promise=Promise("k", STAGING * 1024), media=False), WAIT_LOOKUP, ""),
]


@pytest.mark.parametrize(("admission", "state", "expected", "reason"),
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_decision(admission: Admission, state: Ask, expected: Decision, reason: str) -> None:
    got = admission.decide(state)
    assert dataclasses.replace(got, reason="") == expected
    assert (reason in got.reason) if reason else got.reason == ""
    assert (got.action is Action.UNAVAILABLE) == bool(got.reason)  # a reason exactly when unavailable


def test_decide_is_pure() -> None:
    """The same question gets the same answer, and asking changes nothing."""
    it = item(S.MISSING, checked=6.0, started=6.0)
    before = dataclasses.asdict(it)
    question = ask(it, promise=PROMISE, waited=1.0)
    assert consumer().decide(question) == consumer().decide(question)
    assert dataclasses.asdict(it) == before


def test_next_lookup_at() -> None:
    """When a finished lookup may run again: a back-off for no space, the negative cache
    for items nobody promised, the request's poll schedule for a promised blob, and
    at least 50 ms for an answer that stands (invalid, failed)."""
    adm = consumer()
    assert adm.next_lookup_at(item(S.NO_SPACE, checked=0.0, repeats=1), PROMISE, 0.0) == NOW + 0.05
    assert adm.next_lookup_at(item(S.NO_SPACE, checked=0.0, repeats=7), None, 0.0) == NOW + 2.0
    assert adm.next_lookup_at(item(S.MISSING, checked=0.0), None, 0.0) == NOW + CONFIG.negative_cache_ttl_s
    assert adm.next_lookup_at(item(S.MISSING, started=1.0), PROMISE, 3.0) == NOW - 1.0 + promise_poll_interval(3.0)
    assert adm.next_lookup_at(item(S.INVALID, checked=0.0), PROMISE, 0.01) == NOW + 0.05
    assert adm.next_lookup_at(item(S.FAILED, checked=0.0), PROMISE, 4.0) == NOW + promise_poll_interval(4.0)


def test_roles() -> None:
    """What each role calls a hit, and whose promised waits are observed."""
    assert consumer().hit_state is S.STAGED and consumer().observes_promise_wait
    assert producer().hit_state is S.PRESENT and not producer().observes_promise_wait
