"""The workload examples promise only what exists: a GPU sidecar that can see the GPUs whose CUDA
IPC handles it imports, and vLLM servers that take their weights through the shardcast plugin
(the flags and the image vLLM and deploy/docker/Dockerfile.vllm have; no made-up flag)."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import K8S, ROOT, by_kind


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
