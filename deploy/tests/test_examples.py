"""The workload examples promise only what exists, rendered beside every deployment: clients that
trust the uid of the daemon serving their socket, GPU pods that hold whole nodes one per node, a
headless Service that finds every vLLM server; a GPU sidecar that can see the GPUs whose CUDA
IPC handles it imports, vLLM servers that take their weights through the shardcast plugin (the
flags and the image vLLM and deploy/docker/Dockerfile.vllm have; no made-up flag), and rollout
replicas as a StatefulSet whose program, run here against real daemons, registers each pod as the
replica its ordinal names and follows `kubectl scale`."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import grpc
import numpy as np
import pytest
import shardcast
import yaml
from google.protobuf import json_format
from shardcast.local import LocalCluster
from shardcast.v1 import layout_pb2, service_pb2, service_pb2_grpc

from conftest import (DEPLOYMENTS, K8S, ROOT, binary, by_kind, daemonset_pod, example_pods, render_deployment,
                      render_with_examples, workload_pods)


def sidecar_pod() -> dict:
    objects = list(yaml.safe_load_all((K8S / "examples" / "native-sidecar.yaml").read_text()))
    return by_kind(objects, "Job")["rl-trainer-sidecar"]["spec"]["template"]["spec"]


def test_gpu_sidecar_sees_the_gpus_of_the_trainer():
    """The device plugin shows a container only the GPUs it requested, so the sidecar requests
    none and asks the NVIDIA runtime for all of them, in a pod that takes every GPU of its node:
    the same GPUs, numbered the same, in both containers."""
    pod = sidecar_pod()
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "shardcastd")
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    assert sidecar["restartPolicy"] == "Always"
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert sidecar["image"].endswith("-cuda"), "the CUDA build imports CUDA IPC handles"
    assert not any("nvidia.com/gpu" in sidecar["resources"].get(k, {}) for k in ("requests", "limits"))
    gpus = trainer["resources"]["limits"]["nvidia.com/gpu"]
    assert pod["nodeSelector"]["nvidia.com/gpu.count"] == gpus, "the trainer must take every GPU of its node"
    text = (K8S / "examples" / "native-sidecar.yaml").read_text()
    assert "device plugin gives GPUs to a container, not to a pod" in text


def test_sidecar_and_trainer_can_reach_each_other():
    """The socket is 0660 for the daemon's group, and clients trust the daemon's uid by name."""
    pod = sidecar_pod()
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "shardcastd")
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    daemon = sidecar["securityContext"]
    assert daemon["runAsGroup"] in pod["securityContext"]["supplementalGroups"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["SHARDCAST_DAEMON_UID"] == str(daemon["runAsUser"])
    assert trainer["securityContext"]["runAsUser"] not in (0, daemon["runAsUser"])
    mounts = lambda c: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}  # noqa: E731
    for path in ("/run/shardcast", "/dev/shm"):
        assert mounts(sidecar)[path] == mounts(trainer)[path], path
    assert "/etc/shardcast/tls" not in mounts(trainer), "the daemon's key stays in the daemon's container"


def test_no_example_runs_a_made_up_flag():
    for path in sorted((K8S / "examples").glob("*.yaml")):
        assert "--weight-sync" not in path.read_text(), path


@pytest.mark.parametrize("name", ["inference-deployment.yaml", "vllm-sidecar.yaml"])
def test_the_vllm_examples_run_vllm_with_the_plugin(name):
    objects = list(yaml.safe_load_all((K8S / "examples" / name).read_text()))
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["name"] == "vllm")
    command = server["command"]
    assert command[:2] == ["vllm", "serve"]
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {"backend": "shardcast"}
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # the RL routes the trainer's HTTP client calls
    # The image is the one deploy/docker/Dockerfile.vllm builds: vLLM's, with the plugin installed.
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.vllm").read_text()
    assert server["image"].split(":")[0] in dockerfile
    assert "pip install" in dockerfile and "client/python" in dockerfile and "shardcast.vllm.plugin" in dockerfile
    # The plugin's entry point, as the package declares it.
    pyproject = (ROOT / "client" / "python" / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in pyproject


def test_the_vllm_sidecar_shares_socket_and_shm_with_vllm():
    objects = list(yaml.safe_load_all((K8S / "examples" / "vllm-sidecar.yaml").read_text()))
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    service = next(o for o in objects if o["kind"] == "Service")
    pod = deployment["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "shardcastd")
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert sidecar["restartPolicy"] == "Always"
    mounts = lambda c: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}  # noqa: E731
    for path in ("/run/shardcast", "/dev/shm"):
        assert mounts(sidecar)[path] == mounts(vllm)[path], path
    assert "/etc/shardcast/tls" not in mounts(vllm), "the daemon's key stays in the daemon's container"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert f"--peer-dns={service['metadata']['name']}.$(POD_NAMESPACE).svc:7070" in sidecar["args"]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["SHARDCAST_DAEMON_UID"] == str(sidecar["securityContext"]["runAsUser"])


# ---- every example beside every deployment: what a workload needs from the daemon it uses ----

SOCKET_DIR = os.path.dirname(shardcast.DEFAULT_SOCKET)


def is_daemon(container: dict) -> bool:
    return any(a.startswith("--socket=") for a in container.get("args", []))


def socket_users(objects: list):
    """(workload, pod, container, uid of the daemon serving its socket) for every container that
    mounts the socket's directory: the DaemonSet's daemon where the mount is its host directory,
    the pod's own sidecar where it is a volume the two share."""
    daemonset = daemonset_pod(objects)
    daemonset_dir = next(v["hostPath"]["path"] for v in daemonset["volumes"] for m in daemonset["containers"][0]["volumeMounts"]
                         if m["mountPath"] == SOCKET_DIR and m["name"] == v["name"])
    for name, (_, pod) in workload_pods(objects).items():
        containers = pod.get("initContainers", []) + pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in containers:
            mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == SOCKET_DIR), None)
            if mount is None or is_daemon(c):
                continue
            if volumes[mount["name"]].get("hostPath", {}).get("path") == daemonset_dir:
                uid = daemonset["securityContext"]["runAsUser"]
            else:
                sidecar = next(d for d in containers if is_daemon(d)
                               and any(m["name"] == mount["name"] for m in d["volumeMounts"]))
                uid = sidecar["securityContext"]["runAsUser"]
            yield name, pod, c, uid


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_every_container_that_mounts_the_socket_trusts_its_daemons_uid(kubectl, where):
    """Clients believe only a daemon running as root, as themselves or as a uid of
    $SHARDCAST_DAEMON_UID; the daemons run as 10001, so without it every call is refused."""
    checked = set()
    for name, pod, container, uid in socket_users(render_with_examples(where)):
        env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
        assert str(uid) in env.get("SHARDCAST_DAEMON_UID", "").split(","), f"{name}: {container['name']}"
        own = (container.get("securityContext") or {}).get("runAsUser", pod["securityContext"].get("runAsUser"))
        assert own not in (None, 0, uid), f"{name}: {container['name']} runs as {own}"
        checked.add(name)
    assert len(checked) >= 5, checked  # every workload example


