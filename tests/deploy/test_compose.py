"""compose.yaml: valid for Compose, and wired the way ec-s3 needs.

No Docker engine runs here, but ``docker-compose config -q`` validates a file against the
Compose schema (plus interpolation and references) without one. The test runs every
Compose CLI it finds: ``$EC_S3_COMPOSE_BIN``, a ``docker-compose`` on PATH (Debian's
package is Compose 1.29; CI's ``.ci/run`` installs it, the product's ``.ci/install``
does not), and the ``docker compose`` plugin, and skips saying so where there is none.
The structural tests need only PyYAML and always run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ec_s3.proxy.main import build_parser, config_from_args

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose.yaml"
VLLM_SERVICES = ("encoder", "pd")
LONG_RUNNING = ("minio", "seaweedfs", "encoder", "pd", "proxy", "prometheus", "grafana")
PROFILE_SETS: list[list[str]] = [[], ["epd"], ["seaweedfs"], ["seaweedfs", "epd"], ["monitoring"],
                                 ["epd", "monitoring"]]

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")


def resolve(value: str) -> str:
    """A compose string with every ``${VAR:-default}`` at its default (no environment),
    ``$$`` unescaped: what a fresh checkout runs with."""
    def sub(m: re.Match[str]) -> str:
        return m.group("default") if m.group("op") in (":-", "-") else ""

    return _VAR.sub(sub, value).replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: resolve(str(v)) for k, v in env.items()}


def command_of(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or []
    return [resolve(str(c)) for c in ([cmd] if isinstance(cmd, str) else cmd)]


# --------------------------------------------------------------------------- Compose CLIs
def _compose_clis() -> list[list[str]]:
    clis: list[list[str]] = []
    if os.environ.get("EC_S3_COMPOSE_BIN"):
        clis.append([os.environ["EC_S3_COMPOSE_BIN"]])
    if shutil.which("docker-compose"):
        clis.append(["docker-compose"])
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        clis.append([docker, "compose"])
    return clis


@pytest.mark.parametrize("profiles", PROFILE_SETS, ids=lambda p: "+".join(p) or "default")
def test_compose_cli_validates_the_file(profiles: list[str], tmp_path: Path) -> None:
    clis = _compose_clis()
    if not clis:
        pytest.skip("compose.yaml not validated against the Compose schema: no Compose CLI here "
                    "(docker-compose, `docker compose` or $EC_S3_COMPOSE_BIN); CI installs docker-compose in "
                    ".ci/run, locally: apt-get install --no-install-recommends docker-compose")
    # Only what the CLI needs: no variable of this shell may change the file's meaning.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path)}
    for cli in clis:
        args = [*cli, "-f", str(COMPOSE_FILE), "--project-directory", str(COMPOSE_FILE.parent)]
        for profile in profiles:
            args += ["--profile", profile]
        proc = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, f"{' '.join(cli)} rejects compose.yaml:\n{proc.stdout}\n{proc.stderr}"


# --------------------------------------------------------------------------- structure
def test_services_and_profiles(services: dict[str, dict[str, Any]]) -> None:
    assert {"minio", "minio-create-bucket", "seaweedfs", "encoder", "pd", "proxy"} <= set(services)
    # MinIO is the default S3 server; the EPD stack and the SeaweedFS alternative are opt-in.
    assert "profiles" not in services["minio"] and "profiles" not in services["minio-create-bucket"]
    assert services["seaweedfs"]["profiles"] == ["seaweedfs"]
    for name in ("encoder", "pd", "proxy"):
        assert services[name]["profiles"] == ["epd"], name
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name


def test_every_image_is_pinned(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        image = resolve(service["image"])
        repo, _, tag = image.rpartition(":")
        assert "@sha256:" in image or ("/" not in tag and repo and tag), f"{name}: {image!r} has no tag"
        assert tag not in ("latest", "main", "nightly", "edge"), f"{name}: {image!r} is a moving tag"
    assert resolve(services["minio"]["image"]).startswith("quay.io/minio/minio:RELEASE.")
    assert resolve(services["minio-create-bucket"]["image"]).startswith("quay.io/minio/mc:RELEASE.")
    assert resolve(services["seaweedfs"]["image"]).startswith("chrislusf/seaweedfs:")


def test_long_running_services_have_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
        assert not check.get("disable"), name
    assert services["minio"]["healthcheck"]["test"] == ["CMD", "mc", "ready", "local"]


def test_bucket_is_created_once_minio_is_healthy(services: dict[str, dict[str, Any]]) -> None:
    init = services["minio-create-bucket"]
    assert init["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert init.get("restart") == "no"  # one-shot
    script = " ".join(command_of(init))
    bucket = env_of(init)["EC_S3_BUCKET"]
    assert "mc mb --ignore-existing" in script and '"local/$EC_S3_BUCKET"' in script
    assert "http://minio:9000" in script
    # Same bucket as the vLLM instances, created with MinIO's own credentials.
    assert bucket == env_of(services["encoder"])["EC_S3_BUCKET"]
    assert env_of(init)["MINIO_ROOT_USER"] == env_of(services["minio"])["MINIO_ROOT_USER"]


def test_vllm_instances_share_one_bucket_and_use_ec_s3(services: dict[str, dict[str, Any]]) -> None:
    roles = {}
    shared = {}
    for name in VLLM_SERVICES:
        service = services[name]
        env = env_of(service)
        config = json.loads(env["EC_TRANSFER_CONFIG"])
        assert config["ec_connector"] == "ECS3Connector", name
        assert config.get("ec_connector_module_path", "ec_s3") == "ec_s3", name
        roles[name] = config["ec_role"]
        # Bucket and endpoint come from the environment (the connector's fallbacks), never
        # from per-instance extra config that could drift.
        assert "bucket" not in config.get("ec_connector_extra_config", {}), name
        assert "endpoint_url" not in config.get("ec_connector_extra_config", {}), name
        shared[name] = {k: env[k] for k in
                        ("EC_S3_BUCKET", "EC_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MODEL")}
        script = " ".join(command_of(service))
        assert '--ec-transfer-config "$EC_TRANSFER_CONFIG"' in script, name
        assert "pip install" in script and "vllm serve" in script and '"$MODEL"' in script, name
        assert resolve(service["image"]).startswith("vllm/vllm-openai:v"), name
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
    assert roles == {"encoder": "ec_producer", "pd": "ec_consumer"}
    assert shared["encoder"] == shared["pd"]
    assert shared["encoder"]["EC_S3_BUCKET"]
    # The default endpoint is the MinIO service of this file, and its credentials are MinIO's.
    assert shared["encoder"]["EC_S3_ENDPOINT_URL"] == "http://minio:9000"
    minio_env = env_of(services["minio"])
    assert shared["encoder"]["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
    assert shared["encoder"]["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]


def test_seaweedfs_alternative_serves_the_same_bucket(services: dict[str, dict[str, Any]]) -> None:
    weed = services["seaweedfs"]
    cmd = command_of(weed)
    assert cmd[0] == "mini"
    assert f"-bucket={env_of(services['encoder'])['EC_S3_BUCKET']}" in cmd
    assert "-master.telemetry=false" in cmd and "-s3.port=8333" in cmd
    env = env_of(weed)
    pd_env = env_of(services["pd"])
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (
        pd_env["AWS_ACCESS_KEY_ID"], pd_env["AWS_SECRET_ACCESS_KEY"])


def test_proxy_command_parses_and_points_at_the_instances(services: dict[str, dict[str, Any]]) -> None:
    proxy = services["proxy"]
    assert proxy["entrypoint"] == ["python3", "-m", "ec_s3.proxy"]
    config = config_from_args(build_parser().parse_args(command_of(proxy)))
    assert config.host == "0.0.0.0" and config.port == 8000
    assert config.encoder_urls == ("http://encoder:8000",)
    assert config.pd_urls == ("http://pd:8000",)
    # Keep-alive below vLLM's, so a reused upstream connection is never one being closed.
    keepalive = float(env_of(services["pd"])["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"])
    assert config.keepalive_timeout_s < keepalive


def test_published_ports_default_to_loopback(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for port in service.get("ports", []):
            assert resolve(str(port)).startswith("127.0.0.1:"), f"{name}: {port!r} is published on every interface"


def test_named_volumes_are_declared(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source!r} is not declared"


# --------------------------------------------------------------------------- monitoring
def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts (short syntax)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (COMPOSE_FILE.parent / source).resolve()
    return mounts


def test_every_bind_mount_exists(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"


def _listen_port(service: dict[str, Any]) -> int:
    """The port the service's server listens on, from its own command line."""
    text = " ".join(command_of(service))
    return int(re.search(r"--port[ =](\d+)", text).group(1))


