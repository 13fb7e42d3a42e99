"""deploy/stacks: ec-s3 on vLLM production-stack, llm-d's modelservice and KServe, checked offline.

Neither Helm nor the charts can be had from the package registries, so the values are
checked against a schema of the chart keys they use (written from each chart's own
values.schema.json and templates: vllm-stack 0.1.12, llm-d-modelservice v0.4.12), with
``additionalProperties: false`` wherever the chart itself would silently ignore a typo.
Each vLLM server's command line is built the way the chart's template builds it and parsed
with vLLM's own ``vllm serve`` parser; its ``--ec-transfer-config`` must pass
``ECS3Config.from_extra_config`` in the container's environment. Where a ``helm`` binary and
the charts are present (``EC_S3_STACK_CHARTS``, a folder holding ``vllm-stack/`` and
``llm-d-modelservice/``), ``helm template`` renders them and the test checks that the chart
builds the same command line. KServe's kinds are CRDs, for which kubernetes-validate has no
schema (it raises ``SchemaNotFoundError``): the ServingRuntime's containers and volumes are
validated as a Pod's, the rest structurally.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ec_s3.config import ECS3Config
from ec_s3.proxy.main import build_parser as build_proxy_parser
from ec_s3.proxy.main import config_from_args as proxy_config_from_args

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
STACKS = ROOT / "deploy" / "stacks"
PRODUCTION_STACK = STACKS / "production-stack" / "values.yaml"
LLMD = {"encode": STACKS / "llm-d" / "encode-values.yaml", "pd": STACKS / "llm-d" / "pd-values.yaml"}
KSERVE = STACKS / "kserve" / "ec-s3.yaml"
K8S_VERSION = "1.29.0"
#: What Kubernetes gives a pod that sets no terminationGracePeriodSeconds.
DEFAULT_GRACE_S = 30

_ANY = {}  # a value the chart passes through to Kubernetes (validated as part of the render)
_ENV = {"type": "array", "items": {"type": "object", "required": ["name"],
                                    "properties": {"name": {"type": "string"}, "value": {"type": "string"},
                                                   "valueFrom": {"type": "object"}},
                                    "additionalProperties": False}}
_STRATEGY = {"type": "object", "additionalProperties": False, "properties": {
    "type": {"enum": ["RollingUpdate", "Recreate"]},
    "rollingUpdate": {"type": "object", "additionalProperties": False,
                      "properties": {"maxSurge": {"type": ["integer", "string"]},
                                     "maxUnavailable": {"type": ["integer", "string"]}}}}}

#: vllm-stack 0.1.12: the keys these values use, with the types its values.schema.json gives
#: them; the key lists are the chart's own (a key outside them is ignored by its templates).
PRODUCTION_STACK_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "servingEngineSpec": {"type": "object", "additionalProperties": False, "properties": {
            "strategy": _STRATEGY, "env": _ENV, "securityContext": {"type": "object"},
            "containerSecurityContext": {"type": "object"},
            "modelSpec": {"type": "array", "items": {
                "type": "object", "additionalProperties": False,
                "required": ["name", "repository", "tag", "modelURL"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z0-9-]+$"},
                    "repository": {"type": "string"}, "tag": {"type": "string"},
                    "modelURL": {"type": "string"}, "replicaCount": {"type": "integer"},
                    "requestCPU": {"type": "integer"}, "requestMemory": {"type": "string"},
                    "requestGPU": {"type": ["integer", "number", "string"]},
                    "pvcStorage": {"type": "string"}, "shmSize": {"type": "string"}, "env": _ENV,
                    "extraVolumes": {"type": "array"}, "extraVolumeMounts": {"type": "array"},
                    "vllmConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "enablePrefixCaching": {"type": "boolean"},
                        "enableChunkedPrefill": {"type": "boolean"},
                        "tensorParallelSize": {"type": "integer"},
                        "maxModelLen": {"type": "integer"},
                        "gpuMemoryUtilization": {"type": "number"},
                        "extraArgs": {"type": "array", "items": {"type": "string"}}}}}}}}},
        "routerSpec": {"type": "object", "additionalProperties": False,
                       "properties": {"enableRouter": {"type": "boolean"}}},
        "extraObjects": {"type": "array", "items": {"type": "object"}},
    },
}

_LLMD_CONTAINER = {
    "type": "object", "additionalProperties": False, "required": ["name", "image", "modelCommand"],
    "properties": {
        "name": {"type": "string"}, "image": {"type": "string"},
        "modelCommand": {"enum": ["vllmServe", "imageDefault", "custom"]},
        "args": {"type": "array", "items": {"type": "string"}}, "env": _ENV,
        "ports": _ANY, "resources": _ANY, "mountModelVolume": {"type": "boolean"},
        "volumeMounts": _ANY, "startupProbe": _ANY, "readinessProbe": _ANY, "livenessProbe": _ANY}}
#: llm-d-modelservice v0.4.12: the keys these values use (its templates and values.schema.json).
LLMD_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "modelArtifacts": {"type": "object", "additionalProperties": False, "required": ["uri", "name"], "properties": {
            "uri": {"type": "string", "pattern": "^(hf|pvc|pvc\\+hf|oci)://"}, "name": {"type": "string"},
            "size": {"type": "string"}, "authSecretName": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": ["string", "null"]}}}},
        "routing": {"type": "object", "additionalProperties": False, "properties": {
            "servicePort": {"type": "integer"},
            "proxy": {"type": "object", "additionalProperties": False, "properties": {"enabled": {"type": "boolean"}}}}},
        "prefill": {"type": "object", "additionalProperties": False, "properties": {"create": {"type": "boolean"}}},
        "decode": {"type": "object", "additionalProperties": False, "required": ["create", "containers"], "properties": {
            "create": {"type": "boolean"}, "replicas": {"type": "integer"}, "strategy": _STRATEGY,
            "terminationGracePeriodSeconds": {"type": "integer"}, "podAnnotations": {"type": "object"},
            "extraConfig": {"type": "object", "additionalProperties": False,
                            "properties": {"securityContext": {"type": "object"}}},
            "containers": {"type": "array", "minItems": 1, "items": _LLMD_CONTAINER},
            "volumes": {"type": "array"}}},
        "extraObjects": {"type": "array", "items": {"type": "object"}},
    },
}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


# --------------------------------------------------------------------------- the servers of each stack
def _env(entries: list[dict[str, Any]]) -> dict[str, str]:
    """A container's environment; a Secret's value is a stand-in (only its presence matters)."""
    return {e["name"]: e.get("value", "stand-in") for e in entries}


def _secrets(mounts: list[dict[str, Any]], volumes: dict[str, dict[str, Any]]) -> dict[str, tuple[str, set[str]]]:
    """Mounted Secret files: path -> (Secret name, its keys there)."""
    out = {}
    for m in mounts:
        secret = volumes[m["name"]].get("secret")
        if secret:
            for item in secret["items"]:
                out[f"{m['mountPath']}/{item['path']}"] = (secret["secretName"], {item["key"]})
    return out


def production_stack_servers(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Each model spec's `vllm serve` arguments as deployment-vllm-multi.yaml builds them."""
    spec = values["servingEngineSpec"]
    out = []
    for m in spec["modelSpec"]:
        cfg = m.get("vllmConfig", {})
        args = [m["modelURL"], "--host", "0.0.0.0", "--port", "8000"]
        args.append("--enable-prefix-caching" if cfg.get("enablePrefixCaching") else "--no-enable-prefix-caching")
        if "tensorParallelSize" in cfg:
            args += ["--tensor-parallel-size", str(cfg["tensorParallelSize"])]
        args += cfg.get("extraArgs", [])
        shm = None
        if "tensorParallelSize" in cfg:  # the chart's only condition for its /dev/shm emptyDir
            shm = {"mountPath": "/dev/shm", "emptyDir": {"medium": "Memory", "sizeLimit": m.get("shmSize", "20Gi")}}
        extra = {v["name"]: v for v in m.get("extraVolumes", [])}
        out.append({"name": m["name"], "args": args, "env": _env(spec.get("env", []) + m.get("env", [])),
                    "volumes": [shm] if shm else [], "grace_s": DEFAULT_GRACE_S, "model": m["modelURL"],
                    "secrets": _secrets(m.get("extraVolumeMounts", []), extra)})
    return out


