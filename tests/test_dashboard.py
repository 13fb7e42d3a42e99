"""The Grafana dashboard asks only for metrics ec-s3 exports, and is up to date.

The exported names come from running ec-s3's Prometheus class against a private
prometheus_client registry (the same metric classes vLLM passes in), not from a list
kept by hand, so a renamed family fails here.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
import prometheus_client  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from ec_s3.connector.metrics import ECS3PromMetrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "kubernetes" / "base" / "monitoring" / "ec-s3-dashboard.json"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("grafana_dashboard", ROOT / "scripts" / "grafana_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_names(vllm_config: Any) -> set[str]:
    registry = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    prom = ECS3PromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"counters": {}, "gauges": {}, "samples": {}}, 0)
    text = prometheus_client.generate_latest(registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def _queried(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dashboard["templating"]["list"]]
    return {m for e in exprs for m in re.findall(r"vllm:ec_s3_[a-z0-9_]+", e)}


def test_dashboard_is_generated_from_the_script() -> None:
    assert DASHBOARD.read_text() == _generator().render(), "run scripts/grafana_dashboard.py"


def test_every_queried_metric_is_exported(tiny_model_dir: Path) -> None:
    from support.vllm_rig import make_vllm_config

    cfg = make_vllm_config(tiny_model_dir, {"ec_connector": "ECS3Connector", "ec_role": "ec_consumer",
                                            "ec_connector_extra_config": {"bucket": "b", "startup_check": "off"}})
    exported = exported_names(cfg)
    queried = _queried(json.loads(DASHBOARD.read_text()))
    assert len(queried) >= 15
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics ec-s3 does not export: {missing}"


def test_dashboard_covers_what_operators_ask() -> None:
    titles = " ".join(p["title"].lower() for p in json.loads(DASHBOARD.read_text())["panels"])
    for topic in ("hit rate", "throughput", "latency", "fallbacks", "store health", "wait", "bytes held"):
        assert topic in titles, topic
