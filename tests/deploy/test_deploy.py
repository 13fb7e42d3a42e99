"""deploy/kubernetes: what `kubectl apply -k` would create, checked offline.

No cluster here: :func:`render` builds each kustomization (each target, each component,
all of them) with kustomize itself (``kubectl kustomize``, or a kustomize >= 5), which
also refuses what kustomize refuses; where none is installed these tests skip. Every
rendered object is then validated against the Kubernetes schemas of a pinned version
(``kubernetes-validate``, bundled schemas, no network), and checked the way ec-s3 needs
it: every ConfigMap's ec-s3 config passes ``ECS3Config.from_extra_config`` in the
container's own environment, every ``file:`` it names is a mounted Secret key and every
``env:`` a defined variable, ``staging_dir`` is a Memory ``emptyDir`` of at least
``staging_bytes``, and the commands parse with ec-s3's own CLI parsers. Issue 27's
day-two properties are checked on every target and component: rollouts that fit a full
GPU pool and drain before they stop, PDBs that let a drain through at every replica
count, one identity per role with its own policy, the store named in ec-s3.env only, Pod
Security "restricted", bounded disks and probes, a NetworkPolicy, and images that run as
the manifests' user with pinned dependencies.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ec_s3.cli.main import build_parser as build_cli_parser
from ec_s3.config import ECS3Config
from ec_s3.proxy.main import build_parser as build_proxy_parser
from ec_s3.proxy.main import config_from_args as proxy_config_from_args
from support.dockerfile import DOCKERFILE, dockerfile_stages

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
#: The Kubernetes version whose schemas every manifest must pass: the oldest release the
#: manifests target (sidecar-free, batch/v1 CronJob, policy/v1 PDB), and the newest bundled.
K8S_VERSIONS = ("1.29.0", "1.37.0")
#: Every kustomization applied as is (the base and each overlay).
TARGETS = ("", "overlays/minio", "overlays/prometheus-operator", "overlays/aggregated")
#: The overlay of a fleet of aggregated servers (ec_both) on one bucket: no encoder.
AGGREGATED = "overlays/aggregated"
#: The optional components (components/*); each is rendered on top of the base alone, and
#: all of them together ("+all"), and must pass every check a target passes; so must the
#: aggregated overlay with all of them ("overlays/aggregated+all": they compose with it).
COMPONENTS = tuple(sorted(p.name for p in (KUSTOMIZE / "components").iterdir() if p.is_dir()))
RENDERED = (*TARGETS, *(f"+{c}" for c in COMPONENTS), "+all", f"{AGGREGATED}+all")
#: The GPU workloads, the ones a rollout or a drain must not lose requests of, and the
#: ec_role each runs: an EPD fleet (every target but one) and an aggregated one. Each is a
#: Deployment, but for the aggregated fleet's servers: a StatefulSet (its proxy lists
#: each pod by its stable name).
EPD_ROLES = {"ec-s3-encoder": "ec_producer", "ec-s3-pd": "ec_consumer"}
AGGREGATED_ROLES = {"ec-s3-pd": "ec_both"}
GPU_DEPLOYMENTS = tuple(EPD_ROLES)


#: The kit's two fleets, for the checks that render one kustomization of each.
FLEETS = ("", AGGREGATED)


def gpu_roles(target: str) -> dict[str, str]:
    """The GPU workloads of a target of :data:`RENDERED` and their ec_roles."""
    return AGGREGATED_ROLES if target.partition("+")[0] == AGGREGATED else EPD_ROLES


#: The kinds of the kit's long-running pods.
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def workload(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The one Deployment or StatefulSet called ``name``."""
    found = [o for o in objs if o["kind"] in WORKLOAD_KINDS and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one Deployment or StatefulSet {name}, found {len(found)}"
    return found[0]

#: Objects the operator creates before the first apply (docs/deploy.md); optional ones
#: are referenced with ``optional: true``.
EXTERNAL_SECRETS = {"ec-s3-encoder-credentials", "ec-s3-pd-credentials", "ec-s3-gc-credentials"}
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
CLUSTER_SCOPED = {"Namespace"}

def _find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _containers(pod_spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec.get("containers", [])


def pod_specs(objs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) of every workload."""
    for obj in objs:
        if obj["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            yield obj, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "CronJob":
            yield obj, obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def _major(version_output: str) -> int:
    m = re.search(r"v(\d+)\.\d+", version_output)
    return int(m.group(1)) if m else 0


@functools.cache
def _kustomize_cli() -> tuple[str, ...] | None:
    """A kustomize >= 5 ($EC_S3_KUSTOMIZE_BIN, kustomize, or kubectl's own); older ones
    (Debian's kubectl 1.20 has kustomize 2) lack components and labels."""
    for binary in (os.environ.get("EC_S3_KUSTOMIZE_BIN"), shutil.which("kustomize")):
        if binary:
            version = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=60).stdout
            if _major(version) >= 5:
                return (binary, "build")
    kubectl = shutil.which("kubectl")
    if kubectl:
        proc = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
        if proc.returncode == 0 and _major(json.loads(proc.stdout).get("kustomizeVersion", "")) >= 5:
            return (kubectl, "kustomize")
    return None


@functools.cache
def _build(directory: Path) -> str:
    """What kustomize prints for ``directory``, as JSON text, generated names without
    their content hash (each test reads names as the kustomizations write them)."""
    cli = _kustomize_cli()
    if cli is None:
        pytest.skip("no kustomize >= 5 here (kubectl, kustomize or $EC_S3_KUSTOMIZE_BIN): the kustomizations "
                    "cannot be built")
    proc = subprocess.run([*cli, str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cli)} rejects {directory}:\n{proc.stderr}"
    objs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    text = json.dumps(objs)
    for obj in objs:
        name = obj["metadata"]["name"]
        hashed = re.fullmatch(r"(.+)-[a-z0-9]{10}", name) if obj["kind"] in ("ConfigMap", "Secret") else None
        if hashed:
            text = text.replace(json.dumps(name), json.dumps(hashed.group(1)))
    return text


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` prints (generated names without their
    hash; a Secret's base64 values without kustomize's line breaks); a fresh copy each call."""
    objs: list[dict[str, Any]] = json.loads(_build(directory.resolve()))
    for obj in objs:
        if obj["kind"] == "Secret":
            obj["data"] = {k: re.sub(r"\s", "", v) for k, v in (obj.get("data") or {}).items()}
    return objs


def overlay(directory: Path, components: tuple[str, ...] = (), base: str = "", **fields: Any) -> Path:
    """An overlay of one's own in ``directory``: ``base`` (a target) plus ``components``
    and any other kustomization ``fields``, the way docs/deploy.md's step 2 writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(KUSTOMIZE / base, directory)],
            "components": [os.path.relpath(KUSTOMIZE / "components" / c, directory) for c in components], **fields}
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return directory


def target_directory(target: str, tmp: Path) -> Path:
    """The kustomization of a target of :data:`RENDERED`: one of the kit, or
    ``[base]+component`` (``+all``: every component) written as an overlay in ``tmp``."""
    base, plus, component = target.partition("+")
    if not plus:
        return KUSTOMIZE / target
    components = COMPONENTS if component == "all" else (component,)
    return overlay(tmp / target.replace("/", "_"), components, base=base)


def render_target(target: str, tmp: Path) -> list[dict[str, Any]]:
    return render(target_directory(target, tmp))


@pytest.fixture(scope="module", params=RENDERED, ids=lambda t: t or "base")
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_target(request.param, tmp_path_factory.mktemp("overlay"))


# --------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_the_kubernetes_schema(rendered: tuple[str, list[dict[str, Any]]], version: str) -> None:
    _, objs = rendered
    assert objs
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue  # no bundled schema: checked field by field below
        # strict: an unknown field (a typo Kubernetes would silently drop) is an error.
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)


def test_base_has_the_pieces_of_an_epd_fleet() -> None:
    objs = render(KUSTOMIZE)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert {("Deployment", "ec-s3-encoder"), ("Deployment", "ec-s3-pd"), ("Deployment", "ec-s3-proxy"),
            ("Service", "ec-s3-encoder"), ("Service", "ec-s3-pd"), ("Service", "ec-s3-proxy"),
            ("ConfigMap", "ec-s3-config"), ("ConfigMap", "ec-s3-env"),
            ("CronJob", "ec-s3-gc"), ("CronJob", "ec-s3-abort-stale-uploads"),
            ("ConfigMap", "ec-s3-grafana-dashboard"), ("ConfigMap", "ec-s3-prometheus-rules")} <= kinds
    assert not {k for k, _ in kinds} & CRD_KINDS, "CRDs belong in the optional component, not the base"
    assert _find(objs, "Deployment", "ec-s3-proxy")["spec"]["replicas"] >= 2, "the proxy is stateless: several"
    assert all(o["metadata"].get("namespace") == "ec-s3" for o in objs if o["kind"] != "Namespace")


# --------------------------------------------------------------------------- references
def _config_map_data(objs: list[dict[str, Any]], name: str) -> dict[str, str]:
    return _find(objs, "ConfigMap", name)["data"]


def container_env(objs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it (Secret values are stand-ins)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(_config_map_data(objs, src["configMapRef"]["name"]))
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            data = _config_map_data(objs, ref["name"])
            assert ref["key"] in data, f"{c['name']}: ConfigMap {ref['name']} has no key {ref['key']}"
            env[var["name"]] = data[ref["key"]]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            env[var["name"]] = "<secret>"
    return env


def _secret_keys(objs: list[dict[str, Any]], name: str, target: str) -> set[str] | None:
    """A rendered Secret's keys; None for one the operator creates (the base)."""
    found = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]
    if found:
        return set(found[0]["data"])
    assert name in EXTERNAL_SECRETS, f"{target or 'base'}: Secret {name} is neither rendered nor documented"
    return None


def mounted_files(objs: list[dict[str, Any]], pod: dict[str, Any], c: dict[str, Any], target: str) -> set[str]:
    """Paths of the Secret files the container sees."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: set[str] = set()
    for mount in c.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if not secret:
            continue
        items = secret.get("items")
        assert items, f"{c['name']}: Secret volume {mount['name']} lists no items, so its files are unknown"
        keys = _secret_keys(objs, secret["secretName"], target)
        for item in items:
            assert keys is None or item["key"] in keys, f"Secret {secret['secretName']} has no key {item['key']}"
            files.add(f"{mount['mountPath'].rstrip('/')}/{item['path']}")
    return files


def test_references_resolve(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    target, objs = rendered
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    for obj, pod in pod_specs(objs):
        name = obj["metadata"]["name"]
        assert pod.get("serviceAccountName", "default") in accounts | {"default"}, name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for v in volumes.values():
            if "secret" in v and not v["secret"].get("optional"):
                _secret_keys(objs, v["secret"]["secretName"], target)
        for c in _containers(pod):
            env = container_env(objs, c)
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}/{c['name']}: no volume {mount['name']}"
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    keys = _secret_keys(objs, ref["name"], target)
                    assert keys is None or ref["key"] in keys, f"{name}: Secret {ref['name']} has no {ref['key']}"
            # Kubernetes leaves an undefined $(VAR) as it is: the process would get the text.
            for arg in [*c.get("command", []), *c.get("args", [])]:
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in env, f"{name}/{c['name']}: $({var}) is not defined in its environment"
            ports = {p["name"] for p in c.get("ports", []) if "name" in p}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = c.get(probe, {})
                port = (handler.get("httpGet") or handler.get("tcpSocket") or {}).get("port")
                assert port is None or isinstance(port, int) or port in ports, f"{name}: {probe} port {port}"
    for svc in (o for o in objs if o["kind"] == "Service"):
        matching = [(obj, pod) for obj, pod in pod_specs(objs) if obj["kind"] in WORKLOAD_KINDS
                    and svc["spec"]["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, f"Service {svc['metadata']['name']} selects {len(matching)} workloads"
        ports = {p.get("name") for c in matching[0][1]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {svc['metadata']['name']}: no container port {port['targetPort']}"
    for sts in (o for o in objs if o["kind"] == "StatefulSet"):
        # The Service that names its pods: headless, and selecting them.
        svc = _find(objs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None", (
            f"StatefulSet {sts['metadata']['name']}: its Service is not headless")
        assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_every_image_is_pinned(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objs = rendered
    for obj, pod in pod_specs(objs):
        for c in _containers(pod):
            repo, _, tag = c["image"].rpartition(":")
            assert repo and tag and "/" not in tag, f"{obj['metadata']['name']}: {c['image']!r} has no tag"
            assert tag not in ("latest", "main", "nightly", "edge"), c["image"]


# --------------------------------------------------------------------------- ec-s3 config
def ec_containers(objs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(object, pod spec, container) of every container that runs with an ec-s3 config."""
    for obj, pod in pod_specs(objs):
        for c in _containers(pod):
            if any(v["name"] == "EC_TRANSFER_CONFIG" for v in c.get("env", [])):
                yield obj, pod, c


def _parse_quantity(q: str | int) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(q))
    assert m, f"quantity {q!r}"
    unit = m.group(2) or ""
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[unit]
    return int(m.group(1)) * scale


def _volume_at(pod: dict[str, Any], c: dict[str, Any], directory: str) -> dict[str, Any] | None:
    """The volume mounted at ``directory`` or above it (the longest mount path wins)."""
    best = None
    for mount in c.get("volumeMounts", []):
        path = mount["mountPath"].rstrip("/") or "/"
        if directory == path or directory.startswith(path + "/"):
            if best is None or len(path) > len(best["mountPath"]):
                best = mount
    if best is None:
        return None
    return next(v for v in pod["volumes"] if v["name"] == best["name"])


def test_every_ec_s3_config_is_valid_where_it_runs(rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    target, objs = rendered
    seen = set()
    for obj, pod, c in ec_containers(objs):
        name = f"{target or 'base'}:{obj['metadata']['name']}/{c['name']}"
        env = container_env(objs, c)
        transfer = json.loads(env["EC_TRANSFER_CONFIG"])
        assert transfer["ec_connector"] == "ECS3Connector", name
        extra = dict(transfer.get("ec_connector_extra_config", {}))
        files = mounted_files(objs, pod, c, target)
        # The store and the identity are named once, outside the config (issue 27 item 3).
        named = {"bucket", "endpoint_url", "region", "access_key_id", "secret_access_key", "session_token"} & set(extra)
        assert not named, f"{name}: the config names {sorted(named)}: ec-s3.env and the pod's identity do"
        credentials = env.get("AWS_SHARED_CREDENTIALS_FILE")
        assert credentials is None or credentials in files, f"{name}: {credentials} is not a mounted Secret file"
        for key, value in list(extra.items()):
            if isinstance(value, str) and value.startswith("file:"):
                path = value[len("file:"):]
                assert path in files, f"{name}: {key} names {path}, which no Secret mounts there"
                # The test's stand-in for that Secret file, so that ec-s3 can read it.
                local = tmp_path / name.replace("/", "_") / path.lstrip("/")
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_text("stand-in")
                extra[key] = f"file:{local}"
            elif isinstance(value, str) and value.startswith("env:"):
                assert value[len("env:"):] in env, f"{name}: {key} names ${value[4:]}, which the container lacks"
        config = ECS3Config.from_extra_config(extra, environ=env)
        assert config.bucket == env["EC_S3_BUCKET"], name
        seen.add((obj["metadata"]["name"], transfer["ec_role"]))
        serves = obj["kind"] in WORKLOAD_KINDS and c in pod["containers"]
        if transfer["ec_role"] in ("ec_consumer", "ec_both") and serves:
            volume = _volume_at(pod, c, config.staging_dir)
            assert volume is not None and volume.get("emptyDir", {}).get("medium") == "Memory", (
                f"{name}: staging_dir {config.staging_dir} is not on a Memory emptyDir (a container's /dev/shm is 64 MiB)")
            assert _parse_quantity(volume["emptyDir"]["sizeLimit"]) >= config.staging_bytes, (
                f"{name}: staging_dir's sizeLimit {volume['emptyDir']['sizeLimit']} < staging_bytes {config.staging_bytes}")
        if config.spool_dir and serves:
            volume = _volume_at(pod, c, config.spool_dir)
            assert volume is not None and "emptyDir" in volume, f"{name}: spool_dir {config.spool_dir} is not a volume"
            assert _parse_quantity(volume["emptyDir"]["sizeLimit"]) >= config.spool_max_bytes, name
    assert set(gpu_roles(target).items()) <= seen


def test_vllm_servers_take_the_config_from_the_configmap(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    target, objs = rendered
    roles = gpu_roles(target)
    assert not [o for o in objs if o["kind"] in WORKLOAD_KINDS and o["metadata"]["name"] not in roles
                and o["metadata"]["name"].startswith("ec-s3-") and o["metadata"]["name"] != "ec-s3-proxy"]
    models = set()
    for name, role in roles.items():
        pod = workload(objs, name)["spec"]["template"]["spec"]
        vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
        env = container_env(objs, vllm)
        args = vllm["args"]
        assert vllm["command"] == ["vllm", "serve"] and args[0] == "$(MODEL)", name
        assert "--ec-transfer-config=$(EC_TRANSFER_CONFIG)" in args, name
        transfer = json.loads(env["EC_TRANSFER_CONFIG"])
        assert transfer["ec_role"] == role, name
        models.add(env["MODEL"])
        for probe in ("readinessProbe", "startupProbe"):
            assert vllm[probe]["httpGet"]["path"] == "/health", name
        annotations = workload(objs, name)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == vllm["ports"][0]["containerPort"]
        # The pre-flight check runs first, with the same config, and stops the pod.
        check = pod["initContainers"][0]
        assert check["command"][:2] == ["ec-s3", "check"], name
        assert container_env(objs, check)["EC_TRANSFER_CONFIG"] == env["EC_TRANSFER_CONFIG"], name
        args_ns = build_cli_parser().parse_args(check["command"][1:])
        # Only a pure consumer may be checked read-only: every other role writes.
        assert args_ns.read_only == (role == "ec_consumer"), name
        if role in ("ec_producer", "ec_both"):
            extra = ECS3Config.from_extra_config(
                {**transfer["ec_connector_extra_config"], "access_key_id": None, "secret_access_key": None},
                environ=env)
            timeout = next(float(a.split("=", 1)[1]) for a in args if a.startswith("--shutdown-timeout="))
            assert timeout > extra.shutdown_timeout_s, "vLLM must wait for pending uploads on SIGTERM"
            assert pod["terminationGracePeriodSeconds"] > timeout
    assert len(models) == 1, "every vLLM server of a fleet must load the same model string"


def test_vllm_accepts_the_transfer_configs() -> None:
    """The JSON given to --ec-transfer-config is one vLLM's own config class takes."""
    pytest.importorskip("vllm")
    from vllm.config import ECTransferConfig

    for path in sorted(KUSTOMIZE.rglob("config/*.json")):
        config = ECTransferConfig(**json.loads(path.read_text()))
        assert config.ec_connector == "ECS3Connector", path


def _proxy_knows_route() -> bool:
    return "--route" in build_proxy_parser()._option_string_actions


def parse_proxy_args(args: list[str]) -> Any:
    """The proxy's ProxyConfig from a container's args, by the proxy's own parser.
    ``--route`` comes with the proxy's affinity routing (branch h/affinity); a checkout whose
    proxy lacks it parses the other args without it, and the callers check it only where the
    proxy has it."""
    if not _proxy_knows_route():
        args = [a for a in args if not a.startswith("--route=")]
    return proxy_config_from_args(build_proxy_parser().parse_args(args))


@pytest.mark.parametrize("fleet", FLEETS, ids=lambda t: t or "base")
def test_proxy_and_cronjobs_parse_with_ec_s3s_own_parsers(fleet: str) -> None:
    objs = render(KUSTOMIZE / fleet)
    proxy = _find(objs, "Deployment", "ec-s3-proxy")["spec"]["template"]["spec"]["containers"][0]
    assert proxy["command"] == ["ec-s3", "proxy"]
    config = parse_proxy_args(proxy["args"])
    # Every URL names a Service there is; an aggregated fleet has no encoder to call, and
    # lists each of its servers by the pod's own name.
    if fleet == AGGREGATED:
        assert config.encoder_urls == ()
        check_the_proxy_names_each_aggregated_server(objs, fleet)
    else:
        assert config.encoder_urls == ("http://ec-s3-encoder:8000",) and config.pd_urls == ("http://ec-s3-pd:8000",)
        for url in (*config.encoder_urls, *config.pd_urls):
            _find(objs, "Service", url.split("//")[1].split(":")[0])
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health"
    # A proxy is not restarted because prefill/decode is down: liveness is not /health.
    assert "httpGet" not in proxy["livenessProbe"]
    pd = workload(objs, "ec-s3-pd")["spec"]["template"]["spec"]["containers"][0]
    keepalive = float(next(v["value"] for v in pd["env"] if v["name"] == "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"))
    assert config.keepalive_timeout_s < keepalive


def check_proxy_drain(pod: dict[str, Any], pd_shutdown_timeout_s: float, where: str) -> None:
    """A proxy pod drains like its prefill/decode: out of the endpoints first (preStop),
    then requests in flight get as long as prefill/decode gives them, all within the pod's
    grace period (default 30 s), so a proxy rollout never cuts a generation p/d would finish."""
    (proxy,) = [c for c in pod["containers"] if c.get("command") == ["ec-s3", "proxy"]]
    config = parse_proxy_args(proxy["args"])
    pre_stop = _pre_stop_seconds(proxy)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    assert pre_stop >= 5, f"{where}: the endpoints need a moment to drop the proxy before SIGTERM"
    assert config.shutdown_timeout_s >= pd_shutdown_timeout_s, (
        f"{where}: the proxy drains {config.shutdown_timeout_s:g} s, prefill/decode {pd_shutdown_timeout_s:g} s")
    assert grace > pre_stop + config.shutdown_timeout_s, (
        f"{where}: the kubelet kills the proxy after {grace} s, before preStop ({pre_stop:g} s) and its drain "
        f"({config.shutdown_timeout_s:g} s) are over")


@pytest.mark.parametrize("fleet", FLEETS, ids=lambda t: t or "base")
def test_the_proxy_drains_as_long_as_prefill_decode(fleet: str) -> None:
    objs = render(KUSTOMIZE / fleet)
    pd = workload(objs, "ec-s3-pd")["spec"]["template"]["spec"]
    vllm = next(c for c in pd["containers"] if c["name"] == "vllm")
    check_proxy_drain(_find(objs, "Deployment", "ec-s3-proxy")["spec"]["template"]["spec"],
                      float(_arg(vllm["args"], "--shutdown-timeout")), "kustomize")


@pytest.mark.parametrize("name", ["ec-s3-gc", "ec-s3-abort-stale-uploads"])
def test_cronjob_commands_parse(name: str) -> None:
    job = _find(render(KUSTOMIZE), "CronJob", name)
    assert job["spec"]["concurrencyPolicy"] == "Forbid"
    c = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["ec-s3", "gc"]
    args = build_cli_parser().parse_args(c["command"][1:])
    assert args.older_than and not args.dry_run


# --------------------------------------------------------------------------- monitoring
MONITORING = KUSTOMIZE / "base" / "monitoring"


def test_dashboard_and_rules_configmaps_are_generated_from_the_one_file() -> None:
    objs = render(KUSTOMIZE)
    dashboard = _find(objs, "ConfigMap", "ec-s3-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {"ec-s3-dashboard.json": (MONITORING / "ec-s3-dashboard.json").read_text()}
    rules = _find(objs, "ConfigMap", "ec-s3-prometheus-rules")
    assert rules["data"] == {"ec-s3-alerts.yaml": (MONITORING / "ec-s3-alerts.yaml").read_text()}
    # kubectl apply keeps the whole object in an annotation limited to 256 KiB.
    assert len(json.dumps(dashboard)) < 200_000


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((MONITORING / "ec-s3-alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_are_well_formed_and_the_operator_gets_the_same() -> None:
    rules = alert_rules()
    assert len(rules) >= 8
    for rule in rules:
        assert re.fullmatch(r"EcS3[A-Za-z]+", rule["alert"]), rule
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert re.search(r"[<>]=? *[0-9.]+\s*$", rule["expr"].strip()), f"{rule['alert']}: no threshold"
        assert "for" not in rule or re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
    objs = render(KUSTOMIZE / "overlays" / "prometheus-operator")
    operator_rule = _find(objs, "PrometheusRule", "ec-s3")
    assert operator_rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert operator_rule["spec"]["groups"] == yaml.safe_load((MONITORING / "ec-s3-alerts.yaml").read_text())["groups"]


def test_each_alert_watches_a_dashboard_panel_and_is_documented() -> None:
    dashboard = json.loads((MONITORING / "ec-s3-dashboard.json").read_text())
    titles = {p["title"] for p in dashboard["panels"] if p["type"] != "row"}
    guide = (ROOT / "docs" / "deploy.md").read_text()
    for rule in alert_rules():
        assert rule["annotations"]["panel"] in titles, f"{rule['alert']}: no panel {rule['annotations']['panel']!r}"
        assert f"`{rule['alert']}`" in guide, f"docs/deploy.md does not explain {rule['alert']}"


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_the_guides_links_resolve() -> None:
    """Every relative link of the README, CONTRIBUTING.md and docs/ names a file that
    exists, and a heading there when it has an #anchor."""
    for doc in (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"):
        for target, anchor in re.findall(r"\]\(([^)#:]+)(?:#([^)]*))?\)", doc.read_text()):
            path = doc.parent / target
            assert path.exists(), f"{doc.name}: link {target} does not resolve"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{doc.name}: {target} has no heading #{anchor}"
    assert "(docs/deploy.md)" in (ROOT / "README.md").read_text()


def test_alert_rules_ask_only_for_exported_metrics(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    from support.vllm_rig import make_vllm_config
    from test_dashboard import exported_names

    cfg = make_vllm_config(tiny_model_dir, {"ec_connector": "ECS3Connector", "ec_role": "ec_consumer",
                                            "ec_connector_extra_config": {"bucket": "b", "startup_check": "off"}})
    exported = exported_names(cfg)
    for rule in alert_rules():
        for metric in re.findall(r"vllm:ec_s3_[a-z0-9_]+", rule["expr"]):
            assert metric in exported, f"{rule['alert']}: ec-s3 exports no {metric}"


def test_servicemonitor_scrapes_every_service() -> None:
    objs = render(KUSTOMIZE / "overlays" / "prometheus-operator")
    monitor = _find(objs, "ServiceMonitor", "ec-s3")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in objs if s["kind"] == "Service" and selector.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in scraped} == {"ec-s3-encoder", "ec-s3-pd", "ec-s3-proxy"}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        for svc in scraped:
            assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]


# --------------------------------------------------------------------------- MinIO overlay
def test_minio_overlay_is_self_contained() -> None:
    objs = render(KUSTOMIZE / "overlays" / "minio")
    env = _config_map_data(objs, "ec-s3-env")
    assert env["EC_S3_ENDPOINT_URL"] == "http://minio:9000"
    minio = _find(objs, "Deployment", "minio")["spec"]["template"]["spec"]["containers"][0]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert minio["image"] == compose["minio"]["image"], "the same pinned MinIO release as compose.yaml"
    mc = _find(objs, "Job", "minio-create-bucket")["spec"]["template"]["spec"]["containers"][0]
    assert mc["image"] == compose["minio-create-bucket"]["image"]
    assert '"local/$EC_S3_BUCKET"' in mc["args"][0] and "EC_S3_BUCKET" in container_env(objs, mc)
    # MinIO's root user is the identity every role's credentials file names.
    root = {k: base64.b64decode(v).decode() for k, v in _find(objs, "Secret", "minio-root")["data"].items()}
    refs = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in minio["env"]}
    assert refs["MINIO_ROOT_USER"] == {"name": "minio-root", "key": "user"}
    assert refs["MINIO_ROOT_PASSWORD"] == {"name": "minio-root", "key": "password"}
    import configparser

    for role in ("encoder", "pd", "gc"):
        ini = configparser.ConfigParser()
        ini.read_string(base64.b64decode(_find(objs, "Secret", f"ec-s3-{role}-credentials")["data"]["credentials"]).decode())
        assert (ini["default"]["aws_access_key_id"], ini["default"]["aws_secret_access_key"]) == (root["user"], root["password"])


# --------------------------------------------------------------------------- aggregated overlay (issue 32)
#: The keys an ec_both server uses as a consumer and as a producer: its config sets each
#: one, so that none silently falls back to a default sized for another role.
CONSUMER_KEYS = {"lookup", "staging_dir", "staging_bytes"}
PRODUCER_KEYS = {"max_inflight_bytes", "backpressure", "shutdown_timeout_s", "spool_dir", "spool_max_bytes"}


def test_aggregated_overlay_is_a_fleet_of_ec_both_servers_on_one_bucket() -> None:
    """No encoder anywhere (objects, Service URLs, its Secret), prefill/decode runs the
    ec_both config with both roles' keys, and the pods publish (checked read/write)."""
    objs = render(KUSTOMIZE / AGGREGATED)
    assert not [o for o in objs if "encoder" in o["metadata"]["name"]], "the encoder's objects are deleted"
    text = json.dumps([o for o in objs if o["kind"] != "ConfigMap"])
    assert "ec-s3-encoder" not in text, "something still names the encoder (a URL, its Secret, its account)"
    pod = _find(objs, "StatefulSet", "ec-s3-pd")["spec"]["template"]["spec"]
    for c in _containers(pod):
        transfer = json.loads(container_env(objs, c)["EC_TRANSFER_CONFIG"])
        assert transfer["ec_role"] == "ec_both", c["name"]
        extra = transfer["ec_connector_extra_config"]
        assert CONSUMER_KEYS | PRODUCER_KEYS <= set(extra), sorted(CONSUMER_KEYS | PRODUCER_KEYS - set(extra))
        assert extra["lookup"] == "always", "an ec_both server loads what another one encoded"
    # The EPD configs stay in the ConfigMap (the base generates them), used by no pod.
    assert {"producer.json", "consumer.json", "aggregated.json"} == set(_config_map_data(objs, "ec-s3-config"))


def check_the_proxy_names_each_aggregated_server(objs: list[dict[str, Any]], where: str) -> list[str]:
    """The aggregated servers are a StatefulSet behind a headless Service, and the proxy
    lists each of its pods by the stable name they get: one ``--pd-url`` per replica,
    ``http://<statefulset>-<i>.<service>:<container port>`` (the namespace may follow),
    every one derived here from the rendered objects. Affinity routing hashes an image
    over the proxy's URLs: through one Service URL it would have a single upstream and
    route nothing. Returns the pods' URLs."""
    assert not [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "ec-s3-pd"], (
        f"{where}: prefill/decode is still a Deployment: its pods have no stable names to list")
    servers = [o for o in objs if o["kind"] == "StatefulSet"
               and o["metadata"].get("labels", {}).get("ec-s3/ec-role") == "ec_both"]
    assert len(servers) == 1, f"{where}: {len(servers)} StatefulSets labelled ec-s3/ec-role: ec_both"
    sts = servers[0]
    spec, namespace = sts["spec"], sts["metadata"]["namespace"]
    labels = spec["template"]["metadata"]["labels"]
    assert _selects(spec["selector"], labels), f"{where}: the StatefulSet's selector misses its own pods"
    svc = _find(objs, "Service", spec["serviceName"])
    assert svc["metadata"]["namespace"] == namespace
    assert svc["spec"].get("clusterIP") == "None", f"{where}: pod DNS names need a headless Service (clusterIP: None)"
    # The only Service of those pods: a second one would make the ServiceMonitor scrape each
    # pod twice (and double every sum the alerts take).
    selecting = [s["metadata"]["name"] for s in objs if s["kind"] == "Service"
                 and s["spec"].get("selector") and s["spec"]["selector"].items() <= labels.items()]
    assert selecting == [svc["metadata"]["name"]], f"{where}: Services {selecting} select the aggregated servers"
    assert spec["podManagementPolicy"] == "Parallel", f"{where}: the servers start together, not one by one"
    assert spec.get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate", where
    assert not spec.get("volumeClaimTemplates"), f"{where}: the pods keep the base's volumes"
    replicas = spec.get("replicas", 1)
    assert replicas >= 2, f"{where}: affinity over one server routes nothing"
    vllm = next(c for c in spec["template"]["spec"]["containers"] if c["name"] == "vllm")
    (port,) = [p["containerPort"] for p in vllm["ports"]
               if p.get("name") in [sp["targetPort"] for sp in svc["spec"]["ports"]]]
    assert int(_arg(vllm["args"], "--port")) == port, f"{where}: vLLM does not listen on its container port"
    proxy = _find(objs, "Deployment", "ec-s3-proxy")
    (container,) = proxy["spec"]["template"]["spec"]["containers"]
    config = parse_proxy_args(container["args"])
    if _proxy_knows_route():
        assert config.route == "affinity", where
    got = []
    for url in config.pd_urls:
        parts = urllib.parse.urlsplit(url)
        assert parts.scheme == "http" and parts.path in ("", "/") and parts.hostname, f"{where}: --pd-url={url}"
        pod, _, rest = parts.hostname.partition(".")
        service, _, domain = rest.partition(".")
        # <pod>.<service> resolves through the proxy pod's search path, in its own namespace;
        # <pod>.<service>.<namespace>[.svc[.cluster.local]] anywhere.
        ns, _, suffix = domain.partition(".")
        assert suffix in ("", "svc", "svc.cluster.local"), f"{where}: --pd-url={url}"
        assert (ns or proxy["metadata"]["namespace"]) == namespace, (
            f"{where}: --pd-url={url} names a pod outside the namespace {namespace}")
        got.append(f"http://{pod}.{service}:{parts.port}")
    want = [f"http://{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}" for i in range(replicas)]
    assert len(set(got)) == len(got), f"{where}: a server listed twice: {config.pd_urls}"
    assert sorted(got) == sorted(want), (
        f"{where}: the proxy's --pd-url list {list(config.pd_urls)} is not the {replicas} pods of StatefulSet "
        f"{sts['metadata']['name']} ({want}): scale the StatefulSet and the list together")
    return want


@pytest.mark.parametrize("target", [AGGREGATED, f"{AGGREGATED}+all"])
def test_the_aggregated_proxy_names_each_server(target: str, tmp_path: Path) -> None:
    """With every component too: they keep composing with the StatefulSet."""
    check_the_proxy_names_each_aggregated_server(render_target(target, tmp_path), target)


def test_the_guides_aggregated_scaling_overlay_builds(tmp_path: Path) -> None:
    """docs/deploy.md's way to scale the aggregated fleet (a ``replicas:`` entry and the
    proxy's args with one URL per pod) renders, scales the StatefulSet, lists every pod,
    and keeps every other arg of the overlay's proxy."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```yaml\n(# my-aggregated-fleet/kustomization.yaml.*?)```", guide, re.S)
    assert block, "docs/deploy.md lost its example of scaling the aggregated fleet"
    fleet = tmp_path / "my-aggregated-fleet"
    fleet.mkdir()
    (fleet / "kustomization.yaml").write_text(block.group(1).replace("../deploy/kubernetes",
                                                                     os.path.relpath(KUSTOMIZE, fleet)))
    objs = render(fleet)
    (count,) = [r["count"] for r in yaml.safe_load(block.group(1))["replicas"] if r["name"] == "ec-s3-pd"]
    assert _find(objs, "StatefulSet", "ec-s3-pd")["spec"]["replicas"] == count != 2, "the example scales"
    assert len(check_the_proxy_names_each_aggregated_server(objs, "docs/deploy.md")) == count

    def other_args(o: list[dict[str, Any]]) -> list[str]:
        (proxy,) = _find(o, "Deployment", "ec-s3-proxy")["spec"]["template"]["spec"]["containers"]
        return [a for a in proxy["args"] if not a.startswith("--pd-url=")]

    assert other_args(objs) == other_args(render(KUSTOMIZE / AGGREGATED)), "the example drops or changes a proxy arg"
    cli = _kustomize_cli()
    if cli is not None:
        proc = subprocess.run([*cli, str(fleet)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        (sts,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "StatefulSet"]
        assert sts["spec"]["replicas"] == count


# --------------------------------------------------------------------------- the commands, run
def _run_as_in_the_pod(objs: list[dict[str, Any]], c: dict[str, Any], s3_endpoint: Any, bucket: str,
                       secrets_dir: Path) -> subprocess.CompletedProcess[str]:
    """The container's ec-s3 command, with its environment and $(VAR) expansion, run here
    against the test's S3 server; the Secret's mount is ``secrets_dir``."""
    env = container_env(objs, c)
    env.update(EC_S3_BUCKET=bucket, EC_S3_ENDPOINT_URL=s3_endpoint.url)
    if "AWS_SHARED_CREDENTIALS_FILE" in env:
        env["AWS_SHARED_CREDENTIALS_FILE"] = str(secrets_dir / Path(env["AWS_SHARED_CREDENTIALS_FILE"]).name)
    argv = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in c["command"]]
    assert argv[0] == "ec-s3"
    path = sys.path
    if c["image"].split(":")[0].endswith("/ec-s3"):
        # The slim image has neither torch nor vLLM: any import of them fails here too.
        blocker = secrets_dir.parent / "slim-image"
        blocker.mkdir(exist_ok=True)
        (blocker / "sitecustomize.py").write_text(
            "import sys\n"
            "class _NotInTheSlimImage:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'vllm', 'safetensors'):\n"
            "            raise ImportError(name + ' is not in the slim image (deploy/Dockerfile, target slim)')\n"
            "sys.meta_path.insert(0, _NotInTheSlimImage())\n")
        path = [str(blocker), *sys.path]
    proc_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(path), **env}
    return subprocess.run([sys.executable, "-m", "ec_s3.cli", *argv[1:]], env=proc_env, capture_output=True,
                          text=True, timeout=120)


def _write_credentials_file(path: Path, key_id: str, secret: str) -> None:
    """What the operator puts in a role's Secret (key ``credentials``): an AWS credentials file."""
    path.write_text(f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")


@pytest.mark.parametrize("fleet", FLEETS, ids=lambda t: t or "base")
def test_preflight_check_passes_or_stops_the_pod_with_its_diagnosis(fleet: str, s3_endpoint: Any, bucket: str,
                                                                    tmp_path: Path) -> None:
    objs = render(KUSTOMIZE / fleet)
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d, secret in ((good, s3_endpoint.credentials.secret_access_key), (bad, "not-the-secret")):
        d.mkdir()
        _write_credentials_file(d / "credentials", s3_endpoint.credentials.access_key_id, secret)
    for name, role in gpu_roles(fleet).items():
        check = workload(objs, name)["spec"]["template"]["spec"]["initContainers"][0]
        ok = _run_as_in_the_pod(objs, check, s3_endpoint, bucket, good)
        assert ok.returncode == 0 and "PASS" in ok.stdout, f"{name}:\n{ok.stdout}\n{ok.stderr}"
        if role != "ec_consumer":  # a server that publishes proves its writes before it starts
            assert "PASS: read/write access" in ok.stdout and re.search(r"ok\s+put ", ok.stdout), f"{name}: {ok.stdout}"
        # Exit status 1 fails the init container, so the pod (and the rollout) stops here,
        # and its output, the termination message, says why and what to do.
        failed = _run_as_in_the_pod(objs, check, s3_endpoint, bucket, bad)
        assert failed.returncode == 1, f"{name}:\n{failed.stdout}\n{failed.stderr}"
        assert "FAIL" in failed.stdout and "fix" in failed.stdout, failed.stdout
        assert "not-the-secret" not in failed.stdout + failed.stderr


@pytest.mark.parametrize("name", ["ec-s3-gc", "ec-s3-abort-stale-uploads"])
def test_gc_cronjob_runs(name: str, s3_endpoint: Any, bucket: str, tmp_path: Path) -> None:
    objs = render(KUSTOMIZE)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    _write_credentials_file(secrets / "credentials", s3_endpoint.credentials.access_key_id,
                            s3_endpoint.credentials.secret_access_key)
    c = _find(objs, "CronJob", name)["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    proc = _run_as_in_the_pod(objs, c, s3_endpoint, bucket, secrets)
    assert proc.returncode == 0, f"{name}:\n{proc.stdout}\n{proc.stderr}"


def test_the_guides_overlay_builds(tmp_path: Path) -> None:
    """docs/deploy.md's step 2 (your own overlay) renders, and sets what it says it sets."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```yaml\n(# my-fleet/kustomization.yaml\n.*?)```", guide, re.S)
    assert block, "docs/deploy.md lost its overlay example"
    fleet = tmp_path / "my-fleet"
    fleet.mkdir()
    # The guide's overlay sits beside deploy/; here it is elsewhere, so point it home.
    text = block.group(1).replace("../deploy/kubernetes", os.path.relpath(KUSTOMIZE, fleet))
    (fleet / "kustomization.yaml").write_text(text)
    objs = render(fleet)
    env = _config_map_data(objs, "ec-s3-env")
    assert env["EC_S3_BUCKET"] == "my-ec-cache" and env["EC_S3_ENDPOINT_URL"] == ""
    images = {c["image"] for _, pod in pod_specs(objs) for c in _containers(pod)}
    assert images == {"registry.example.com/ec-s3-vllm:0.1.0-vllm0.34.0", "registry.example.com/ec-s3:0.1.0"}
    # A bucket outside us-east-1, IRSA, tainted GPU nodes, the weights on a claim.
    assert env["AWS_REGION"] == "eu-west-1"
    for role in ("encoder", "pd", "gc"):
        arn = _find(objs, "ServiceAccount", f"ec-s3-{role}")["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        assert arn == f"arn:aws:iam::444455556666:role/my-ec-s3-{role}", "the guide's ARNs replace the component's"
    for obj, pod in pod_specs(objs):
        assert not [v for v in pod.get("volumes", []) if "secret" in v], obj["metadata"]["name"]
    for name in GPU_DEPLOYMENTS:
        pod = _find(objs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["tolerations"] and {"persistentVolumeClaim": {"claimName": "ec-s3-models"}, "name": "hf-cache"} in pod["volumes"]
    assert _find(objs, "PersistentVolumeClaim", "ec-s3-models")["spec"]["storageClassName"] == "efs-sc"
    for obj in objs:
        if obj["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(copy.deepcopy(obj), K8S_VERSIONS[0], strict=True)
    cli = _kustomize_cli()
    if cli is not None:
        proc = subprocess.run([*cli, str(fleet)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- rollouts and drains (issue 27 item 1)
#: Each rollout strategy the kit renders: the components that select it.
STRATEGIES = {"full-pool": (), "surge": ("surge-rollout",)}


def _count(value: int | str, replicas: int, round_up: bool) -> int:
    """An int-or-percent field of a Deployment or PDB, as Kubernetes resolves it."""
    if isinstance(value, int):
        return value
    percent = int(value.rstrip("%"))
    return -(-replicas * percent // 100) if round_up else replicas * percent // 100


def _arg(args: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} given {len(values)} times"
    return values[0]


def _pre_stop_seconds(c: dict[str, Any]) -> float:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


@pytest.mark.parametrize("fleet", FLEETS, ids=lambda t: t or "base")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gpu_rollout_loses_no_request(strategy: str, fleet: str, tmp_path: Path) -> None:
    """Each strategy, rendered: it progresses on the GPUs it says it needs (the default on
    a pool with none to spare), and an old pod drains: out of the endpoints first
    (preStop), then vLLM finishes in-flight requests (--shutdown-timeout > 0), all within
    the grace period. A StatefulSet (the aggregated fleet's servers) has no surge: under
    either strategy it replaces one pod at a time, each stopped before its successor starts."""
    objs = render(overlay(tmp_path / strategy, STRATEGIES[strategy], base=fleet))
    for name in gpu_roles(fleet):
        deployment = workload(objs, name)
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(copy.deepcopy(deployment), version, strict=True)
        replicas = deployment["spec"]["replicas"]
        stateful = deployment["kind"] == "StatefulSet"
        if stateful:
            update = deployment["spec"].get("updateStrategy", {})
            assert update.get("type", "RollingUpdate") == "RollingUpdate", f"{name}: OnDelete never rolls"
            assert not update.get("rollingUpdate", {}).get("partition"), f"{name}: a partition holds pods back"
            rolling = {"maxSurge": 0, "maxUnavailable": update.get("rollingUpdate", {}).get("maxUnavailable", 1)}
        else:
            rolling = deployment["spec"]["strategy"]["rollingUpdate"]
        pod = deployment["spec"]["template"]["spec"]
        vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
        gpus = int(vllm["resources"]["requests"]["nvidia.com/gpu"])
        for count in sorted({replicas, 1, 2, 3, 8}):
            surge = _count(rolling["maxSurge"], count, round_up=True)
            unavailable = _count(rolling["maxUnavailable"], count, round_up=False)
            assert surge + unavailable >= 1, f"{name}: a rollout of {count} replicas cannot progress"
            if strategy == "full-pool" or stateful:
                # Nothing beyond the replicas' own GPUs: never a Pending surge pod.
                assert surge == 0 and unavailable == 1, f"{name} ({count} replicas): needs {surge * gpus} spare GPUs"
            else:
                assert unavailable == 0 and surge * gpus == gpus, f"{name}: the surge variant keeps every replica serving"
        pre_stop = _pre_stop_seconds(vllm)
        timeout = int(_arg(vllm["args"], "--shutdown-timeout"))
        assert pre_stop >= 5, f"{name}: the endpoints need a moment to drop the pod before SIGTERM"
        assert timeout > 0, f"{name}: vLLM's default --shutdown-timeout 0 aborts in-flight requests"
        assert pod["terminationGracePeriodSeconds"] > pre_stop + timeout, (
            f"{name}: the kubelet kills the pod after {pod['terminationGracePeriodSeconds']} s, before preStop "
            f"({pre_stop:g} s) and the drain ({timeout} s) are over")
        assert vllm["readinessProbe"]["httpGet"]["path"] == "/health", f"{name}: a new pod serves once ready"
        if name == "ec-s3-pd":
            assert timeout >= 60, "prefill/decode: a long generation needs its minute"


@pytest.mark.parametrize("fleet", FLEETS, ids=lambda t: t or "base")
def test_vllm_parses_the_drain_flags(fleet: str) -> None:
    """The GPU containers' args, as vLLM's own `vllm serve` parser reads them."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    objs = render(KUSTOMIZE / fleet)
    parser = make_arg_parser(FlexibleArgumentParser())
    for name in gpu_roles(fleet):
        vllm = next(c for c in workload(objs, name)["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "vllm")
        env = container_env(objs, vllm)
        args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in vllm["args"]]
        parsed = parser.parse_args(args)
        assert parsed.shutdown_timeout == int(_arg(vllm["args"], "--shutdown-timeout")) > 0, name


def _allowed_disruptions(pdb: dict[str, Any], replicas: int) -> int:
    """What the eviction API allows with every one of ``replicas`` pods healthy."""
    spec = pdb["spec"]
    if "maxUnavailable" in spec:
        return min(replicas, _count(spec["maxUnavailable"], replicas, round_up=True))
    return max(0, replicas - _count(spec["minAvailable"], replicas, round_up=True))


def test_every_pdb_lets_a_drain_through_at_every_replica_count(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """`kubectl drain` evicts one pod of each budget at every replica count: the one each
    target renders, and any an operator scales to."""
    target, objs = rendered
    budgets = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert {b["metadata"]["name"] for b in budgets} >= {"ec-s3-proxy", *gpu_roles(target)}
    for pdb in budgets:
        selector = pdb["spec"]["selector"]["matchLabels"]
        selected = [o for o in objs if o["kind"] in WORKLOAD_KINDS
                    and selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"PDB {pdb['metadata']['name']} selects {len(selected)} workloads"
        for replicas in sorted({selected[0]["spec"]["replicas"], *range(1, 9)}):
            assert _allowed_disruptions(pdb, replicas) >= 1, (
                f"{target or 'base'}: PDB {pdb['metadata']['name']} allows no eviction at {replicas} replica(s): "
                "kubectl drain blocks forever")


@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
def test_the_proxy_pdb_drains_at_each_replica_count(replicas: int, tmp_path: Path) -> None:
    objs = render(overlay(tmp_path, patches=[{"patch": yaml.safe_dump(
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "ec-s3-proxy"},
         "spec": {"replicas": replicas}})}]))
    assert _find(objs, "Deployment", "ec-s3-proxy")["spec"]["replicas"] == replicas
    assert _allowed_disruptions(_find(objs, "PodDisruptionBudget", "ec-s3-proxy"), replicas) >= 1
    assert _allowed_disruptions(_find(objs, "PodDisruptionBudget", "ec-s3-proxy"), 1) == 1, "the minio overlay's count"


# --------------------------------------------------------------------------- one identity per role (issue 27 item 2)
IAM = ROOT / "deploy" / "iam"
#: Each role: the workloads that run as it, and the S3 actions its policy grants (no more).
ROLES = {
    "encoder": ({"ec-s3-encoder"}, {"s3:PutObject", "s3:GetObject", "s3:AbortMultipartUpload", "s3:ListBucket"}),
    "pd": ({"ec-s3-pd"}, {"s3:GetObject", "s3:ListBucket"}),
    "gc": ({"ec-s3-gc", "ec-s3-abort-stale-uploads"},
           {"s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListBucket", "s3:ListBucketMultipartUploads"}),
}
#: overlays/aggregated: each identity it keeps, and the role whose policy it needs. No
#: encoder identity; its prefill/decode pods publish what they encode, so the pd identity
#: needs the encoder's rights (its kustomization.yaml and docs/deploy.md say so).
AGGREGATED_POLICIES = {"pd": "encoder", "gc": "gc"}


def _s3_secrets(objs: list[dict[str, Any]], pod: dict[str, Any]) -> set[str]:
    """The credential Secrets a pod reads (volumes and env)."""
    names = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for c in _containers(pod):
        names |= {v["valueFrom"]["secretKeyRef"]["name"] for v in c.get("env", [])
                  if "secretKeyRef" in v.get("valueFrom", {})}
    return {n for n in names if n.endswith("-credentials")}


def test_each_role_has_its_own_identity_and_only_its_rights(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    target, objs = rendered
    env = _config_map_data(objs, "ec-s3-env")
    prefix = ECS3Config.from_extra_config({}, environ=env).prefix
    irsa = target.endswith(("+irsa", "+all"))
    aggregated = target.partition("+")[0] == AGGREGATED
    policies = AGGREGATED_POLICIES if aggregated else {r: r for r in ROLES}
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    assert accounts == {"ec-s3-proxy", *(f"ec-s3-{r}" for r in policies)}, f"{target or 'base'}: {sorted(accounts)}"
    if aggregated:
        documented = (KUSTOMIZE / AGGREGATED / "kustomization.yaml").read_text()
        assert "deploy/iam/encoder-policy.json" in documented, "the pd keys must be an encoder's: say so"
    for role, needs in policies.items():
        workloads, actions = ROLES[role][0], ROLES[needs][1]
        account = _find(objs, "ServiceAccount", f"ec-s3-{role}")
        assert account["automountServiceAccountToken"] is False, role
        for obj, pod in pod_specs(objs):
            if obj["metadata"]["name"] in workloads:
                assert pod["serviceAccountName"] == f"ec-s3-{role}", obj["metadata"]["name"]
                assert _s3_secrets(objs, pod) == (set() if irsa else {f"ec-s3-{role}-credentials"}), (
                    f"{obj['metadata']['name']} reads another role's keys")
        policy = json.loads((IAM / f"{needs}-policy.json").read_text())
        granted: set[str] = set()
        for statement in policy["Statement"]:
            assert statement["Effect"] == "Allow"
            granted |= set([statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"])
            resource = statement["Resource"]
            if statement["Action"] in ("s3:ListBucket", "s3:ListBucketMultipartUploads"):
                assert resource == f"arn:aws:s3:::{env['EC_S3_BUCKET']}", role
            else:
                assert resource == f"arn:aws:s3:::{env['EC_S3_BUCKET']}/{prefix}/*", f"{role}: only the prefix"
        assert granted == actions, f"{role}: {sorted(granted ^ actions)}"
        if irsa:
            assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(f":role/ec-s3-{role}")
    proxy = _find(objs, "Deployment", "ec-s3-proxy")["spec"]["template"]["spec"]
    assert proxy["serviceAccountName"] == "ec-s3-proxy" and not _s3_secrets(objs, proxy)
    # One role's Secret, one role's pods: no Secret is shared.
    used = [s for _, pod in pod_specs(objs) for s in _s3_secrets(objs, pod)]
    assert len(set(used)) == (0 if irsa else len(policies))


def test_irsa_leaves_no_secret_behind(tmp_path: Path) -> None:
    """With components/irsa no pod waits for a Secret that never comes, and every ec-s3
    process finds its credentials through the AWS chain alone."""
    objs = render(overlay(tmp_path, ("irsa",)))
    for obj, pod in pod_specs(objs):
        assert not [v for v in pod.get("volumes", []) if "secret" in v and not v["secret"].get("optional")], obj["metadata"]["name"]
        for c in _containers(pod):
            assert "AWS_SHARED_CREDENTIALS_FILE" not in {v["name"] for v in c.get("env", [])}, c["name"]
            assert not [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/var/run/secrets/ec-s3"], c["name"]


# --------------------------------------------------------------------------- region and endpoint (issue 27 item 3)
def test_no_config_names_the_store_and_the_env_file_region_wins(s3_endpoint: Any, bucket: str, tmp_path: Path) -> None:
    """Region and endpoint come from ec-s3.env alone: a bucket outside us-east-1 is one
    line there, and `ec-s3 check` (as each pod runs it) signs for that region."""
    for path in sorted(KUSTOMIZE.rglob("config/*.json")):
        extra = json.loads(path.read_text())["ec_connector_extra_config"]
        assert not {"region", "endpoint_url", "bucket"} & set(extra), f"{path}: the store is named in ec-s3.env"
    objs = render(overlay(tmp_path / "eu", configMapGenerator=[
        {"name": "ec-s3-env", "namespace": "ec-s3", "behavior": "merge", "literals": ["AWS_REGION=eu-central-1"]}]))
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    _write_credentials_file(secrets / "credentials", s3_endpoint.credentials.access_key_id,
                            s3_endpoint.credentials.secret_access_key)
    for obj, pod, c in ec_containers(objs):
        region = next(v for v in c["env"] if v["name"] == "AWS_REGION")
        # In env, not only envFrom: the EKS webhook adds AWS_REGION only where it is absent.
        assert region["valueFrom"]["configMapKeyRef"] == {"name": "ec-s3-env", "key": "AWS_REGION"}, c["name"]
        assert container_env(objs, c)["AWS_REGION"] == "eu-central-1"
    check = _find(objs, "Deployment", "ec-s3-pd")["spec"]["template"]["spec"]["initContainers"][0]
    proc = _run_as_in_the_pod(objs, check, s3_endpoint, bucket, secrets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "region: eu-central-1 (from AWS_REGION)" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- real-cluster knobs (issue 27 item 4)
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}


def test_every_pod_meets_pod_security_restricted(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The rules of the "restricted" Pod Security Standard, which the namespace enforces."""
    target, objs = rendered
    namespace = _find(objs, "Namespace", "ec-s3")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj, pod in pod_specs(objs):
        name = f"{target or 'base'}:{obj['metadata']['name']}"
        context = pod.get("securityContext", {})
        assert not {"hostNetwork", "hostPID", "hostIPC"} & {k for k, v in pod.items() if v}, name
        for volume in pod.get("volumes", []):
            assert set(volume) - {"name"} <= _RESTRICTED_VOLUMES, f"{name}: volume {volume['name']}"
        for c in _containers(pod):
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", context.get("runAsNonRoot")) is True, f"{name}/{c['name']}: runAsNonRoot"
            assert sc.get("runAsUser", context.get("runAsUser")) not in (0, None), f"{name}/{c['name']}: a numeric non-root user"
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}"
            assert not sc.get("privileged"), f"{name}/{c['name']}"
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), f"{name}/{c['name']}: capabilities.drop [ALL]"
            assert set(sc.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, f"{name}/{c['name']}"
            seccomp = sc.get("seccompProfile", context.get("seccompProfile", {})).get("type")
            assert seccomp in ("RuntimeDefault", "Localhost"), f"{name}/{c['name']}: seccompProfile"
            assert not [p for p in c.get("ports", []) if p.get("hostPort")], f"{name}/{c['name']}"


def test_probes_resources_and_disks_are_bounded(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Every probe has a timeout (the default 1 s fails a busy vLLM's /health), every
    container asks for ephemeral storage, and no disk volume is unbounded: the pod's
    request covers its emptyDirs, so a node is never filled into DiskPressure."""
    target, objs = rendered
    for obj, pod in pod_specs(objs):
        name = f"{target or 'base'}:{obj['metadata']['name']}"
        disks = [v for v in pod.get("volumes", []) if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"]
        for v in disks:
            assert "sizeLimit" in v["emptyDir"], f"{name}: emptyDir {v['name']} is unbounded"
        requested = 0
        for c in _containers(pod):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    assert c[probe].get("timeoutSeconds", 1) >= 2, f"{name}/{c['name']}: {probe} without timeoutSeconds"
            ephemeral = c.get("resources", {}).get("requests", {}).get("ephemeral-storage")
            assert ephemeral, f"{name}/{c['name']}: no ephemeral-storage request"
            if c in pod["containers"]:
                requested += _parse_quantity(ephemeral)
        assert requested >= sum(_parse_quantity(v["emptyDir"]["sizeLimit"]) for v in disks), (
            f"{name}: ephemeral-storage requests below its emptyDirs' sizeLimits")


@pytest.mark.parametrize("fleet", FLEETS, ids=lambda t: t or "base")
def test_the_proxy_spreads_and_the_gpu_pods_reach_gpu_nodes(fleet: str, tmp_path: Path) -> None:
    objs = render(KUSTOMIZE / fleet)
    proxy = _find(objs, "Deployment", "ec-s3-proxy")["spec"]["template"]
    spread = {t["topologyKey"]: t for t in proxy["spec"]["topologySpreadConstraints"]}
    assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= set(spread)
    for t in spread.values():
        assert t["labelSelector"]["matchLabels"].items() <= proxy["metadata"]["labels"].items()
    objs = render(overlay(tmp_path / "gpu", ("gpu-nodes", "model-pvc"), base=fleet))
    claim = _find(objs, "PersistentVolumeClaim", "ec-s3-models")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every GPU pod mounts the one claim"
    for name in gpu_roles(fleet):
        pod = workload(objs, name)["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"], name
        assert pod["nodeSelector"] and pod["runtimeClassName"] == "nvidia", name
        cache = next(v for v in pod["volumes"] if v["name"] == "hf-cache")
        assert cache == {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "ec-s3-models"}}, name
        vllm = pod["containers"][0]
        env = container_env(objs, vllm)
        assert _volume_at(pod, vllm, env["HF_HOME"]) is cache, f"{name}: HF_HOME is not on the claim"
    # The proxy and gc stay off GPU nodes: no toleration for them.
    for obj, pod in pod_specs(objs):
        if obj["metadata"]["name"] not in gpu_roles(fleet):
            assert "tolerations" not in pod, obj["metadata"]["name"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] in ("In", "NotIn", "Exists", "DoesNotExist"), expr
        present, value = expr["key"] in labels, labels.get(expr["key"])
        ok = {"In": present and value in expr.get("values", []), "NotIn": not present or value not in expr["values"],
              "Exists": present, "DoesNotExist": not present}[expr["operator"]]
        if not ok:
            return False
    return True


@pytest.mark.parametrize("base", ["overlays/minio", AGGREGATED])
def test_vllm_pods_are_reachable_only_through_the_proxy(base: str, tmp_path: Path) -> None:
    objs = render(overlay(tmp_path, ("network-policy",), base=base))
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert policies
    pods = {obj["metadata"]["name"]: (obj["spec"]["jobTemplate"]["spec"] if obj["kind"] == "CronJob" else obj["spec"])
            ["template"].get("metadata", {}).get("labels", {}) for obj, _ in pod_specs(objs)}
    for name, labels in pods.items():
        applying = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        if name not in gpu_roles(base):
            continue
        assert applying and all("Ingress" in p["spec"]["policyTypes"] for p in applying), f"{name} is open"
        for policy in applying:
            for rule in policy["spec"]["ingress"]:
                assert [p["port"] for p in rule["ports"]] == [8000]
                for peer in rule["from"]:
                    if "podSelector" in peer:
                        # Pods of this namespace: the proxy's, and nothing else here.
                        assert "namespaceSelector" not in peer
                        senders = {n for n, lb in pods.items() if _selects(peer["podSelector"], lb)}
                        assert senders == {"ec-s3-proxy"}, f"{name} is reachable from {senders}"
                    else:
                        assert set(peer) == {"namespaceSelector"}, peer
                        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}


# --------------------------------------------------------------------------- the images
def _dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule for a path: the last matching pattern wins (``!`` re-includes), and a
    pattern that matches a directory covers what is below it."""
    import fnmatch

    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pattern) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_the_images_run_as_the_manifests_non_root_user_with_pinned_dependencies() -> None:
    stages = dockerfile_stages(DOCKERFILE.read_text())
    assert set(stages) >= {"slim", "vllm"} and list(stages)[-1] == "vllm", "vllm is the default target"
    objs = render(KUSTOMIZE)
    users = {(pod.get("securityContext", {}).get("runAsUser"), c["image"].split(":")[0].rsplit("/", 1)[-1])
             for _, pod in pod_specs(objs) for c in _containers(pod)}
    for stage, image in (("slim", "ec-s3"), ("vllm", "ec-s3-vllm")):
        user = [line.split()[1] for line in stages[stage] if line.upper().startswith("USER ")][-1]
        uid = int(user.split(":")[0])
        assert uid != 0, stage
        assert {u for u, i in users if i == image} == {uid}, f"{image}: the manifests' runAsUser is not the image's USER"
        for line in stages[stage]:
            # The vllm image keeps the base image's packages (no resolving); the slim one
            # resolves ec-s3's core within the pins (tests/test_packaging.py).
            if " pip install" in f" {line}" and stage == "vllm":
                assert "--no-deps" in line, f"{stage}: pip resolves dependencies itself: {line}"
            elif " pip install" in f" {line}":
                assert "image-requirements.txt" in line, f"{stage}: a pip install outside the pins: {line}"
    # Every core dependency of ec-s3 and everything they need is pinned, in range.
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "deploy" / "image-requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower().replace("_", "-")] = spec.version
    pyproject = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    # (requirement, the extras its dependent asked for): a marker `extra == "boto3"` counts
    # where the dependent named aiobotocore[boto3].
    todo = [(Requirement(m), frozenset[str]()) for m in re.findall(r'^\s*"([^"]+)"', block, re.M)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        name = req.name.lower().replace("_", "-")
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        assert name in pins, f"{name} (needed by ec-s3) is not pinned in deploy/image-requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is not {req}"
        todo += [(Requirement(r), frozenset(req.extras)) for r in distribution(name).requires or []]
    seen_names = {n for n, _ in seen}
    assert set(pins) == seen_names, f"pinned but not needed: {sorted(set(pins) - seen_names)}"


def test_the_build_context_is_what_the_dockerfile_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [src for line in dockerfile_stages(DOCKERFILE.read_text())["slim"] + dockerfile_stages(DOCKERFILE.read_text())["vllm"]
              if line.upper().startswith("COPY ") for src in line.split()[1:-1]]
    for src in copied:
        assert (ROOT / src).exists() and not _dockerignored(src, patterns), f"COPY {src} is not in the context"
    for rel in (".venv", ".git", "tests/deploy/test_deploy.py", "bench/results", "ec_s3/__pycache__/x.pyc"):
        assert _dockerignored(rel, patterns), f"{rel} is sent to the builder"
    sent = [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts
            and not _dockerignored(p.relative_to(ROOT).as_posix(), patterns)]
    assert sum(p.stat().st_size for p in sent) < 20 * 2**20, "the build context is over 20 MiB"