def llmd_servers(values: dict[str, Any], release: str) -> list[dict[str, Any]]:
    """The decode role's `vllm serve` arguments as the chart's vllmServeModelCommand builds them."""
    artifacts, decode = values["modelArtifacts"], values["decode"]
    model = artifacts["uri"].split("://", 1)[1]
    c = decode["containers"][0]
    assert c["modelCommand"] == "vllmServe", release
    args = [model, "--port", str(values["routing"]["servicePort"]), "--served-model-name", artifacts["name"],
            *c.get("args", [])]
    volumes = {v["name"]: v for v in decode.get("volumes", [])}
    mounts = [{"mountPath": vm["mountPath"], **volumes[vm["name"]]} for vm in c.get("volumeMounts", [])]
    return [{"name": release, "args": args, "env": _env(c.get("env", [])), "volumes": mounts,
             "grace_s": decode.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S), "model": model,
             "secrets": _secrets(c.get("volumeMounts", []), volumes)}]


def _kserve_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(KSERVE.read_text()) if d]


def kserve_servers() -> list[dict[str, Any]]:
    docs = _kserve_docs()
    runtimes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServingRuntime"}
    out = []
    for isvc in (d for d in docs if d["kind"] == "InferenceService"):
        predictor = isvc["spec"]["predictor"]
        rt = runtimes[predictor["model"]["runtime"]]
        c = rt["spec"]["containers"][0]
        assert c["command"] == ["vllm", "serve"], rt["metadata"]["name"]
        volumes = {v["name"]: v for v in rt["spec"].get("volumes", [])}
        mounts = [{"mountPath": vm["mountPath"], **volumes[vm["name"]]} for vm in c.get("volumeMounts", [])]
        out.append({"name": isvc["metadata"]["name"], "args": c["args"], "env": _env(c.get("env", [])),
                    "volumes": mounts, "grace_s": predictor.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S),
                    # KServe's storage initializer puts storageUri's model at /mnt/models.
                    "model": predictor["model"]["storageUri"],
                    "secrets": _secrets(c.get("volumeMounts", []), volumes)})
    return out


