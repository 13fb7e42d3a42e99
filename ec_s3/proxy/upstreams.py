"""Upstream pools: which encoder or prefill/decode instance gets the next request.

Owns each instance's load (requests outstanding), its refuse-to-connect cooldown, the
least-loaded choice (or, under ``route="affinity"``, the load-bounded rendezvous choice of
:mod:`ec_s3.proxy.routing` for a request with a routing key), and rate-limited warnings
about an instance. It does not own HTTP
(:mod:`ec_s3.proxy.encode` and :mod:`ec_s3.proxy.pd` send and decide what a failure
means) nor health probes (``/health`` probes the instances: :mod:`ec_s3.proxy.status`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ec_s3.log import logger
from ec_s3.proxy.metrics import ProxyMetrics
from ec_s3.proxy.routing import AFFINITY, LEAST_LOADED, bounded_pick

__all__ = ["Pool", "Upstream", "Warner"]

_WARN_INTERVAL_S = 10.0


class Upstream:
    """One encoder or PD instance with its load and its refuse-to-connect cooldown."""

    __slots__ = ("down_until", "in_flight", "role", "url", "wrong")

    def __init__(self, role: str, url: str) -> None:
        self.role = role
        self.url = url
        self.in_flight = 0
        self.down_until = 0.0
        self.wrong = False  # its role check found it in the wrong role: never used

    def up(self, now: float) -> bool:
        return now >= self.down_until


class Pool:
    """Least-outstanding-requests choice with round-robin among ties, skipping instances
    in cooldown; the pick is counted at once so that the items of one request, picked
    back to back, land on different instances."""

    def __init__(
        self, role: str, urls: Sequence[str], metrics: ProxyMetrics, cooldown_s: float, *,
        route: str = LEAST_LOADED, balance: float = 0.25,
    ) -> None:
        self.role = role
        self.route = route
        self.balance = balance
        self.members = [Upstream(role, u) for u in urls]
        self._metrics = metrics
        self._cooldown_s = cooldown_s
        self._rr = itertools.count()
        for m in self.members:
            metrics.set("ec_s3_proxy_in_flight", 0, role=role, upstream=m.url)
            metrics.set("ec_s3_proxy_upstream_up", 1, role=role, upstream=m.url)

    def acquire(
        self, exclude: Iterable[Upstream] = (), *, allow_down: bool = False, key: str | None = None
    ) -> Upstream | None:
        """The next instance, counted at once; ``key`` (a request's routing key) picks by
        bounded rendezvous hashing when the pool routes by affinity."""
        excluded = set(map(id, exclude))
        now = time.monotonic()
        candidates = [m for m in self.members if id(m) not in excluded and m.up(now) and not m.wrong]
        if not candidates and allow_down:
            candidates = [m for m in self.members if id(m) not in excluded and not m.wrong]
        if not candidates:
            return None
        if self.route == AFFINITY:
            chosen = self._affine(candidates, key)
        else:
            chosen = self._least_loaded(candidates)
        chosen.in_flight += 1
        self._metrics.set("ec_s3_proxy_in_flight", chosen.in_flight, role=self.role, upstream=chosen.url)
        return chosen

    def _least_loaded(self, candidates: list[Upstream]) -> Upstream:
        start = next(self._rr) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda m: m.in_flight)

    def _affine(self, candidates: list[Upstream], key: str | None) -> Upstream:
        if key is None:
            chosen = self._least_loaded(candidates)
            self._metrics.inc("ec_s3_proxy_route_picks_total", role=self.role, upstream=chosen.url, outcome="no_media")
            return chosen
        pick = bounded_pick(key, [m.url for m in candidates], [m.in_flight for m in candidates], self.balance)
        chosen = candidates[pick.index]
        self._metrics.inc("ec_s3_proxy_route_picks_total", role=self.role, upstream=chosen.url,
                          outcome="spill" if pick.spilled else "affinity")
        return chosen

    def release(self, member: Upstream) -> None:
        member.in_flight -= 1
        self._metrics.set("ec_s3_proxy_in_flight", member.in_flight, role=self.role, upstream=member.url)

    def mark_down(self, member: Upstream) -> None:
        member.down_until = time.monotonic() + self._cooldown_s
        self._metrics.set("ec_s3_proxy_upstream_up", 0, role=self.role, upstream=member.url)

    def mark_up(self, member: Upstream) -> None:
        if member.down_until:
            member.down_until = 0.0
            self._metrics.set("ec_s3_proxy_upstream_up", 1, role=self.role, upstream=member.url)


class Warner:
    """One warning per (upstream, kind) per interval, with the count it held back: a dead
    encoder under load must not flood the log."""

    def __init__(self, interval_s: float = _WARN_INTERVAL_S) -> None:
        self._interval = interval_s
        self._state: dict[tuple[str, str], tuple[float, int]] = {}

    def warn(self, key: tuple[str, str], msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, held = self._state.get(key, (float("-inf"), 0))
        if now - last < self._interval:
            self._state[key] = (last, held + 1)
            return
        self._state[key] = (now, 0)
        if held:
            msg += " (%d similar suppressed)"
            args = (*args, held)
        logger.warning(msg, *args)
