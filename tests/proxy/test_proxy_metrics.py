"""The proxy's ``/metrics`` (ec_s3.proxy.metrics) and the scrape parser of the tests and
the demo (ec_s3.sandbox.metrics): both are prometheus_client's, checked here against
the exposition format's escapes, the declared families, and every call site's labels."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ec_s3.proxy.metrics import SPECS, ProxyMetrics
from ec_s3.sandbox.metrics import parse_prometheus

PROXY_DIR = Path(__file__).resolve().parents[2] / "ec_s3" / "proxy"

# Label values that need the format's escapes; `\\n` (a backslash, then n) is the one a
# parser that unescapes by chained replace() turns into a newline.
AWKWARD = ["plain", "new\nline", 'quo"te', "back\\slash", "back\\nslash-n", "\\", 'end\\"', "ünï €"]


def test_a_label_value_with_escapes_reads_back_as_written() -> None:
    """Failed before: the hand-written parser read `back\\\\nslash-n` as `back\\<newline>slash-n`."""
    text = 'm_total{a="back\\\\nslash-n",b="x\\"y",c="l1\\nl2"} 3\n'
    assert parse_prometheus(text).samples == (("m_total", (("a", "back\\nslash-n"), ("b", 'x"y'), ("c", "l1\nl2")), 3.0),)


@pytest.mark.parametrize("value", AWKWARD)
def test_proxy_label_values_round_trip_through_its_exposition(value: str) -> None:
    """What the proxy counts under a label (an upstream URL) is what a scrape reads."""
    metrics = ProxyMetrics()
    metrics.inc("ec_s3_proxy_encoder_requests_total", upstream=value, outcome="ok")
    metrics.inc("ec_s3_proxy_encoder_requests_total", upstream=value + "x", outcome="ok")
    samples = parse_prometheus(metrics.render().decode())
    assert samples.get("ec_s3_proxy_encoder_requests_total", upstream=value) == 1
    assert samples.get("ec_s3_proxy_encoder_requests_total", outcome="ok") == 2


def test_every_declared_metric_is_exposed_with_its_type_and_help() -> None:
    """Every family, counted or not, is on /metrics with its HELP and TYPE; a counter
    without labels shows 0 before its first event. Failed before: it had no sample
    until then, so Prometheus's increase() could not see that first event."""
    metrics = ProxyMetrics()
    metrics.mirror("ec_s3_proxy_known_entries", lambda: {(): 2})
    text = metrics.render().decode()
    families = {f.name + ("_total" if f.type == "counter" else ""): f for f in text_string_to_metric_families(text)}
    assert set(families) == set(SPECS)
    for name, spec in SPECS.items():
        assert (families[name].type, families[name].documentation) == (spec.kind, spec.help), name
        if spec.kind == "counter" and not spec.labels and not spec.mirrored:
            assert [(s.name, s.value) for s in families[name].samples] == [(name, 0.0)], name
    assert "_created" not in text  # prometheus_client's extra series: never exposed by the proxy
    assert parse_prometheus(text).get("ec_s3_proxy_known_entries") == 2


def test_a_series_must_carry_its_declared_labels() -> None:
    """Failed before: any labels were accepted (a typo made a series no dashboard reads),
    and a counter could be set."""
    metrics = ProxyMetrics()
    with pytest.raises(ValueError):
        metrics.inc("ec_s3_proxy_rejected_total", reasons="overloaded")
    with pytest.raises(ValueError):
        metrics.inc("ec_s3_proxy_rejected_total")
    with pytest.raises(ValueError):
        metrics.inc("ec_s3_proxy_mm_items_total", kind="x")
    with pytest.raises(TypeError):
        metrics.set("ec_s3_proxy_rejected_total", 3, reason="overloaded")
    with pytest.raises(KeyError):
        metrics.inc("ec_s3_proxy_no_such_total")
    with pytest.raises(KeyError):  # mirrored: read from the proxy's own table, never counted
        metrics.inc("ec_s3_proxy_known_forgotten_total", reason="missing")


def test_two_proxies_in_one_process_count_apart() -> None:
    a, b = ProxyMetrics(), ProxyMetrics()
    a.inc("ec_s3_proxy_mm_items_total", 3)
    assert (a.get("ec_s3_proxy_mm_items_total"), b.get("ec_s3_proxy_mm_items_total")) == (3, 0)


def _metric_calls() -> list[tuple[str, int, str, str, set[str]]]:
    """(file, line, method, metric, label names) of every ``.inc/.set/.mirror("ec_s3_proxy_...")``."""
    calls = []
    for path in sorted(PROXY_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("inc", "set", "mirror") and node.args
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("ec_s3_proxy_")):
                labels = {k.arg for k in node.keywords if k.arg is not None}
                calls.append((path.name, node.lineno, node.func.attr, node.args[0].value, labels))
    return calls


def test_every_call_site_names_a_declared_metric_with_its_labels() -> None:
    """A wrong label now raises where it is counted: check every call site, the rare
    failure paths too, without running them."""
    calls = _metric_calls()
    assert len(calls) > 30
    for file, line, method, name, labels in calls:
        where = f"{file}:{line}"
        assert name in SPECS, where
        spec = SPECS[name]
        assert spec.mirrored == (method == "mirror"), where
        assert method != "set" or spec.kind == "gauge", where
        if method != "mirror":
            assert labels == set(spec.labels), f"{where}: {name} labels {sorted(labels)} != {spec.labels}"
    assert {n for _, _, _, n, _ in calls} == set(SPECS)  # and each declared one is used