def all_stacks() -> dict[str, list[dict[str, Any]]]:
    return {
        "production-stack": production_stack_servers(_load(PRODUCTION_STACK)),
        "llm-d": [s for r, p in LLMD.items() for s in llmd_servers(_load(p), f"ec-s3-{r}")],
        "kserve": kserve_servers(),
    }


def _quantity(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * factor)
    return int(q)


# --------------------------------------------------------------------------- tests
def test_values_match_the_charts_schemas() -> None:
    jsonschema.validate(_load(PRODUCTION_STACK), PRODUCTION_STACK_SCHEMA)
    for path in LLMD.values():
        jsonschema.validate(_load(path), LLMD_SCHEMA)


def test_the_schemas_refuse_a_key_the_chart_would_ignore() -> None:
    values = _load(PRODUCTION_STACK)
    values["servingEngineSpec"]["modelSpec"][1]["vllmConfig"]["extraArg"] = ["--oops"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, PRODUCTION_STACK_SCHEMA)
    llmd = _load(LLMD["pd"])
    llmd["decode"]["containers"][0]["modelComand"] = "vllmServe"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(llmd, LLMD_SCHEMA)


@pytest.mark.parametrize("stack", ["production-stack", "llm-d", "kserve"])
def test_vllm_args_parse_and_the_transfer_config_is_ec_s3s(stack: str, vllm_parser: Any, tmp_path: Path) -> None:
    from vllm.config import ECTransferConfig

    servers = all_stacks()[stack]
    roles: dict[str, str] = {}
    for server in servers:
        name = f"{stack}:{server['name']}"
        ns = vllm_parser.parse_args(server["args"])
        transfer = ns.ec_transfer_config
        assert isinstance(transfer, ECTransferConfig), f"{name}: no --ec-transfer-config"
        assert transfer.ec_connector == "ECS3Connector" and transfer.ec_connector_module_path == "ec_s3", name
        config = ECS3Config.from_extra_config(dict(transfer.ec_connector_extra_config), environ=server["env"])
        assert config.bucket == server["env"]["EC_S3_BUCKET"], name
        # The region comes from the environment (AWS_REGION, what IRSA sets), not the JSON.
        assert "region" not in transfer.ec_connector_extra_config, name
        assert "AWS_REGION" in server["env"], name
        roles[server["name"]] = transfer.ec_role
        assert ns.shutdown_timeout > 0, f"{name}: vLLM's default 0 aborts requests on every rollout"
        assert ns.shutdown_timeout < server["grace_s"], f"{name}: --shutdown-timeout outlasts the grace period"
        if transfer.ec_role == "ec_producer":
            assert ns.shutdown_timeout > config.shutdown_timeout_s, f"{name}: pending uploads need the time"
        else:
            shm = next((v for v in server["volumes"] if v["mountPath"] == config.staging_dir), None)
            assert shm is not None and shm["emptyDir"].get("medium") == "Memory", (
                f"{name}: staging_dir {config.staging_dir} is not a Memory emptyDir (the runtime's is 64 MiB)")
            assert _quantity(shm["emptyDir"]["sizeLimit"]) >= config.staging_bytes, name
    assert sorted(roles.values()) == ["ec_consumer", "ec_producer"], f"{stack}: one encoder and one pd server"
    assert len({s["model"] for s in servers}) == 1, f"{stack}: encoders and pd must load the same model string"


