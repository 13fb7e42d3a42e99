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

ROOT = Path(__file__).resolve().parents[2]
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
    return {m for e in exprs for m in re.findall(r"(?<![\w:])(?:vllm:ec_s3_|ec_s3_proxy_)[a-z0-9_]+", e)}


def test_dashboard_is_generated_from_the_script() -> None:
    assert DASHBOARD.read_text() == _generator().render(), "run scripts/grafana_dashboard.py"


def test_every_queried_metric_is_exported(tiny_model_dir: Path) -> None:
    from support.vllm_rig import make_vllm_config

    cfg = make_vllm_config(tiny_model_dir, {"ec_connector": "ECS3Connector", "ec_role": "ec_consumer",
                                            "ec_connector_extra_config": {"bucket": "b", "startup_check": "off"}})
    exported = exported_names(cfg) | proxy_families()
    queried = _queried(json.loads(DASHBOARD.read_text()))
    assert len(queried) >= 15
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics ec-s3 does not export: {missing}"


def test_dashboard_covers_what_operators_ask() -> None:
    titles = " ".join(p["title"].lower() for p in json.loads(DASHBOARD.read_text())["panels"])
    for topic in ("hit rate", "throughput", "latency", "fallbacks", "store health", "wait", "bytes held"):
        assert topic in titles, topic


# --------------------------------------------------------------------------- what the alerts say
ALERTS = DASHBOARD.parent / "ec-s3-alerts.yaml"
# A PromQL metric name: vLLM's ec-s3 families, the proxy's, and Prometheus's own `up`.
_METRIC = re.compile(r"(?<![\w:])(vllm:ec_s3_[a-z0-9_]+|ec_s3_proxy_[a-z0-9_]+|up(?=\s*\{))")


def _family(sample: str) -> str:
    """A histogram's `_bucket` / `_sum` / `_count` series belong to its family."""
    return re.sub(r"_(bucket|sum|count)$", "", sample)


def metrics_in(expr: str) -> set[str]:
    return {_family(m) for m in _METRIC.findall(expr)}


def _panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def _alert_rules() -> list[dict[str, Any]]:
    import yaml

    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def connector_families(vllm_config: Any) -> set[str]:
    """Every family ECS3PromMetrics registers, read back from a private registry."""
    registry = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    ECS3PromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})
    # prometheus_client names a counter's family without its `_total`; queries use the sample name.
    return {f"{f.name}_total" if f.type == "counter" else f.name for f in registry.collect()}


def proxy_families() -> set[str]:
    from ec_s3.proxy.metrics import ProxyMetrics

    return set(re.findall(r"^# TYPE (\S+) ", ProxyMetrics().render().decode(), re.M))


def test_no_two_panels_overlap() -> None:
    boxes = [(p["title"], p["gridPos"]) for p in _panels()]
    for i, (a, pa) in enumerate(boxes):
        assert pa["x"] + pa["w"] <= 24, a
        for b, pb in boxes[i + 1:]:
            apart = (pa["x"] + pa["w"] <= pb["x"] or pb["x"] + pb["w"] <= pa["x"]
                     or pa["y"] + pa["h"] <= pb["y"] or pb["y"] + pb["h"] <= pa["y"])
            assert apart, f"panels {a!r} {pa} and {b!r} {pb} overlap"


def test_every_alerts_panel_plots_the_metrics_it_watches() -> None:
    by_title = {p["title"]: p for p in _panels() if p["type"] != "row"}
    for rule in _alert_rules():
        watched = metrics_in(rule["expr"])
        assert watched, f"{rule['alert']}: its expression names no metric"
        title = rule["annotations"]["panel"]
        assert title in by_title, f"{rule['alert']}: no panel {title!r}"
        plotted = {m for t in by_title[title]["targets"] for m in metrics_in(t["expr"])}
        missing = sorted(watched - plotted)
        assert not missing, f"{rule['alert']}: panel {title!r} does not plot {missing}"


def test_every_exported_family_is_on_a_panel(tiny_model_dir: Path) -> None:
    from support.vllm_rig import make_vllm_config

    cfg = make_vllm_config(tiny_model_dir, {"ec_connector": "ECS3Connector", "ec_role": "ec_consumer",
                                            "ec_connector_extra_config": {"bucket": "b", "startup_check": "off"}})
    families = connector_families(cfg) | proxy_families()
    assert len(families) > 40 and any(f.startswith("ec_s3_proxy_") for f in families)
    plotted = {m for p in _panels() for t in p.get("targets", []) for m in metrics_in(t["expr"])}
    missing = sorted(families - plotted)
    assert not missing, f"exported but on no panel: {missing}"