def test_prometheus_scrapes_the_epd_services_and_loads_the_alert_rules(services: dict[str, dict[str, Any]]) -> None:
    prometheus = services["prometheus"]
    mounts = bind_mounts(prometheus)
    assert "--config.file=/etc/prometheus/prometheus.yml" in command_of(prometheus)
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
               for job in config["scrape_configs"]}
    # Every vLLM server and the proxy, at the port it really listens on.
    expected = {f"ec-s3-{name}": [f"{name}:{_listen_port(services[name])}"] for name in ("encoder", "pd", "proxy")}
    assert targets == expected
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
    # The rule file Prometheus loads is the one the Kubernetes manifests ship.
    (rule_file,) = config["rule_files"]
    assert mounts[rule_file] == (COMPOSE_FILE.parent / "deploy/kubernetes/base/monitoring/ec-s3-alerts.yaml").resolve()
    assert yaml.safe_load(mounts[rule_file].read_text())["groups"][0]["rules"]


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(services: dict[str, dict[str, Any]]) -> None:
    grafana = services["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    prometheus_port = int(services["prometheus"]["ports"][0].rsplit(":", 1)[1])
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "ec-s3.yaml").read_text())["providers"]
    dashboards = {t: s for t, s in mounts.items() if t.startswith(provider["options"]["path"] + "/")}
    # The one dashboard file, not a copy.
    assert list(dashboards.values()) == [
        (COMPOSE_FILE.parent / "deploy/kubernetes/base/monitoring/ec-s3-dashboard.json").resolve()]
    dashboard = json.loads(next(iter(dashboards.values())).read_text())
    # The dashboard picks its data source by type, so the provisioned default serves it.
    assert {"type": "datasource", "query": "prometheus"}.items() <= dashboard["templating"]["list"][0].items()
    assert env_of(grafana)["GF_SECURITY_ADMIN_PASSWORD"], "a password is set"
