"""deploy/k8s: every manifest validates against the Kubernetes schemas (offline, strict: unknown
fields are errors), and the pods are wired the way the daemon and its clients need: the Mooncake
master behind its Service, and the daemons that join it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from cluster_testing import MASTER_BINARY, needs_mooncake
from ecd_testing import REPO

from ec_daemon.cluster.mooncake import LOCAL_BUFFER_BYTES
from ec_daemon.server.config import Config
from ec_protocol.units import parse_size

K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
# Native sidecars are on by default from 1.29; check against that and the newest schemas bundled.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

Doc = dict[str, Any]


def load(name: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec


def container(spec: Doc, name: str) -> Doc:
    found: list[Doc] = [
        c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name
    ]
    assert len(found) == 1, f"one container named {name}"
    return found[0]


def mounts(c: Doc) -> dict[str, str]:
    """volume name -> mount path"""
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def volumes(spec: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in spec["volumes"]}


def volume_at(c: Doc, spec: Doc, path: Path) -> Doc:
    """The volume a container has mounted at `path` or above it."""
    name = next(n for n, m in mounts(c).items() if Path(m) == path or Path(m) in path.parents)
    return volumes(spec)[name]


def daemon_config(c: Doc, serve_config: Callable[..., Config]) -> Config:
    assert "command" not in c, "the image's entrypoint is `ecd serve`; give only args"
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    return serve_config(c["args"], env)


def check_probes(c: Doc, config: Config) -> None:
    """Startup, readiness and liveness all run the gRPC health check on the daemon's socket."""
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["ecd", "health"], probe
        assert command[command.index("--address") + 1] == f"unix://{config.socket}", probe


def ec_transfer_config(c: Doc) -> Doc:
    args = c["args"]
    parsed: Doc = json.loads(args[args.index("--ec-transfer-config") + 1])
    return parsed