def _scrape_jobs() -> set[str]:
    import yaml

    prom = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    return {job["job_name"] for job in prom["scrape_configs"]}


def test_an_alert_fires_when_a_target_is_down_or_its_metrics_vanish() -> None:
    rules = _alert_rules()
    exprs = " ".join(r["expr"] for r in rules)
    jobs = _scrape_jobs()
    # compose's job names are the Kubernetes Service names, which the ServiceMonitor uses as `job`.
    assert jobs == {"ec-s3-encoder", "ec-s3-pd", "ec-s3-proxy"}
    down = [r for r in rules if re.search(r"\bup\{", r["expr"]) and "absent" not in r["expr"]]
    assert down, "no alert on up < 1 (a target that fails its scrapes)"
    for job in jobs:
        assert re.search(rf'absent\(up\{{job="{job}"\}}\)', exprs), f"no alert when {job} leaves discovery"
    # Up but without ec-s3's families: vLLM started without the connector, a proxy of another kind.
    assert re.search(r"absent\(vllm:ec_s3_[a-z_]+\)", exprs), "no alert when vllm:ec_s3_* vanish"
    assert re.search(r"absent\(ec_s3_proxy_[a-z_]+\)", exprs), "no alert when ec_s3_proxy_* vanish"
    # An absent() series must be one that exists from start, before any traffic.
    for name in re.findall(r"absent\(((?:vllm:)?ec_s3_[a-z_]+)\)", exprs):
        assert name in {"vllm:ec_s3_breaker_open", "vllm:ec_s3_lookups_total",
                        "ec_s3_proxy_requests_in_flight", "ec_s3_proxy_upstream_up"}, name


def test_proxy_families_are_alerted() -> None:
    watched = {m for r in _alert_rules() for m in metrics_in(r["expr"])}
    for family in ("ec_s3_proxy_upstream_up", "ec_s3_proxy_internal_errors_total",
                   "ec_s3_proxy_rejected_total", "ec_s3_proxy_pd_failures_total",
                   "ec_s3_proxy_items_without_params_total"):
        assert family in watched, f"no alert watches {family}"


def _promtool() -> str:
    import shutil

    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    return path


def test_promtool_accepts_the_rules() -> None:
    import subprocess

    out = subprocess.run([_promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_target_alerts_fire_per_promtool(tmp_path: Path) -> None:
    """Prometheus's own rule engine: a pd target down, the proxy job gone, no ec-s3 families."""
    import subprocess

    import yaml

    _promtool()
    series = [
        {"series": 'up{job="ec-s3-encoder",instance="e:8000"}', "values": "1x20"},
        {"series": 'up{job="ec-s3-pd",instance="p:8000"}', "values": "0x20"},
        # no up{job="ec-s3-proxy"}, no vllm:ec_s3_*, no ec_s3_proxy_*: all vanished
    ]
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "12m", "alertname": "EcS3TargetDown", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "job": "ec-s3-pd", "instance": "p:8000"}}]},
                {"eval_time": "12m", "alertname": "EcS3TargetsMissing", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "job": "ec-s3-proxy"}}]},
                {"eval_time": "12m", "alertname": "EcS3MetricsAbsent", "exp_alerts": [
                    {"exp_labels": {"severity": "warning"}}]},
            ],
        }, {
            "interval": "1m",
            "input_series": [
                *({"series": f'up{{job="{j}",instance="i"}}', "values": "1x20"}
                  for j in ("ec-s3-encoder", "ec-s3-pd", "ec-s3-proxy")),
                {"series": 'vllm:ec_s3_breaker_open{model_name="m",engine="0"}', "values": "0x20"},
                {"series": "ec_s3_proxy_requests_in_flight", "values": "0x20"},
            ],
            "alert_rule_test": [{"eval_time": "12m", "alertname": name, "exp_alerts": []}
                                for name in ("EcS3TargetDown", "EcS3TargetsMissing", "EcS3MetricsAbsent")],
        }],
    }
    rules = {r["alert"]: r for r in _alert_rules()}
    for case in test["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                labels = alert["exp_labels"]
                alert["exp_annotations"] = {
                    k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], v)
                    for k, v in rules[check["alertname"]]["annotations"].items()}
    spec = tmp_path / "targets.test.yaml"
    spec.write_text(yaml.safe_dump(test))
    out = subprocess.run([_promtool(), "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
