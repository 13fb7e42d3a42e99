"""Cache-affinity routing (``--route affinity``): the pure decision, and the proxy in front
of two fake prefill/decode servers (aiohttp servers on loopback, as in test_proxy.py)."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter

import pytest
from test_proxy import FakePD, Gauge, chat, image, rig, run

from ec_s3.proxy.config import ProxyConfig
from ec_s3.proxy.main import build_parser, config_from_args, main
from ec_s3.proxy.media import find_media_items
from ec_s3.proxy.naming import name_media
from ec_s3.proxy.routing import Pick, bounded_pick, rendezvous_order, route_key

pytestmark = pytest.mark.timeout(120)

NAMES = [f"http://10.0.0.{n}:8000" for n in range(1, 6)]
KEYS = [f"ecs3-{n:064x}" for n in range(2000)]


def first_choice(key: str, names: list[str]) -> str:
    return names[rendezvous_order(key, names)[0]]


# --------------------------------------------------------------------------- the decision
def test_rendezvous_order_is_a_permutation_independent_of_list_order() -> None:
    for key in KEYS[:50]:
        order = rendezvous_order(key, NAMES)
        assert sorted(order) == list(range(len(NAMES)))
        shuffled = NAMES[::-1]
        assert [shuffled[i] for i in rendezvous_order(key, shuffled)] == [NAMES[i] for i in order]


def test_keys_spread_evenly_over_the_upstreams() -> None:
    counts = Counter(first_choice(k, NAMES) for k in KEYS)
    assert set(counts) == set(NAMES)
    # 2000 keys over 5: 400 each expected; 3 sigma is ~54.
    assert all(320 <= c <= 480 for c in counts.values()), counts


def test_removing_an_upstream_moves_only_its_keys_to_their_next_choice() -> None:
    gone = NAMES[2]
    rest = [n for n in NAMES if n != gone]
    moved = 0
    for key in KEYS:
        before = [NAMES[i] for i in rendezvous_order(key, NAMES)]
        after = first_choice(key, rest)
        if before[0] == gone:
            moved += 1
            assert after == before[1]
        else:
            assert after == before[0]
    assert moved > 0


def test_adding_an_upstream_takes_keys_only_for_itself() -> None:
    new = "http://10.0.0.9:8000"
    grown = [*NAMES, new]
    taken = 0
    for key in KEYS:
        after = first_choice(key, grown)
        if after != first_choice(key, NAMES):
            assert after == new
            taken += 1
    assert 0.1 < taken / len(KEYS) < 0.25  # about 1/6


@pytest.mark.parametrize(
    ("loads", "balance", "want_rank", "spilled"),
    [
        # Idle fleet: the first choice.
        ([0, 0], 0.25, 0, False),
        # n=2, m=2: bound ceil(1.25) = 2, the first choice holds 1 -> still it.
        ([1, 0], 0.25, 0, False),
        # m=3: bound ceil(1.875) = 2, the first choice would hold 3 -> the second.
        ([2, 0], 0.25, 1, True),
        # m=4: bound ceil(2.5) = 3 -> the first choice again.
        ([2, 1], 0.25, 0, False),
        # Perfect balance (0): any excess spills.
        ([1, 0], 0.0, 1, True),
        ([1, 1], 0.0, 0, False),
        # A loose bound keeps a hot key home longer.
        ([5, 0], 3.0, 0, False),
        # Three upstreams, first and second choices full: the third.
        ([3, 3, 0], 0.25, 2, True),
    ],
)
def test_bounded_pick_table(loads: list[int], balance: float, want_rank: int, spilled: bool) -> None:
    key = KEYS[7]
    names = NAMES[: len(loads)]
    order = rendezvous_order(key, names)
    # The table lists loads by rank (first choice first); place them by index.
    by_index = [0] * len(names)
    for rank, index in enumerate(order):
        by_index[index] = loads[rank]
    assert bounded_pick(key, names, by_index, balance) == Pick(order[want_rank], spilled)


def test_bounded_pick_always_finds_an_upstream_within_the_bound() -> None:
    rng = random.Random(32)
    for _ in range(2000):
        n = rng.randint(1, 6)
        loads = [rng.randint(0, 20) for _ in range(n)]
        balance = rng.choice([0.0, 0.1, 0.25, 1.0])
        pick = bounded_pick(rng.choice(KEYS), NAMES[:n] if n <= 5 else [*NAMES, "x"], loads, balance)
        assert loads[pick.index] + 1 <= math.ceil((1 + balance) * (sum(loads) + 1) / n)
    with pytest.raises(ValueError):
        bounded_pick("k", [], [], 0.25)


def test_a_hot_key_under_sequential_load_fills_its_home_to_the_bound_only() -> None:
    names = NAMES[:2]
    loads = [0, 0]
    for _ in range(20):
        pick = bounded_pick(KEYS[0], names, loads, 0.25)
        loads[pick.index] += 1
    home = rendezvous_order(KEYS[0], names)[0]
    # Home takes exactly its bound, ceil(1.25 * 20 / 2) = 13; the rest spill.
    assert (loads[home], loads[1 - home]) == (13, 7)


def test_route_key_is_the_first_items_content_identifier() -> None:
    body = chat(image(1), image(2))
    named = name_media(body, give_uuids=True)
    key = route_key(find_media_items(named))
    assert key is not None and key.startswith("ecs3-")
    # Without the proxy's uuids (serial dispatch) the key is computed the same way.
    assert route_key(find_media_items(body)) == key
    # Same first image, other text and second image: same key; no media: none.
    assert route_key(find_media_items(chat(image(1), image(3), text="Other."))) == key
    assert route_key(find_media_items(chat(image(2), image(1)))) != key
    assert route_key([]) is None


def test_route_flags_and_validation() -> None:
    config = config_from_args(build_parser().parse_args(["--pd-url", "http://pd:1"]))
    assert config.route == "affinity" and config.route_balance == 0.25
    args = build_parser().parse_args(["--pd-url", "http://pd:1", "--route", "least-loaded", "--route-balance", "0.5"])
    config = config_from_args(args)
    assert config.route == "least-loaded" and config.route_balance == 0.5
    assert main(["--pd-url", "http://pd:1", "--route", "hash"]) == 2
    with pytest.raises(ValueError, match="^route: "):
        ProxyConfig(encoder_urls=[], pd_urls=["http://pd:1"], route="hash")
    with pytest.raises(ValueError, match="^route_balance: "):
        ProxyConfig(encoder_urls=[], pd_urls=["http://pd:1"], route_balance=-0.1)


# --------------------------------------------------------------------------- the proxy
def _home(pds: list[FakePD], part: dict[str, object]) -> FakePD:
    key = route_key(find_media_items(chat(part)))
    assert key is not None
    return pds[rendezvous_order(key, [p.url for p in pds])[0]]


def test_the_same_image_goes_to_the_same_upstream_and_images_spread() -> None:
    async def scenario() -> None:
        pds = [FakePD("pd0"), FakePD("pd1")]
        async with rig(encoders=[], pds=pds, dispatch="parallel", route="affinity") as r:
            for n in range(12):
                home = _home(pds, image(n))
                before = len(home.bodies)
                for ask in range(3):
                    status, _, _ = await r.post(chat(image(n), text=f"Ask {ask}."))
                    assert status == 200
                assert len(home.bodies) == before + 3
            assert all(len(p.bodies) > 0 for p in pds)  # 12 images, both get some
            assert r.metric("ec_s3_proxy_route_picks_total", outcome="affinity") == 36
            assert r.metric("ec_s3_proxy_route_picks_total", outcome="spill") == 0
            status, _, _ = await r.post(chat(text="No image."))
            assert status == 200 and r.metric("ec_s3_proxy_route_picks_total", outcome="no_media") == 1
        # Least-loaded (the control): one image's repeats land on both servers.
        pds = [FakePD("pd0"), FakePD("pd1")]
        async with rig(encoders=[], pds=pds, dispatch="parallel", route="least-loaded") as r:
            for _ in range(4):
                assert (await r.post(chat(image(0))))[0] == 200
            assert [len(p.bodies) for p in pds] == [2, 2]
            assert r.metric("ec_s3_proxy_route_picks_total") == 0

    run(scenario())


def test_a_hot_image_spills_to_the_other_upstream_past_the_load_bound() -> None:
    async def scenario() -> None:
        hold = Gauge(target=6)  # every answer waits until six requests are held at once
        pds = [FakePD("pd0", hold=hold), FakePD("pd1", hold=hold)]
        async with rig(encoders=[], pds=pds, route="affinity", route_balance=0.25) as r:
            home = _home(pds, image("hot"))
            other = pds[1 - pds.index(home)]
            results = await asyncio.gather(*(r.post(chat(image("hot"))) for _ in range(6)))
            assert [s for s, _, _ in results] == [200] * 6
            # Six at once over two: the bound (ceil(1.25 * m / 2) for the m-th) lets home
            # take 4, and 2 spill (the table in test_bounded_pick_table, run forward).
            assert (len(home.bodies), len(other.bodies)) == (4, 2)
            assert r.metric("ec_s3_proxy_route_picks_total", outcome="spill", upstream=other.url) == 2
            assert r.metric("ec_s3_proxy_route_picks_total", outcome="affinity", upstream=home.url) == 4
            # Once the load is gone, the hot image goes home again.
            assert (await r.post(chat(image("hot"))))[0] == 200
            assert len(home.bodies) == 5
        assert hold.peak == 6

    run(scenario())