def daemon_at_pod_ip(daemonset: Doc, serve_config: Callable[..., Config]) -> tuple[Doc, Config]:
    """A DaemonSet's ecd container, told its pod IP by the downward API (Kubernetes expands
    $(POD_IP) in its args), and its configuration; its probes checked."""
    ecd = container(pod_spec(daemonset), "ecd")
    env = {e["name"]: e for e in ecd["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    config = serve_config(ecd["args"])
    check_probes(ecd, config)
    return ecd, config


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path: Path, version: str) -> None:
    docs = load(path.name)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_validation_rejects_a_misspelled_field() -> None:
    """The check above can fail: strict validation rejects a field the API does not have."""
    [doc] = load("sidecar.yaml")
    spec = pod_spec(doc)
    spec["initContainers"][0]["volumeMount"] = spec["initContainers"][0].pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def vllm_engines() -> dict[tuple[str, str], Doc]:
    """The vLLM containers with the connector, by (manifest, container name)."""
    return {
        (path.name, c["name"]): c
        for path in MANIFESTS
        for doc in load(path.name)
        if doc["kind"] in ("Pod", "Deployment", "DaemonSet")
        for c in pod_spec(doc)["containers"]
        if "--ec-transfer-config" in c.get("args", [])
    }


def test_every_vllm_container_with_the_connector_uses_the_v2_model_runner() -> None:
    """The connector works only in vLLM's V2 model runner, which is not vLLM's default."""
    engines = vllm_engines()
    assert set(engines) == {("sidecar.yaml", "vllm"), ("daemonset-client.yaml", "vllm")}
    for where, engine in engines.items():
        assert {"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"} in engine["env"], where


def test_an_engine_that_only_saves_encodings_runs_the_encoder_only() -> None:
    """An ec_producer is the encoder engine of a disaggregated pair (docs/vllm.md): without
    --mm-encoder-only it loads the language model too, for nothing."""
    producers = {
        where: engine
        for where, engine in vllm_engines().items()
        if ec_transfer_config(engine)["ec_role"] == "ec_producer"
    }
    assert producers, "no manifest shows the encoder engine"
    for where, engine in producers.items():
        assert "--mm-encoder-only" in engine["args"], where


def test_sidecar_pod(serve_config: Callable[..., Config]) -> None:
    [doc] = load("sidecar.yaml")
    spec = pod_spec(doc)
    ecd, vllm = container(spec, "ecd"), container(spec, "vllm")
    # A native sidecar: an init container that keeps running beside vLLM.
    assert ecd in spec["initContainers"] and ecd["restartPolicy"] == "Always"
    config = daemon_config(ecd, serve_config)
    check_probes(ecd, config)

    # The pool directory: a memory-backed emptyDir of a fixed size, at the same path in both
    # containers (clients open pool files at the path the daemon reports).
    shm = volume_at(ecd, spec, config.shm_dir)
    assert shm["emptyDir"]["medium"] == "Memory"
    size_limit = parse_size(shm["emptyDir"]["sizeLimit"])
    assert mounts(vllm)[shm["name"]] == mounts(ecd)[shm["name"]] == str(config.shm_dir)
    assert config.max_bytes is not None and config.max_bytes <= size_limit
    # tmpfs pages count against the daemon's memory limit, which must cover the pool.
    assert parse_size(ecd["resources"]["limits"]["memory"]) > size_limit

    # The socket: a volume both containers mount, and vLLM's connector points at it.
    socket_volume = volume_at(ecd, spec, config.socket.parent)
    assert mounts(vllm)[socket_volume["name"]] == str(config.socket.parent)
    assert {"name": "ECD_ADDRESS", "value": f"unix://{config.socket}"} in vllm["env"]
    transfer = ec_transfer_config(vllm)
    assert transfer["ec_connector_module_path"] == "ec_client.vllm"
    assert transfer["ec_connector_extra_config"]["ecd_address"] == f"unix://{config.socket}"
    assert transfer["ec_connector_extra_config"]["ec_cpu_bytes"] <= config.max_bytes

    # The socket is usable by vLLM through the pod's fsGroup; pool files are the daemon's alone
    # (vLLM gets the pools it is granted over the socket).
    group = str(spec["securityContext"]["fsGroup"])
    assert config.socket_group == group
    assert (config.pool_group, config.pool_mode) == ("", 0o600)
    assert ecd["securityContext"]["runAsNonRoot"] is True


def test_daemonset_and_its_client(serve_config: Callable[..., Config]) -> None:
    [daemonset] = load("daemonset.yaml")
    assert daemonset["kind"] == "DaemonSet"
    spec = pod_spec(daemonset)
    ecd = container(spec, "ecd")
    config = daemon_config(ecd, serve_config)
    check_probes(ecd, config)
    shm = volume_at(ecd, spec, config.shm_dir)
    socket_volume = volume_at(ecd, spec, config.socket.parent)
    assert config.max_bytes is not None
    assert parse_size(ecd["resources"]["limits"]["memory"]) > config.max_bytes
    # The init container hands the host directories to the daemon's user.
    prepare = container(spec, "prepare-host-dirs")
    assert mounts(prepare) == mounts(ecd)
    assert str(ecd["securityContext"]["runAsUser"]) in " ".join(prepare["command"])

    [client] = load("daemonset-client.yaml")
    client_spec = pod_spec(client)
    vllm = container(client_spec, "vllm")
    # The client mounts the same host directories at the same paths as the daemon.
    for daemon_volume in (shm, socket_volume):
        host_path = daemon_volume["hostPath"]["path"]
        [same] = [
            v for v in client_spec["volumes"] if v.get("hostPath", {}).get("path") == host_path
        ]
        assert mounts(vllm)[same["name"]] == mounts(ecd)[daemon_volume["name"]]
    assert config.socket_group in [
        str(g) for g in client_spec["securityContext"]["supplementalGroups"]
    ]
    assert (config.pool_group, config.pool_mode) == ("", 0o600)
    transfer = ec_transfer_config(vllm)["ec_connector_extra_config"]
    assert transfer["ecd_address"] == f"unix://{config.socket}"
    assert transfer["ecd_pool"], "engines on a node share one cache through a named pool"


def flag_values(args: list[str]) -> dict[str, str]:
    """--name=value arguments (mooncake_master's gflags form) by name."""
    return dict(a.removeprefix("--").split("=", 1) for a in args)


def test_the_master_runs_from_the_ecd_image_behind_a_service_of_its_ports() -> None:
    _, service, deployment = load("mooncake-master.yaml")
    assert deployment["kind"] == "Deployment" and deployment["spec"]["replicas"] == 1
    # Never two masters at once: each would hold a directory of its own.
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    master = container(pod_spec(deployment), "master")
    # The binary ships in the mooncake extra the ecd image installs.
    [daemon] = load("daemonset.yaml")
    assert master["image"] == container(pod_spec(daemon), "ecd")["image"]
    assert master["command"] == ["mooncake_master"]
    flags = flag_values(master["args"])
    assert flags["enable_http_metadata_server"] == "true"
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert ports == {
        "rpc": int(flags["rpc_port"]),
        "metadata": int(flags["http_metadata_server_port"]),
        "metrics": int(flags["metrics_port"]),
    }
    assert master["securityContext"]["runAsNonRoot"] is True


@needs_mooncake
@pytest.mark.parametrize("manifest", ["mooncake-master.yaml", "mooncake-master-ha.yaml"])
def test_every_flag_given_to_the_master_is_one_mooncake_master_has(manifest: str) -> None:
    [deployment] = [doc for doc in load(manifest) if doc["kind"] == "Deployment"]
    given = flag_values(container(pod_spec(deployment), "master")["args"])
    known = subprocess.run(
        [MASTER_BINARY, "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert [flag for flag in given if f"-{flag} (" not in known] == []


def test_the_daemons_follow_the_leader_the_ha_masters_elect_through_the_same_etcd(
    serve_config: Callable[..., Config],
) -> None:
    """Two masters elect a leader through a three-member etcd and replicate the directory (the
    oplog); the daemons' settings (the ConfigMap) name the same etcd members, and no metadata
    server, which would die with a leader."""
    configmap, _, _, service, etcd, deployment = load("mooncake-master-ha.yaml")
    config = serve_config(["--transfer-host=10.0.0.7"], configmap["data"])
    master = container(pod_spec(deployment), "master")
    flags = flag_values(master["args"])
    assert deployment["spec"]["replicas"] == 2 and master["command"] == ["mooncake_master"]
    assert (flags["enable_ha"], flags["enable_oplog"], flags["rpc_address"]) == (
        "true",
        "true",
        "$(POD_IP)",
    )
    assert "enable_http_metadata_server" not in flags and config.store_metadata == "P2PHANDSHAKE"
    assert config.store_master == "etcd://" + flags["etcd_endpoints"]
    # Each endpoint is one member of the StatefulSet, by its name behind the headless Service.
    name = service["metadata"]["name"]
    assert etcd["spec"]["serviceName"] == name and service["spec"]["clusterIP"] == "None"
    members = [
        f"etcd-{i}.{name}.default.svc.cluster.local:2379" for i in range(etcd["spec"]["replicas"])
    ]
    assert flags["etcd_endpoints"].split(";") == members and len(members) == 3


def test_only_the_daemons_reach_the_master_and_its_metadata_server() -> None:
    """Neither authenticates, and the metadata server listens on every address whatever its
    flags say (Mooncake 0.3): the NetworkPolicy is what confines them."""
    policy, service, deployment = load("mooncake-master.yaml")
    [_, daemonset] = load("daemonset-store.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"] == {"matchLabels": labels}
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    admitted = {
        port["port"]: source
        for rule in policy["spec"]["ingress"]
        for source in [rule["from"]]  # a rule with no `from` would admit anyone
        for port in rule["ports"]
    }
    assert sorted(admitted) == sorted(ports.values())  # every port, each by one rule
    daemons = [
        {"podSelector": {"matchLabels": daemonset["spec"]["template"]["metadata"]["labels"]}}
    ]
    assert admitted[ports["rpc"]] == admitted[ports["metadata"]] == daemons
    # The metrics port also serves the master's admin API: Prometheus' namespace alone.
    [scraper] = admitted[ports["metrics"]]
    assert list(scraper) == ["namespaceSelector"]


def test_daemonset_with_a_store_joins_the_master_service_and_its_memory_covers_the_segment(
    serve_config: Callable[..., Config],
) -> None:
    policy, daemonset = load("daemonset-store.yaml")
    _, service, _ = load("mooncake-master.yaml")
    ecd, config = daemon_at_pod_ip(daemonset, serve_config)
    # The master and its metadata server, at the Service's name and ports.
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    master = urlsplit(f"//{config.store_master}")
    assert str(master.hostname).startswith(service["metadata"]["name"] + ".")
    assert master.port == ports["rpc"]
    metadata = urlsplit(config.store_metadata)
    assert metadata.hostname == master.hostname and metadata.port == ports["metadata"]
    # Other nodes read this node's segment at its pod IP.
    assert config.transfer_host == "$(POD_IP)"
    # The pools, the segment and the store client's buffer are all charged to the daemon.
    assert config.max_bytes is not None and config.store_segment_bytes > 0
    lent = config.max_bytes + config.store_segment_bytes + LOCAL_BUFFER_BYTES
    assert parse_size(ecd["resources"]["limits"]["memory"]) > lent
    # Only other daemons reach the transfer engine's ports.
    selector = daemonset["spec"]["template"]["metadata"]["labels"]
    rule = policy["spec"]["ingress"][0]
    assert policy["spec"]["podSelector"] == {"matchLabels": selector}
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]
    assert {p["port"]: p.get("endPort") for p in rule["ports"]} == {15000: 17000}
    # The same node-local wiring as daemonset.yaml: engine pods are unchanged.
    [plain] = load("daemonset.yaml")
    assert volumes(pod_spec(daemonset)) == volumes(pod_spec(plain))
    assert mounts(ecd) == mounts(container(pod_spec(plain), "ecd"))


@pytest.mark.parametrize("name", ["sidecar.yaml", "daemonset.yaml", "daemonset-store.yaml"])
def test_a_daemon_whose_pod_is_scraped_serves_metrics_on_the_pod_ip(
    name: str, serve_config: Callable[..., Config]
) -> None:
    """The pod is annotated for Prometheus at the container's metrics port: the daemon serves
    there on every address (its default, 127.0.0.1, would answer no scrape from outside)."""
    [doc] = [d for d in load(name) if d["kind"] in ("Deployment", "DaemonSet")]
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    ecd = container(pod_spec(doc), "ecd")
    config = serve_config(ecd["args"])
    ports = {p["name"]: p["containerPort"] for p in ecd["ports"]}
    assert annotations["prometheus.io/port"] == str(ports["metrics"]) == str(config.metrics_port)
    assert config.metrics_host == "0.0.0.0"
