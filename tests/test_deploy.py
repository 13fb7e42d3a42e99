"""deploy/kubernetes: what `kubectl apply -k` would create, checked offline.

No cluster and no kustomize binary here, so :func:`render` builds each kustomization the
way kustomize does for the features these files use (resources, components, generators
with ``behavior: merge``, namespace, labels, images, JSON 6902 patches, and the rule that a
kustomization reads files only below its own directory); it refuses any other field, so a
kustomization cannot use something this test does not understand. Every rendered object
is then validated against the Kubernetes schemas of a pinned version
(``kubernetes-validate``, bundled schemas, no network), and checked the way ec-s3 needs
it: every ConfigMap's ec-s3 config passes ``ECS3Config.from_extra_config`` in the
container's own environment, every ``file:`` it names is a mounted Secret key and every
``env:`` a defined variable, ``staging_dir`` is a Memory ``emptyDir`` of at least
``staging_bytes``, and the commands parse with ec-s3's own CLI parsers.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ec_s3.cli.main import build_parser as build_cli_parser
from ec_s3.config import ECS3Config
from ec_s3.proxy.main import build_parser as build_proxy_parser
from ec_s3.proxy.main import config_from_args as proxy_config_from_args

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
#: The Kubernetes version whose schemas every manifest must pass: the oldest release the
#: manifests target (sidecar-free, batch/v1 CronJob, policy/v1 PDB), and the newest bundled.
K8S_VERSIONS = ("1.29.0", "1.37.0")
#: Every kustomization applied as is (the base and each overlay).
TARGETS = ("", "overlays/minio", "overlays/prometheus-operator")
#: Objects the operator creates before the first apply (docs/deploy.md); optional ones
#: are referenced with ``optional: true``.
EXTERNAL_SECRETS = {"ec-s3-credentials"}
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
CLUSTER_SCOPED = {"Namespace"}
_KNOWN_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "components", "images",
                 "configMapGenerator", "secretGenerator", "patches"}


# --------------------------------------------------------------------------- the renderer
def _inside(root: Path, rel: str) -> Path:
    """``root / rel``, refusing what kustomize's default load restrictor refuses."""
    path = (root / rel).resolve()
    assert path == root.resolve() or root.resolve() in path.parents, (
        f"{root}: {rel!r} is outside the kustomization's directory; kustomize refuses it "
        "(LoadRestrictionsRootOnly)")
    assert path.exists(), f"{root}: {rel!r} does not exist"
    return path


def _read_env_file(path: Path) -> dict[str, str]:
    data: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: {line!r} is not KEY=VALUE"
        data[key] = value
    return data


def _generate(root: Path, spec: dict[str, Any], kind: str) -> dict[str, Any]:
    data: dict[str, str] = {}
    for entry in spec.get("files", []):
        key, _, rel = entry.rpartition("=") if "=" in entry else ("", "", entry)
        data[key or Path(rel).name] = _inside(root, rel).read_text()
    for rel in spec.get("envs", []):
        data.update(_read_env_file(_inside(root, rel)))
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    metadata: dict[str, Any] = {"name": spec["name"]}
    if spec.get("namespace"):
        metadata["namespace"] = spec["namespace"]
    if spec.get("options", {}).get("labels"):
        metadata["labels"] = dict(spec["options"]["labels"])
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": metadata}
    if kind == "Secret":
        obj["type"] = "Opaque"
        obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:
        obj["data"] = data
    return obj


def _find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _json_pointer(doc: Any, path: str) -> tuple[Any, str | int]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    last: str | int = int(parts[-1]) if isinstance(doc, list) and parts[-1] != "-" else parts[-1]
    return doc, last


