"""deploy/: the Kubernetes manifests against the API's schemas, and our own flags and ports.

Offline only: no cluster, no image build. Built-in kinds go through kubernetes-validate
(strict: unknown fields fail). It has no schemas for CRDs (ServiceMonitor, InferencePool,
InferenceObjective, LeaderWorkerSet), so for those the metadata and any embedded pod template
are validated as built-in objects and the fields their CRDs require are checked by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dolmus.cli import build_parser
from dolmus.config.server import ServerConfig

kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSIONS = ("1.29", "1.33")  # oldest we claim, and a recent one
# What LeaderWorkerSet puts into its pods' environment, with example values.
LWS_ENV = {
    "LWS_LEADER_ADDRESS": "dolmus-tp-0.dolmus-tp.default",
    "LWS_WORKER_INDEX": "1",
    "LWS_GROUP_SIZE": "2",
}


def _load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


MANIFESTS = {p.name: _load(p.name) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"}
DOCS = [(name, doc) for name, docs in MANIFESTS.items() for doc in docs]


def _one(name: str, kind: str) -> dict:
    found = [d for d in MANIFESTS[name] if d["kind"] == kind]
    assert len(found) == 1, f"{name}: expected one {kind}"
    return found[0]


def _validate_builtin(doc: dict, version: str) -> None:
    try:
        kv.validate(doc, version, strict=True)
        return
    except kv.ValidationError as e:
        where = f"{doc['kind']}/{doc['metadata'].get('name')}: {'.'.join(str(p) for p in e.path)}"
        message = e.message
    pytest.fail(f"{where}: {message}")  # outside the handler: the schema dump is not worth reading


def _validate_pod_template(template: dict, version: str) -> None:
    """A PodTemplateSpec embedded in a CRD, as the core/v1 PodTemplate that holds exactly one."""
    _validate_builtin(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}, version
    )


def _check_service_monitor(doc: dict, version: str) -> None:
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"] and spec["endpoints"]
    for ep in spec["endpoints"]:
        assert ep["port"] and ep["path"] == "/metrics"
        assert re.fullmatch(r"\d+(ms|s|m)", ep["interval"])


def _check_inference_pool(doc: dict, version: str) -> None:
    spec = doc["spec"]
    assert 1 <= len(spec["selector"]["matchLabels"]) <= 64
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(numbers) <= 8 and len(set(numbers)) == len(numbers)
    assert all(0 < n < 65536 for n in numbers)
    ref = spec["endpointPickerRef"]
    assert ref["name"] and ref.get("kind", "Service") == "Service" and ref["port"]["number"]
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def _check_inference_objective(doc: dict, version: str) -> None:
    spec = doc["spec"]
    assert spec["poolRef"]["name"] and spec["poolRef"].get("group") == "inference.networking.k8s.io"
    assert isinstance(spec.get("priority", 0), int)


def _check_leader_worker_set(doc: dict, version: str) -> None:
    spec = doc["spec"]
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    lwt = spec["leaderWorkerTemplate"]
    assert isinstance(lwt["size"], int) and lwt["size"] >= 1
    policies = ("Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None")
    assert lwt.get("restartPolicy", "Default") in policies
    _validate_pod_template(lwt["workerTemplate"], version)
    if "leaderTemplate" in lwt:
        _validate_pod_template(lwt["leaderTemplate"], version)


CRD_CHECKS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _check_service_monitor,
    ("inference.networking.k8s.io/v1", "InferencePool"): _check_inference_pool,
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"): _check_inference_objective,
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): _check_leader_worker_set,
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_manifest_validates(name: str, doc: dict, version: str) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key not in CRD_CHECKS:
        _validate_builtin(doc, version)
        return
    with pytest.raises(kv.SchemaNotFoundError):  # a CRD: kubernetes-validate has no schema for it
        kv.validate(doc, version, strict=True)
    # Its ObjectMeta, as a built-in object's.
    _validate_builtin({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, version)
    CRD_CHECKS[key](doc, version)


def test_kustomization_lists_existing_files() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource


# --- commands: every flag one our parser accepts --------------------------------------------


def _containers() -> list[tuple[str, dict]]:
    deployment = _one("deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    lwt = _one("leaderworkerset.yaml", "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    found = [("deployment", c) for c in deployment["containers"]]
    found += [("lws-leader", c) for c in lwt["leaderTemplate"]["spec"]["containers"]]
    found += [("lws-worker", c) for c in lwt["workerTemplate"]["spec"]["containers"]]
    return found


CONTAINERS = _containers()


def _argv(where: str, container: dict) -> list[str]:
    """The container's command line, LWS's variables filled in as the kubelet would."""
    injected = LWS_ENV if where.startswith("lws") else {}
    defined = {e["name"] for e in container.get("env", [])} | set(injected)

    def expand(arg: str) -> str:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in defined, f"{where}: $({var}) is not defined in the container"
        return re.sub(r"\$\((\w+)\)", lambda m: injected.get(m.group(1), "x"), arg)

    return [expand(a) for a in container["command"] + container.get("args", [])]


def _subparser(name: str) -> argparse.ArgumentParser | None:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices.get(name)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("where,container", CONTAINERS, ids=[w for w, _ in CONTAINERS])
def test_command_flags_are_ours(where: str, container: dict) -> None:
    argv = _argv(where, container)
    assert argv[0] == "dolmus", "the image's entry point"
    sub = _subparser(argv[1])
    if sub is None and argv[1] == "worker":
        pytest.skip("dolmus worker not in this tree")
    assert sub is not None, f"no `dolmus {argv[1]}`"
    if "--nnodes" in argv and "--nnodes" not in sub._option_string_actions:
        pytest.skip(f"dolmus {argv[1]} --nnodes (multi-host flags) not in this tree")
    # Whole flag names only: argparse would also take an abbreviation.
    for arg in argv[2:]:
        if arg.startswith("--"):
            assert arg.split("=")[0] in sub._option_string_actions, f"dolmus {argv[1]}: unknown flag {arg}"
    try:
        build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"dolmus {' '.join(shlex.quote(a) for a in argv[1:])}: rejected by the parser")


def test_leader_and_worker_agree() -> None:
    """Both ranks meet at the leader; the leader opens the rendezvous port and the next one."""
    lws = _one("leaderworkerset.yaml", "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    (leader,) = lws["leaderTemplate"]["spec"]["containers"]
    (worker,) = lws["workerTemplate"]["spec"]["containers"]
    la, wa = leader["command"] + leader["args"], worker["command"] + worker["args"]
    assert la[1] == "serve" and wa[1] == "worker"
    size = lws["size"]
    for argv in (la, wa):
        assert int(_flag(argv, "--tensor-parallel-size")) == size == int(_flag(argv, "--nnodes"))
        assert _flag(argv, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert _flag(argv, "--model") == _flag(la, "--model")
    assert _flag(la, "--node-rank") == "0" and _flag(wa, "--node-rank") == "$(LWS_WORKER_INDEX)"
    port = int(_flag(la, "--master-port"))
    assert int(_flag(wa, "--master-port")) == port
    opened = {p["containerPort"] for p in leader["ports"]}
    assert {port, port + 1} <= opened, "torch.distributed on master-port, the control channel on the next"
    assert "readinessProbe" not in worker and "readinessProbe" in leader


# --- probes, ports, selectors ---------------------------------------------------------------


def _serving() -> list[tuple[str, dict]]:
    return [(w, c) for w, c in CONTAINERS if _argv(w, c)[1] == "serve"]


def _container_port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


@pytest.mark.parametrize("where,container", _serving(), ids=[w for w, _ in _serving()])
def test_probes_hit_health_on_the_served_port(where: str, container: dict) -> None:
    argv = _argv(where, container)
    served = int(_flag(argv, "--port")) if "--port" in argv else ServerConfig().port
    assert _flag(argv, "--host") == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert _container_port(container, get["port"]) == served, probe
    startup = container["startupProbe"]
    # /health is 503 until the model is loaded: give loading at least 10 minutes.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]


def _pod_labels(template: dict, extra: dict | None = None) -> dict:
    return {**template["metadata"].get("labels", {}), **(extra or {})}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_service_selects_the_deployment_pods() -> None:
    deployment = _one("deployment.yaml", "Deployment")
    service = _one("service.yaml", "Service")
    template = deployment["spec"]["template"]
    labels = _pod_labels(template)
    assert _selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert _selects(service["spec"]["selector"], labels)
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    (container,) = template["spec"]["containers"]
    assert port["port"] == 8000 == _container_port(container, port["targetPort"])
    # ... and none of the LeaderWorkerSet's pods, whose workers serve no HTTP.
    lws = _one("leaderworkerset.yaml", "LeaderWorkerSet")
    lws_label = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
    for role in ("leaderTemplate", "workerTemplate"):
        assert not _selects(
            service["spec"]["selector"], _pod_labels(lws["spec"]["leaderWorkerTemplate"][role], lws_label)
        )
    # The ServiceMonitor finds the Service and its named port.
    monitor = _one("servicemonitor.yaml", "ServiceMonitor")
    assert _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    # Annotation-based scraping points at the same port and path.
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port["port"]


def test_lws_service_selects_only_leaders() -> None:
    lws = _one("leaderworkerset.yaml", "LeaderWorkerSet")
    service = _one("leaderworkerset.yaml", "Service")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    lws_label = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
    assert _selects(service["spec"]["selector"], _pod_labels(lwt["leaderTemplate"], lws_label))
    assert not _selects(service["spec"]["selector"], _pod_labels(lwt["workerTemplate"], lws_label))


def test_model_volume_is_the_pvc() -> None:
    claim = _one("pvc.yaml", "PersistentVolumeClaim")["metadata"]["name"]
    lwt = _one("leaderworkerset.yaml", "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    templates = [
        _one("deployment.yaml", "Deployment")["spec"]["template"],
        lwt["leaderTemplate"],
        lwt["workerTemplate"],
    ]
    for template in templates:
        (volume,) = [v for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"]["claimName"] == claim
        (container,) = template["spec"]["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        argv = container["command"] + container["args"]
        assert mount["mountPath"] == "/models" and _flag(argv, "--model").startswith("/models/")


# --- the inference extension: the pool, its picker, and the metric names it reads -----------


def test_inference_pool_selects_dolmus_and_its_picker() -> None:
    pool = _one("inferencepool.yaml", "InferencePool")
    deployment = _one("deployment.yaml", "Deployment")
    template = deployment["spec"]["template"]
    assert _selects(pool["spec"]["selector"]["matchLabels"], _pod_labels(template))
    (container,) = template["spec"]["containers"]
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= {
        p["containerPort"] for p in container["ports"]
    }
    objective = _one("inferencepool.yaml", "InferenceObjective")
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    # endpointPickerRef names epp.yaml's Service and port; the picker serves that pool.
    ref = pool["spec"]["endpointPickerRef"]
    service = _one("epp.yaml", "Service")
    assert service["metadata"]["name"] == ref["name"]
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    epp = _one("epp.yaml", "Deployment")["spec"]["template"]
    assert _selects(service["spec"]["selector"], _pod_labels(epp))
    (picker,) = epp["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in picker["args"]
    config_map = _one("inferencepool.yaml", "ConfigMap")
    (volume,) = epp["spec"]["volumes"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    config_arg = next(a for a in picker["args"] if a.startswith("--config-file="))
    mount = next(m for m in picker["volumeMounts"] if m["name"] == volume["name"])
    assert config_arg.split("=", 1)[1] == f"{mount['mountPath']}/{next(iter(config_map['data']))}"


def _rendered_metrics() -> dict[str, str]:
    """The metric families our /metrics renders, by name, with their types."""
    from dolmus.engine.metrics import EngineMetrics
    from dolmus.engine.stats import EngineStats

    stats = EngineStats(
        num_running=1, num_waiting=2, num_preemptions=0, kv_blocks_total=10, kv_blocks_used=3,
        kv_blocks_free=7, kv_usage=0.3, prefix_cache_queries=0, prefix_cache_hits=0,
        prefix_cache_hit_rate=0.0, prompt_tokens=0, generation_tokens=0,
    )  # fmt: skip
    text = EngineMetrics("m", lambda: stats).render().decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_picker_reads_metrics_we_expose() -> None:
    config = yaml.safe_load(next(iter(_one("inferencepool.yaml", "ConfigMap")["data"].values())))
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    exposed = _rendered_metrics()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        name = engine[key].split("{")[0]
        assert exposed.get(name) == "gauge", f"{key}: {name} is not a gauge on our /metrics"
    # What we do not expose is switched off, not left to fail on every scrape.
    for key in ("loraSpec", "cacheInfoSpec"):
        assert engine[key] == "" or engine[key].split("{")[0] in exposed
    sources = config["data"]["sources"]
    assert [e["pluginRef"] for s in sources for e in s["extractors"]] == ["core-metrics-extractor"]


# --- the Dockerfiles (parsed, not built) ----------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile(dockerfile: str) -> None:
    steps = _instructions(DEPLOY / dockerfile)
    of = {}
    for op, arg in steps:
        of.setdefault(op, []).append(arg)
    base = of["FROM"][0]
    if dockerfile == "Dockerfile":
        assert base == "python:3.11-slim"
    else:
        assert base == "${CUDA_IMAGE}" and any(a.startswith("CUDA_IMAGE=nvidia/cuda:") for a in of["ARG"])
    runs = of["RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "pip install" in r and "torch==2.13.0" in r)
    if dockerfile == "Dockerfile":
        assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch_at]
    assert any(re.search(r"pip install .*\s\.(\s|$)", r) for r in runs[torch_at + 1 :]), (
        "the package after torch"
    )
    # Everything copied in exists and is not excluded by .dockerignore.
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "bench_out"} <= ignored
    for copy in of["COPY"]:
        for src in copy.split()[:-1]:
            assert (ROOT / src).exists() and src not in ignored, src
    assert of["USER"][-1] not in ("root", "0") and of["USER"][-1].isdigit()
    assert of["EXPOSE"] == ["8000"]
    assert "/health" in of["HEALTHCHECK"][0]
    assert json.loads(of["ENTRYPOINT"][0]) == ["dolmus"]
    cmd = json.loads(of["CMD"][0])
    assert cmd == ["serve", "--host", "0.0.0.0"]
    build_parser().parse_args(cmd)