def _role(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a.startswith("--ec-transfer-config"):
            text = a.split("=", 1)[1] if "=" in a else args[i + 1]
            return json.loads(text)["ec_role"]
    raise AssertionError("no --ec-transfer-config")


@pytest.mark.parametrize("stack", ["production-stack", "llm-d", "kserve"])
def test_one_identity_per_role(stack: str) -> None:
    """The kit's split (docs/deploy.md): encoders hold put rights, prefill/decode only get."""
    for server in all_stacks()[stack]:
        name = f"{stack}:{server['name']}"
        assert "AWS_ACCESS_KEY_ID" not in server["env"], f"{name}: keys in the environment, not a role's file"
        path = server["env"]["AWS_SHARED_CREDENTIALS_FILE"]
        assert path in server["secrets"], f"{name}: {path} is no mounted Secret file"
        want = {"ec_producer": "ec-s3-encoder-credentials", "ec_consumer": "ec-s3-pd-credentials"}[_role(server["args"])]
        assert server["secrets"][path] == (want, {"credentials"}), name


def _proxies(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for o in objs if o["kind"] == "Deployment"
            for c in o["spec"]["template"]["spec"]["containers"] if c.get("command") == ["ec-s3", "proxy"]]


def _service_urls(objs: list[dict[str, Any]]) -> set[str]:
    return {f"http://{o['metadata']['name']}:{p['port']}" for o in objs if o["kind"] == "Service"
            for p in o["spec"]["ports"]}


def test_each_stack_has_an_ec_s3_proxy_pointing_at_its_servers() -> None:
    ps = _load(PRODUCTION_STACK)
    ps_services = {f"http://ec-s3-{m['name']}-engine-service:80" for m in ps["servingEngineSpec"]["modelSpec"]}
    llmd_objs = [o for p in LLMD.values() for o in _load(p).get("extraObjects", [])]
    kserve_objs = _kserve_docs()
    kserve_services = {f"http://{d['metadata']['name']}-predictor:80" for d in kserve_objs
                       if d["kind"] == "InferenceService"}
    for stack, objs, services in (("production-stack", ps["extraObjects"], ps_services),
                                  ("llm-d", llmd_objs, _service_urls(llmd_objs)),
                                  ("kserve", kserve_objs, kserve_services)):
        (proxy,) = _proxies(objs)
        config = proxy_config_from_args(build_proxy_parser().parse_args(proxy["args"]))
        assert set(config.encoder_urls) | set(config.pd_urls) <= services, stack
        assert config.encoder_urls and config.pd_urls, stack
    # The chart's router would mix encoders and pd (they serve one model name).
    assert ps["routerSpec"]["enableRouter"] is False


@pytest.mark.parametrize("stack", ["production-stack", "llm-d", "kserve"])
def test_each_stacks_proxy_drains_as_long_as_its_prefill_decode(stack: str, vllm_parser: Any) -> None:
    from test_deploy import check_proxy_drain

    (pd,) = [s for s in all_stacks()[stack] if _role(s["args"]) == "ec_consumer"]
    objs = {"production-stack": lambda: _load(PRODUCTION_STACK)["extraObjects"],
            "llm-d": lambda: [o for p in LLMD.values() for o in _load(p).get("extraObjects", [])],
            "kserve": _kserve_docs}[stack]()
    (pod,) = [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment" and _proxies([o])]
    check_proxy_drain(pod, float(vllm_parser.parse_args(pd["args"]).shutdown_timeout), stack)


def test_rollouts_fit_a_full_gpu_pool() -> None:
    strategies = [_load(PRODUCTION_STACK)["servingEngineSpec"]["strategy"]]
    strategies += [_load(p)["decode"]["strategy"] for p in LLMD.values()]
    for s in strategies:
        assert s["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_llmd_encoders_are_not_inference_serving() -> None:
    """The chart labels its pods for an InferencePool by default; a gateway must not pick encoders."""
    labels = _load(LLMD["encode"])["modelArtifacts"]["labels"]
    assert "llm-d.ai/inference-serving" in labels and labels["llm-d.ai/inference-serving"] is None


def _core_objects() -> list[dict[str, Any]]:
    objs = list(_load(PRODUCTION_STACK)["extraObjects"])
    objs += [o for p in LLMD.values() for o in _load(p).get("extraObjects", [])]
    objs += [d for d in _kserve_docs() if not d["apiVersion"].startswith("serving.kserve.io/")]
    return objs


def test_plain_kubernetes_objects_pass_the_schema() -> None:
    for obj in _core_objects():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kserve_objects_are_well_formed() -> None:
    docs = _kserve_docs()
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate(docs[0], K8S_VERSION, strict=True)  # why the checks below are structural
    runtimes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServingRuntime"}
    assert all(d["apiVersion"] == "serving.kserve.io/v1alpha1" for d in runtimes.values())
    for name, rt in runtimes.items():
        assert set(rt["spec"]) <= {"supportedModelFormats", "containers", "volumes"}, name
        assert rt["spec"]["containers"][0]["name"] == "kserve-container", name
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
               "spec": {"containers": rt["spec"]["containers"], "volumes": rt["spec"].get("volumes", [])}}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    for isvc in (d for d in docs if d["kind"] == "InferenceService"):
        assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
        assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
        model = isvc["spec"]["predictor"]["model"]
        formats = {f["name"] for f in runtimes[model["runtime"]]["spec"]["supportedModelFormats"]}
        assert model["modelFormat"]["name"] in formats, isvc["metadata"]["name"]


# --------------------------------------------------------------------------- the charts themselves, where present
def _helm_template(chart: Path, release: str, values: Path) -> list[dict[str, Any]]:
    helm = shutil.which("helm")
    charts = os.environ.get("EC_S3_STACK_CHARTS")
    if helm is None or not charts:
        pytest.skip("no helm binary or no EC_S3_STACK_CHARTS (neither is on the package registries)")
    out = subprocess.run([helm, "template", release, str(Path(charts) / chart), "-n", "ec-s3", "-f", str(values)],
                         capture_output=True, text=True, timeout=300, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _vllm_containers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for o in objs if o["kind"] == "Deployment"
            for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]


def test_helm_renders_the_production_stack_values_as_tested() -> None:
    objs = _helm_template(Path("vllm-stack"), "ec-s3", PRODUCTION_STACK)
    rendered = sorted(c["command"][2:] for c in _vllm_containers(objs))
    assert rendered == sorted(s["args"] for s in production_stack_servers(_load(PRODUCTION_STACK)))
    # ... and the /dev/shm volumes the test assumed (the chart mounts one only with tensorParallelSize).
    for o in (o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-deployment-vllm")):
        pod = o["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = [{"mountPath": m["mountPath"], **volumes[m["name"]]}
                  for c in pod["containers"] for m in c.get("volumeMounts", []) if "emptyDir" in volumes[m["name"]]]
        server = next(s for s in production_stack_servers(_load(PRODUCTION_STACK))
                      if o["metadata"]["name"] == f"ec-s3-{s['name']}-deployment-vllm")
        assert [{k: v for k, v in m.items() if k != "name"} for m in mounts] == server["volumes"], o["metadata"]["name"]
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("role", sorted(LLMD))
def test_helm_renders_the_llmd_values_as_tested(role: str) -> None:
    objs = _helm_template(Path("llm-d-modelservice"), f"ec-s3-{role}", LLMD[role])
    (c,) = _vllm_containers(objs)
    assert c["command"] == ["vllm", "serve"]
    assert c["args"] == llmd_servers(_load(LLMD[role]), f"ec-s3-{role}")[0]["args"]
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