def _apply_patch(objs: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    target = patch["target"]
    matched = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
    assert matched, f"patch target {target} matches nothing"
    for op in yaml.safe_load(patch["patch"]):
        assert op["op"] in ("replace", "add", "remove"), op
        for obj in matched:
            parent, key = _json_pointer(obj, op["path"])
            if op["op"] == "replace":
                assert key in parent if isinstance(parent, dict) else key < len(parent), f"{op['path']} is not there"
                parent[key] = op["value"]
            elif op["op"] == "add":
                if isinstance(parent, list):
                    parent.insert(len(parent) if key == "-" else key, op["value"])
                else:
                    parent[key] = op["value"]
            else:
                del parent[key]


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


def render(directory: Path, _visited: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` prints (without generator hashes)."""
    directory = directory.resolve()
    visited = (*_visited, directory)
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - _KNOWN_FIELDS
    assert not unknown, f"{directory}: kustomization fields this test does not render: {unknown}"
    objs: list[dict[str, Any]] = []
    for rel in spec.get("resources", []):
        path = (directory / rel).resolve()
        if path.is_dir():
            # A base may live anywhere but around an overlay (kustomize: "cycle detected:
            # candidate root contains visited root"); only files are restricted to the root.
            assert (path / "kustomization.yaml").exists(), f"{directory}: {rel} has no kustomization.yaml"
            assert not [v for v in visited if v == path or path in v.parents], (
                f"{directory}: {rel} contains a kustomization it is built from; kustomize refuses it (cycle)")
            objs += render(path, visited)
        else:
            objs += [d for d in yaml.safe_load_all(_inside(directory, rel).read_text()) if d]
    for rel in spec.get("components", []):
        component = (directory / rel).resolve()
        assert yaml.safe_load((component / "kustomization.yaml").read_text())["kind"] == "Component"
        objs += render(component, visited)
    for field, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for gen in spec.get(field, []):
            new = _generate(directory, gen, kind)
            if gen.get("behavior") == "merge":
                old = _find(objs, kind, gen["name"])
                assert not gen.get("namespace") or old["metadata"].get("namespace") == gen["namespace"], (
                    f"{directory}: merge of {kind}/{gen['name']} names another namespace")
                old["data"].update(new["data"])
            else:
                assert not [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == gen["name"]], gen["name"]
                objs.append(new)
    for patch in spec.get("patches", []):
        _apply_patch(objs, patch)
    if spec.get("namespace"):
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for group in spec.get("labels", []):
        for obj in objs:
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
    for image in spec.get("images", []):
        for _, pod in pod_specs(objs):
            for c in _containers(pod):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objs


@pytest.fixture(scope="module", params=TARGETS, ids=lambda t: t or "base")
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUSTOMIZE / request.param)


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


def _major(version_output: str) -> int:
    m = re.search(r"v(\d+)\.\d+", version_output)
    return int(m.group(1)) if m else 0


def _kustomize_cli() -> list[str] | None:
    """A kustomize >= 5 to compare with ($EC_S3_KUSTOMIZE_BIN, kustomize, or kubectl's
    own); older ones (Debian's kubectl 1.20 has kustomize 2) lack components and labels."""
    for binary in (os.environ.get("EC_S3_KUSTOMIZE_BIN"), shutil.which("kustomize")):
        if binary:
            version = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=60).stdout
            if _major(version) >= 5:
                return [binary, "build"]
    kubectl = shutil.which("kubectl")
    if kubectl:
        proc = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
        if proc.returncode == 0 and _major(json.loads(proc.stdout).get("kustomizeVersion", "")) >= 5:
            return [kubectl, "kustomize"]
    return None


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t or "base")
def test_kustomize_builds_what_the_renderer_renders(target: str) -> None:
    """Where a kustomize exists, it accepts each target and prints the same objects
    (generated names carry a content hash there; the renderer leaves it off)."""
    cli = _kustomize_cli()
    if cli is None:
        pytest.skip("no kustomize >= 5 here (kustomize, kubectl or $EC_S3_KUSTOMIZE_BIN): the renderer alone "
                    "checks the kustomizations")
    proc = subprocess.run([*cli, str(KUSTOMIZE / target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cli)} rejects {target or 'the base'}:\n{proc.stderr}"
    ours = render(KUSTOMIZE / target)
    text = json.dumps([d for d in yaml.safe_load_all(proc.stdout) if d])
    for name in {o["metadata"]["name"] for o in ours if o["kind"] in ("ConfigMap", "Secret")}:
        text = re.sub(rf'"{re.escape(name)}-[a-z0-9]{{10}}"', json.dumps(name), text)
    theirs = json.loads(text)

    def key(o: dict[str, Any]) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(map(key, theirs)) == sorted(map(key, ours))
    by_key = {key(o): o for o in ours}
    for obj in theirs:
        assert obj == by_key[key(obj)], f"{key(obj)} differs:\nkustomize: {obj}\nrenderer:  {by_key[key(obj)]}"


def test_the_renderer_refuses_what_kustomize_refuses(tmp_path: Path) -> None:
    (tmp_path / "k").mkdir()
    (tmp_path / "outside.json").write_text("{}")
    (tmp_path / "k" / "kustomization.yaml").write_text(yaml.safe_dump(
        {"configMapGenerator": [{"name": "x", "files": ["../outside.json"]}]}))
    with pytest.raises(AssertionError, match="outside the kustomization"):
        render(tmp_path / "k")
    (tmp_path / "k" / "o").mkdir()
    (tmp_path / "k" / "kustomization.yaml").write_text(yaml.safe_dump({"resources": []}))
    (tmp_path / "k" / "o" / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [".."]}))
    with pytest.raises(AssertionError, match="cycle"):
        render(tmp_path / "k" / "o")
    (tmp_path / "k" / "kustomization.yaml").write_text(yaml.safe_dump({"replicas": [{"name": "x", "count": 2}]}))
    with pytest.raises(AssertionError, match="does not render"):
        render(tmp_path / "k")


def test_base_has_the_pieces_of_an_epd_fleet() -> None:
    objs = render(KUSTOMIZE)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert {("Deployment", "ec-s3-encoder"), ("Deployment", "ec-s3-pd"), ("Deployment", "ec-s3-proxy"),
            ("Service", "ec-s3-encoder"), ("Service", "ec-s3-pd"), ("Service", "ec-s3-proxy"),
            ("ConfigMap", "ec-s3-config"), ("ConfigMap", "ec-s3-env"), ("ServiceAccount", "ec-s3"),
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
        matching = [(obj, pod) for obj, pod in pod_specs(objs) if obj["kind"] == "Deployment"
                    and svc["spec"]["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, f"Service {svc['metadata']['name']} selects {len(matching)} Deployments"
        ports = {p.get("name") for c in matching[0][1]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {svc['metadata']['name']}: no container port {port['targetPort']}"


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
        serves = obj["kind"] == "Deployment" and c in pod["containers"]
        if transfer["ec_role"] == "ec_consumer" and serves:
            volume = _volume_at(pod, c, config.staging_dir)
            assert volume is not None and volume.get("emptyDir", {}).get("medium") == "Memory", (
                f"{name}: staging_dir {config.staging_dir} is not on a Memory emptyDir (a container's /dev/shm is 64 MiB)")
            assert _parse_quantity(volume["emptyDir"]["sizeLimit"]) >= config.staging_bytes, (
                f"{name}: staging_dir's sizeLimit {volume['emptyDir']['sizeLimit']} < staging_bytes {config.staging_bytes}")
        if config.spool_dir and serves:
            volume = _volume_at(pod, c, config.spool_dir)
            assert volume is not None and "emptyDir" in volume, f"{name}: spool_dir {config.spool_dir} is not a volume"
            assert _parse_quantity(volume["emptyDir"]["sizeLimit"]) >= config.spool_max_bytes, name
    assert {("ec-s3-encoder", "ec_producer"), ("ec-s3-pd", "ec_consumer")} <= seen


def test_vllm_servers_take_the_config_from_the_configmap(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    target, objs = rendered
    roles = {"ec-s3-encoder": "ec_producer", "ec-s3-pd": "ec_consumer"}
    models = set()
    for name, role in roles.items():
        pod = _find(objs, "Deployment", name)["spec"]["template"]["spec"]
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
        annotations = _find(objs, "Deployment", name)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == vllm["ports"][0]["containerPort"]
        # The pre-flight check runs first, with the same config, and stops the pod.
        check = pod["initContainers"][0]
        assert check["command"][:2] == ["ec-s3", "check"], name
        assert container_env(objs, check)["EC_TRANSFER_CONFIG"] == env["EC_TRANSFER_CONFIG"], name
        args_ns = build_cli_parser().parse_args(check["command"][1:])
        assert args_ns.read_only == (role == "ec_consumer"), name
        if role == "ec_producer":
            extra = ECS3Config.from_extra_config(
                {**transfer["ec_connector_extra_config"], "access_key_id": None, "secret_access_key": None},
                environ=env)
            timeout = next(float(a.split("=", 1)[1]) for a in args if a.startswith("--shutdown-timeout="))
            assert timeout > extra.shutdown_timeout_s, "vLLM must wait for pending uploads on SIGTERM"
            assert pod["terminationGracePeriodSeconds"] > timeout
    assert len(models) == 1, "encoders and prefill/decode must load the same model string"


def test_vllm_accepts_the_transfer_configs() -> None:
    """The JSON given to --ec-transfer-config is one vLLM's own config class takes."""
    pytest.importorskip("vllm")
    from vllm.config import ECTransferConfig

    for path in sorted(KUSTOMIZE.rglob("config/*.json")):
        config = ECTransferConfig(**json.loads(path.read_text()))
        assert config.ec_connector == "ECS3Connector", path


def test_proxy_and_cronjobs_parse_with_ec_s3s_own_parsers() -> None:
    objs = render(KUSTOMIZE)
    proxy = _find(objs, "Deployment", "ec-s3-proxy")["spec"]["template"]["spec"]["containers"][0]
    assert proxy["command"] == ["ec-s3", "proxy"]
    config = proxy_config_from_args(build_proxy_parser().parse_args(proxy["args"]))
    assert config.encoder_urls == ("http://ec-s3-encoder:8000",) and config.pd_urls == ("http://ec-s3-pd:8000",)
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health"
    # A proxy is not restarted because prefill/decode is down: liveness is not /health.
    assert "httpGet" not in proxy["livenessProbe"]
    pd = _find(objs, "Deployment", "ec-s3-pd")["spec"]["template"]["spec"]["containers"][0]
    keepalive = float(next(v["value"] for v in pd["env"] if v["name"] == "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"))
    assert config.keepalive_timeout_s < keepalive


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


def test_the_guides_links_resolve() -> None:
    for doc in (ROOT / "docs" / "deploy.md", ROOT / "README.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name}: link {target} does not resolve"
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
    # MinIO's root user is the identity ec-s3 signs with.
    secret = _find(objs, "Secret", "ec-s3-credentials")
    refs = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in minio["env"]}
    assert refs["MINIO_ROOT_USER"] == {"name": "ec-s3-credentials", "key": "access-key-id"}
    assert refs["MINIO_ROOT_PASSWORD"] == {"name": "ec-s3-credentials", "key": "secret-access-key"}
    assert {"access-key-id", "secret-access-key"} <= set(secret["data"])


# --------------------------------------------------------------------------- the commands, run
def _run_as_in_the_pod(objs: list[dict[str, Any]], c: dict[str, Any], s3_endpoint: Any, bucket: str,
                       secrets_dir: Path) -> subprocess.CompletedProcess[str]:
    """The container's ec-s3 command, with its environment and $(VAR) expansion, run here
    against the test's S3 server; the Secret's mount is ``secrets_dir``."""
    env = container_env(objs, c)
    env.update(EC_S3_BUCKET=bucket, EC_S3_ENDPOINT_URL=s3_endpoint.url)
    env["EC_TRANSFER_CONFIG"] = env["EC_TRANSFER_CONFIG"].replace("file:/var/run/secrets/ec-s3/", f"file:{secrets_dir}/")
    argv = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in c["command"]]
    assert argv[0] == "ec-s3"
    proc_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path), **env}
    return subprocess.run([sys.executable, "-m", "ec_s3.cli", *argv[1:]], env=proc_env, capture_output=True,
                          text=True, timeout=120)


def test_preflight_check_passes_or_stops_the_pod_with_its_diagnosis(s3_endpoint: Any, bucket: str, tmp_path: Path) -> None:
    objs = render(KUSTOMIZE)
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d, secret in ((good, s3_endpoint.credentials.secret_access_key), (bad, "not-the-secret")):
        d.mkdir()
        (d / "access-key-id").write_text(s3_endpoint.credentials.access_key_id)
        (d / "secret-access-key").write_text(secret)
    for name in ("ec-s3-encoder", "ec-s3-pd"):
        check = _find(objs, "Deployment", name)["spec"]["template"]["spec"]["initContainers"][0]
        ok = _run_as_in_the_pod(objs, check, s3_endpoint, bucket, good)
        assert ok.returncode == 0 and "PASS" in ok.stdout, f"{name}:\n{ok.stdout}\n{ok.stderr}"
        # Exit status 1 fails the init container, so the pod (and the rollout) stops here,
        # and its output, the termination message, says why and what to do.
        failed = _run_as_in_the_pod(objs, check, s3_endpoint, bucket, bad)
        assert failed.returncode == 1, f"{name}:\n{failed.stdout}\n{failed.stderr}"
        assert "FAIL" in failed.stdout and "fix" in failed.stdout, failed.stdout
        assert "not-the-secret" not in failed.stdout + failed.stderr


@pytest.mark.parametrize("name", ["ec-s3-gc", "ec-s3-abort-stale-uploads"])
def test_gc_cronjob_runs(name: str, s3_endpoint: Any, bucket: str, tmp_path: Path) -> None:
    objs = render(KUSTOMIZE)
    (tmp_path / "access-key-id").write_text(s3_endpoint.credentials.access_key_id)
    (tmp_path / "secret-access-key").write_text(s3_endpoint.credentials.secret_access_key)
    c = _find(objs, "CronJob", name)["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    proc = _run_as_in_the_pod(objs, c, s3_endpoint, bucket, tmp_path)
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
    assert images == {"registry.example.com/ec-s3-vllm:0.1.0-vllm0.33.0"}
    cli = _kustomize_cli()
    if cli is not None:
        proc = subprocess.run([*cli, str(fleet)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