def test_the_socket_checklist_names_what_every_workload_sets(kubectl):
    """docs/deploy.md's list of what a workload needs names each SHARDCAST_* variable that every
    example's client container sets, and the pod settings the DaemonSet's clients share."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index("Then point workloads at the socket")
    checklist = text[start:text.index("\n\n", start)]
    users = list(socket_users(render_with_examples("base")))
    common = set.intersection(*({e["name"] for e in c.get("env", []) if e["name"].startswith("SHARDCAST_")}
                                for _, _, c, _ in users))
    assert "SHARDCAST_DAEMON_UID" in common
    for item in (*sorted(common), "hostIPC: true", "supplementalGroups", "/dev/shm", SOCKET_DIR,
                 "examples/00-namespace.yaml"):
        assert item in checklist, f"docs/deploy.md's checklist does not name {item}"


def gpus(pod: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
               for c in pod.get("initContainers", []) + pod["containers"])


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_gpu_workloads_hold_whole_nodes_one_pod_per_node(kubectl, where):
    """The examples' placement (docs/deploy.md): a GPU pod takes every GPU of its node, and the
    pods of one workload repel each other per node as a requirement (one replica per node; the
    native sidecars need one daemon per node)."""
    for name, (workload, pod) in workload_pods(render_with_examples(where)).items():
        if not gpus(pod):
            continue
        assert pod.get("nodeSelector", {}).get("nvidia.com/gpu.count") == str(gpus(pod)), name
        spec = workload["spec"]
        if max(spec.get("replicas", 1), spec.get("parallelism", 1)) == 1:
            continue
        labels = spec["template"]["metadata"]["labels"]
        terms = pod.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
        assert any(t["topologyKey"] == "kubernetes.io/hostname" and t["labelSelector"]["matchLabels"]
                   and t["labelSelector"]["matchLabels"].items() <= labels.items() for t in terms), name


def test_the_trainer_finds_every_vllm_server_through_a_headless_service(kubectl):
    """A headless Service over the vLLM pods resolves to every ready server's address; it selects
    those pods alone and names the port the trainer's HTTP client calls."""
    objects = render_with_examples("base")
    deployment = by_kind(objects, "Deployment")["rl-inference"]
    service = by_kind(objects, "Service")["rl-inference"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses"), "only servers that are ready"
    assert service["spec"]["selector"] and service["spec"]["selector"].items() <= labels.items()
    others = [n for n, (o, _) in workload_pods(objects).items() if o is not deployment
              and service["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()]
    assert not others, f"the Service also selects {others}"
    vllm = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    [port] = service["spec"]["ports"]
    assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
    assert vllm["readinessProbe"]["httpGet"]["port"] == port["targetPort"]
    assert vllm["command"][vllm["command"].index("--port") + 1] == str(port["port"])
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc" in text


# ---- rollout-replicas.yaml: a replica set as a StatefulSet (docs/deploy.md, "Rollout replicas") ----

ROLLOUT = "rollout-replicas.yaml"


def rollout() -> Tuple[dict, dict, dict]:
    """(StatefulSet, its pod spec, the rollout container) of the rollout example."""
    objects = list(yaml.safe_load_all((K8S / "examples" / ROLLOUT).read_text()))
    statefulset = by_kind(objects, "StatefulSet")["rollout"]
    pod = statefulset["spec"]["template"]["spec"]
    return statefulset, pod, next(c for c in pod["containers"] if c["name"] == "rollout")


def test_rollout_replicas_never_share_a_node():
    """Each pod takes every GPU of its node (the daemon reads a client's CUDA device numbers as its
    own), so the StatefulSet's pods repel each other per node, as a requirement (a preference lets
    the scheduler stack them when it likes), selecting exactly the StatefulSet's own pods."""
    statefulset, pod, _ = rollout()
    spec = statefulset["spec"]
    assert spec["podManagementPolicy"] == "Parallel"
    labels = spec["template"]["metadata"]["labels"]
    selector = spec["selector"]["matchLabels"]
    assert selector and selector.items() <= labels.items()
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [(t["topologyKey"], t["labelSelector"]) for t in terms] == [
        ("kubernetes.io/hostname", {"matchLabels": selector})]
    assert not any(k in t for t in terms for k in ("namespaces", "namespaceSelector")), "the set's own namespace"
    # The governing Service a StatefulSet names exists and selects its pods.
    objects = list(yaml.safe_load_all((K8S / "examples" / ROLLOUT).read_text()))
    service = by_kind(objects, "Service")[spec["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= labels.items()


def test_a_rollout_replicas_id_comes_from_its_pod_name_and_its_set_from_the_env():
    _, pod, container = rollout()
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # <statefulset>-<ordinal>
    assert env["SHARDCAST_REPLICA_SET"]["value"] == "rollout"
    # What the program makes of them: test_the_rollout_program_registers_its_replica_and_follows_kubectl_scale.
    assert container["command"][:2] == ["python3", "-c"]
    # One TP rank per GPU, and the pod takes every GPU of its node (the examples' placement).
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert env["TP_SIZE"]["value"] == gpus == pod["nodeSelector"]["nvidia.com/gpu.count"]
    # The image of the inference example: Dockerfile.vllm's, which installs the shardcast client.
    inference = next(c for p in example_pods("inference-deployment.yaml").values() for c in p["containers"])
    assert container["image"] == inference["image"]
    models = next(m for m in container["volumeMounts"] if m["name"] == "models")
    assert env["MODEL_DIR"]["value"].startswith(models["mountPath"] + "/") and models["readOnly"] is True


def test_rollout_pods_reach_the_daemonsets_socket(kubectl):
    """The socket, /dev/shm and the daemon's group and uid, as the DaemonSet (rendered) has them."""
    daemonset = daemonset_pod(render_deployment("base"))
    daemon = daemonset["containers"][0]
    socket = next(a.split("=", 1)[1] for a in daemon["args"] if a.startswith("--socket="))
    host_path = lambda p, c, path: next(v["hostPath"]["path"] for v in p["volumes"]  # noqa: E731
                                        for m in c["volumeMounts"] if m["mountPath"] == path and m["name"] == v["name"])
    _, pod, container = rollout()
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHARDCAST_SOCKET"] == socket
    for path in (os.path.dirname(socket), "/dev/shm"):
        assert host_path(pod, container, path) == host_path(daemonset, daemon, path), path
    assert pod["hostIPC"] is True
    assert daemonset["securityContext"]["runAsGroup"] in pod["securityContext"]["supplementalGroups"]
    assert env["SHARDCAST_DAEMON_UID"] == str(daemonset["securityContext"]["runAsUser"])
    assert pod["securityContext"]["runAsUser"] not in (0, daemonset["securityContext"]["runAsUser"])


# A small Llama-like checkpoint in two safetensors files: what the program reads its shapes from.
MODEL = {"model.embed_tokens.weight": [64, 16], "model.layers.0.self_attn.q_proj.weight": [16, 16],
         "model.layers.0.self_attn.k_proj.weight": [8, 16], "model.layers.0.self_attn.v_proj.weight": [8, 16],
         "model.layers.0.self_attn.o_proj.weight": [16, 16], "model.layers.0.mlp.gate_proj.weight": [32, 16],
         "model.layers.0.mlp.up_proj.weight": [32, 16], "model.layers.0.mlp.down_proj.weight": [16, 32],
         "model.layers.0.input_layernorm.weight": [16], "model.norm.weight": [16], "lm_head.weight": [64, 16]}


def write_checkpoint(directory: Path) -> Path:
    """MODEL as float32 safetensors, split over two files (the format: an 8-byte little-endian
    header length, the JSON header, the data)."""
    directory.mkdir()
    names = list(MODEL)
    for i, part in enumerate((names[:5], names[5:])):
        header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in part:
            size = 4 * math.prod(MODEL[name])
            header[name] = {"dtype": "F32", "shape": MODEL[name], "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        (directory / f"model-0000{i + 1}-of-00002.safetensors").write_bytes(
            struct.pack("<Q", len(text)) + text + bytes(offset))
    return directory


class RolloutPod:
    """The rollout container's program run as the StatefulSet runs it in pod `name`: the
    container's environment (POD_NAME from the downward API), with the local daemon's socket and
    the checkpoint above in place of the host's."""

    def __init__(self, name: str, socket: str, model_dir: Path, log_dir: Path) -> None:
        _, _, container = rollout()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
        for e in container["env"]:
            downward = {"metadata.name": name}  # the only field the container takes from its pod
            env[e["name"]] = e["value"] if "value" in e else downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
        env.update(SHARDCAST_SOCKET=socket, MODEL_DIR=str(model_dir))
        self.log = log_dir / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, *container["command"][1:]], env=env, stdout=out,
                                         stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, line: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.output().splitlines():
            assert self.proc.poll() is None, f"the program ended ({self.proc.returncode}):\n{self.output()}"
            assert time.monotonic() < deadline, f"no line {line!r} after {timeout} s:\n{self.output()}"
            time.sleep(0.1)

    def terminate(self) -> int:
        """What the kubelet does to a pod scaled in: SIGTERM (then SIGKILL after the grace period)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def replicas_listed(client: shardcast.Client) -> Dict[str, Tuple[str, int, str, Tuple[str, ...]]]:
    """{group: (replica_set, replica, node, rank states)} of the registered replica groups."""
    out: Dict[str, list] = {}
    for r in sorted(client.list(all_nodes=True).ranks, key=lambda r: (r.group, r.rank)):
        if r.replica_set:
            out.setdefault(r.group, [r.replica_set, r.replica, r.node, ()])[3] += (shardcast.describe_rank(r),)
    return {g: tuple(v) for g, v in out.items()}


def abandon_a_sync_into(cluster: LocalCluster, node: str, group: str, src: dict, version: int) -> None:
    """A sync attempt into `group` prepared at `node` as a coordinator would (the daemons' own
    identity), then left alone: its 200 ms lease runs out and the daemon marks the ranks dirty."""
    channel = grpc.secure_channel(cluster.daemons[node].address, cluster.daemon_tls.channel_credentials(),
                                  options=[("grpc.ssl_target_name_override", "shardcast-daemon")])
    with channel:
        peer = service_pb2_grpc.PeerStub(channel)
        layouts = peer.Describe(service_pb2.DescribeRequest(), timeout=30).layouts
        dst = next(layout for layout in layouts if layout.group == group)
        prepare = service_pb2.PrepareRequest(sync_id="abandoned", version=version, staging_bytes=1 << 30,
                                             chunk_bytes=64 << 20, lease_ms=200, write_key=os.urandom(16),
                                             packed=True)
        prepare.src.CopyFrom(json_format.ParseDict(src, layout_pb2.Layout()))
        prepare.dst.CopyFrom(dst)
        peer.Prepare(prepare, timeout=30)


def wait_until(condition: Callable[[], bool], what: Callable[[], str], timeout: float = 60) -> None:
    """Polls `condition`; fails with `what()` (said when it fails) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.1)


def test_the_rollout_program_registers_its_replica_and_follows_kubectl_scale(tmp_path):
    """The container's program, run with real daemons as pods rollout-0 and rollout-1 on nodes of
    their own: each registers its TP ranks as replica <ordinal> of the set its env names, and
    serves each version a sync brings. Scaled in (SIGTERM), a pod ends at once, its ranks
    unregister, and the next sync plans without it; scaled out again, it registers empty and the
    next sync reaches it (no catch-up of the version it missed). Dirty ranks (a sync that wrote
    part of a version and never committed) it waits out, serving nothing, until a sync repairs them."""
    binary("shardcastd")
    _, _, container = rollout()
    replica_set = next(e["value"] for e in container["env"] if e["name"] == "SHARDCAST_REPLICA_SET")
    tp = int(next(e["value"] for e in container["env"] if e["name"] == "TP_SIZE"))
    model_dir = write_checkpoint(tmp_path / "model")
    pods: Dict[str, RolloutPod] = {}
    with LocalCluster(["trainer-node", "node-a", "node-b"]) as cluster:
        client = shardcast.Client(cluster.target("trainer-node"))
        layout = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["trainer-node"],
                  "tensors": [{"name": n, "shape": s, "dtype": "float32"} for n, s in MODEL.items()]}
        trainer = client.register("trainer", 0, 1, {n: np.zeros(s, np.float32) for n, s in MODEL.items()}, layout,
                                  role="source")

        def publish_and_sync(version: int) -> Dict[str, Tuple[bool, str]]:
            with trainer.writing(version):
                for x in trainer.tensors.values():
                    x[...] = version
            resp = client.sync("trainer", replica_set, version)
            return {o.group: (o.committed, o.cut) for o in resp.replicas}

        def start(pod: str, node: str) -> RolloutPod:
            pods[pod] = RolloutPod(pod, cluster.daemons[node].socket, model_dir, tmp_path)
            return pods[pod]

        try:
            start("rollout-0", "node-a")
            start("rollout-1", "node-b")
            empty = ("empty",) * tp
            expected = {f"{replica_set}.r0": (replica_set, 0, "node-a", empty),
                        f"{replica_set}.r1": (replica_set, 1, "node-b", empty)}
            wait_until(lambda: replicas_listed(client) == expected,
                       lambda: f"the replicas did not register: {replicas_listed(client)}\n"
                               + "".join(pod.output() for pod in pods.values()))
            for k, pod in enumerate(pods.values()):
                pod.wait_for(f"{replica_set}.r{k}: {tp} ranks registered on node {'node-' + 'ab'[k]}, "
                             "waiting for the next sync")

            assert publish_and_sync(1) == {f"{replica_set}.r0": (True, ""), f"{replica_set}.r1": (True, "")}
            pods["rollout-0"].wait_for(f"{replica_set}.r0: serving version 1")
            pods["rollout-1"].wait_for(f"{replica_set}.r1: serving version 1")

            # kubectl scale statefulset rollout --replicas 1: rollout-1 ends.
            assert pods["rollout-1"].terminate() == 0, "SIGTERM must end the program (PID 1 ignores it otherwise)"
            wait_until(lambda: set(replicas_listed(client)) == {f"{replica_set}.r0"},
                       lambda: f"the scaled-in replica's ranks did not unregister: {replicas_listed(client)}")
            # The scaled-in replica is named once, as having left (not cut by a fault).
            left = publish_and_sync(2)
            assert left[f"{replica_set}.r0"] == (True, "") and set(left) == {f"{replica_set}.r0", f"{replica_set}.r1"}
            assert not left[f"{replica_set}.r1"][0] and left[f"{replica_set}.r1"][1].startswith("left the set"), left
            pods["rollout-0"].wait_for(f"{replica_set}.r0: serving version 2")

            # kubectl scale statefulset rollout --replicas 2: rollout-1 comes back, empty until the next sync.
            start("rollout-1", "node-b")
            wait_until(lambda: replicas_listed(client).get(f"{replica_set}.r1") == (replica_set, 1, "node-b", empty),
                       lambda: f"rollout-1 did not register again: {replicas_listed(client)}")
            assert "serving" not in pods["rollout-1"].output()
            assert publish_and_sync(3) == {f"{replica_set}.r0": (True, ""), f"{replica_set}.r1": (True, "")}
            pods["rollout-1"].wait_for(f"{replica_set}.r1: serving version 3")
            pods["rollout-0"].wait_for(f"{replica_set}.r0: serving version 3")
            assert replicas_listed(client) == {g: (s, k, n, ("ready(3)",) * tp)
                                               for g, (s, k, n, _) in expected.items()}

            # A sync that wrote part of a version into rollout-1 and never committed (prepared
            # there by hand, its lease left to run out) leaves its ranks dirty: the program serves
            # nothing and stays up, and the next sync that commits repairs them.
            abandon_a_sync_into(cluster, "node-b", f"{replica_set}.r1", layout, version=4)
            wait_until(lambda: replicas_listed(client)[f"{replica_set}.r1"][3] == ("dirty",) * tp,
                       lambda: f"rollout-1's ranks are not dirty: {replicas_listed(client)}")
            # The program's wait_version fails on the dirty ranks: it says so, and stays up.
            pods["rollout-1"].wait_for(f"{replica_set}.r1: ranks dirty, serving nothing until a sync repairs them")
            assert pods["rollout-1"].proc.poll() is None, pods["rollout-1"].output()
            assert f"{replica_set}.r1: serving version 4" not in pods["rollout-1"].output()
            assert publish_and_sync(4) == {f"{replica_set}.r0": (True, ""), f"{replica_set}.r1": (True, "")}
            pods["rollout-1"].wait_for(f"{replica_set}.r1: serving version 4")
        finally:
            for pod in pods.values():
                if pod.proc.poll() is None:
                    pod.proc.kill()
                    pod.proc.wait()
            trainer.close()
            client.close()
