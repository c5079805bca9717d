"""The manifests, the container image recipe and the systemd unit agree with the daemon itself:
flags, environment variables, ports, probes, the socket path and the libraries it links."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

import shardcast
from conftest import (DAEMONSET_EXAMPLES, DEPLOY, DEPLOYMENTS, K8S, ROOT, TLS_DIR, binary, by_kind, components_of,
                      daemonset_pod, example_pods, localize, render_deployment)

import yaml


def default_socket_of_the_cpp_clients() -> str:
    text = (ROOT / "common" / "defaults.h").read_text()
    return re.search(r'kDefaultSocket = "([^"]+)"', text).group(1)


SHIPPED = [*DEPLOYMENTS, "native-sidecar"]


def daemon_container(where: str) -> tuple:
    """(pod spec, shardcastd container, all objects) of a shardcastd we ship: the DaemonSet of a
    deployment (rendered: the base, an overlay, a combination of components), or the native
    sidecar example."""
    if where == "native-sidecar":
        objects = list(yaml.safe_load_all((K8S / "examples" / "native-sidecar.yaml").read_text()))
        pod = by_kind(objects, "Job")["rl-trainer-sidecar"]["spec"]["template"]["spec"]
        return pod, next(c for c in pod["initContainers"] if c["name"] == "shardcastd"), objects
    objects = render_deployment(where)
    pod = daemonset_pod(objects)
    return pod, pod["containers"][0], objects


def flag_values(container: dict) -> Dict[str, str]:
    values = {}
    for arg in container.get("args", []):
        m = re.fullmatch(r"--([a-z0-9-]+)=(.*)", arg)
        assert m, f"argument {arg!r} is not --flag=value"
        values[m.group(1)] = m.group(2)
    return values


def env_of(container: dict, objects: List[dict]) -> Dict[str, str]:
    """The container's environment as Kubernetes builds it (ConfigMaps first, then env)."""
    env: Dict[str, str] = {}
    maps = by_kind(objects, "ConfigMap")
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    downward = {"spec.nodeName": "test-node", "metadata.namespace": "shardcast"}
    for e in container.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(value: str, env: Dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args; an undefined variable is an error here."""
    def sub(m):
        assert m.group(1) in env, f"$({m.group(1)}) is not defined in the container's env"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


@pytest.mark.parametrize("where", SHIPPED)
def test_flags_env_ports_probes_and_socket_match_the_daemon(kubectl, daemon_flags, where):
    pod, container, objects = daemon_container(where)
    flags = flag_values(container)
    assert set(flags) <= daemon_flags.flags, f"{where}: unknown flags {set(flags) - daemon_flags.flags}"
    env = env_of(container, objects)
    for name in env:
        if name.startswith("SHARDCAST_"):
            assert name in daemon_flags.envs, f"{where}: {name} is not a shardcastd variable"
        else:
            # UCX_* are UCX's own; NVIDIA_* are read by the NVIDIA container runtime (overlays/gpu).
            assert name.startswith(("UCX_", "NVIDIA_")) or f"$({name})" in " ".join(container["args"]), (
                f"{where}: {name} is unused")
    args = {k: expand(v, env) for k, v in flags.items()}

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(args["listen"].rsplit(":", 1)[1]) == ports["grpc"]
    assert int(args["metrics"].rsplit(":", 1)[1]) == ports["metrics"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            # The gRPC port is mutual TLS, which kubelet's gRPC probes cannot speak: /healthz on the
            # metrics port (test_daemonset_daemon asks it live).
            http = container[probe]["httpGet"]
            assert http["path"] == "/healthz", f"{where}: {probe}"
            assert http["port"] in ("metrics", ports["metrics"]), f"{where}: {probe} checks another port"

    # Mutual TLS: the identity comes from the Secret the cert-manager overlay issues.
    assert "insecure" not in args, f"{where}: shipped daemons authenticate their peers"
    for flag, name in (("tls-cert", "tls.crt"), ("tls-key", "tls.key"), ("tls-ca", "ca.crt")):
        assert args[flag] == f"{TLS_DIR}/{name}", f"{where}: --{flag}"
    tls_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR)
    assert tls_mount.get("readOnly") is True
    tls_volume = next(v for v in pod["volumes"] if v["name"] == tls_mount["name"])
    assert tls_volume["secret"]["secretName"] == "shardcastd-tls"

    socket = args["socket"]
    assert socket == default_socket_of_the_cpp_clients() == shardcast.DEFAULT_SOCKET
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert os.path.dirname(socket) in mounts, f"{where}: the socket directory is not a volume"
    assert "/dev/shm" in mounts, f"{where}: clients' shared memory is not visible"
    added = container["securityContext"]["capabilities"]["add"]
    assert "IPC_LOCK" in added
    assert "DAC_OVERRIDE" in added, f"{where}: clients' segments are 0600: the daemon maps them by DAC_OVERRIDE"
    assert set(added) <= {"IPC_LOCK", "DAC_OVERRIDE"}, f"{where}: no other capability"
    assert not container["securityContext"].get("privileged", False)

    # Peers: the DNS name is the headless Service of these pods, on the gRPC port.
    host, port = args["peer-dns"].rsplit(":", 1)
    services = by_kind(objects, "Service")
    service = services[host.split(".")[0]]
    assert service["spec"]["clusterIP"] == "None"
    assert int(port) == service["spec"]["ports"][0]["port"] == ports["grpc"]
    assert "$(POD_NAMESPACE)" in flags["peer-dns"], f"{where}: the peer name must follow the pod's namespace"


@pytest.mark.parametrize("overlay", DEPLOYMENTS)
def test_services_select_the_daemon_pods(kubectl, overlay):
    objects = render_deployment(overlay)
    ds = by_kind(objects, "DaemonSet")["shardcastd"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for svc in by_kind(objects, "Service").values():
        assert svc["spec"]["selector"].items() <= labels.items()
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in port_names
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] in by_kind(objects, "ServiceAccount")


def print_config(args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    """`shardcastd ARGS --print-config` with exactly `env` as its SHARDCAST_* environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
    return subprocess.run([binary("shardcastd"), *args, "--print-config"], env={**clean, **env}, capture_output=True,
                          text=True)


@pytest.mark.parametrize("where", SHIPPED)
def test_the_daemon_accepts_each_deployments_configuration(kubectl, where, local_tls):
    """The daemon parses what each deployment gives it, and reads the values we set (the memory
    budgets the limit is computed from, the transports and protocol the rdma component relies on)."""
    _, container, objects = daemon_container(where)
    env = env_of(container, objects)
    args = [localize(expand(a, env), local_tls) for a in container["args"]]
    r = print_config(args, env)
    assert r.returncode == 0, r.stderr
    settings = dict(t.split("=", 1) for t in r.stdout.split())
    assert settings["node"] == "test-node"
    for key in ("staging_mib", "delta_cache_mib", "grpc_memory_mib", "ucx_tls", "protocol"):
        if f"SHARDCAST_{key.upper()}" in env:  # test_memory checks that the budgets are all set
            assert settings[key] == env[f"SHARDCAST_{key.upper()}"], (where, key)


def test_workload_examples_use_the_daemons_socket_and_group():
    daemonset = yaml.safe_load((K8S / "base" / "daemonset.yaml").read_text())
    group = daemonset["spec"]["template"]["spec"]["securityContext"]["runAsGroup"]
    for name in DAEMONSET_EXAMPLES:
        for pod in example_pods(name).values():
            assert group in pod["securityContext"]["supplementalGroups"], name
            assert pod["hostIPC"] is True, name
            container = pod["containers"][0]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["SHARDCAST_SOCKET"] == shardcast.DEFAULT_SOCKET
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes[mounts["/run/shardcast"]]["hostPath"]["path"] == "/run/shardcast"
            assert volumes[mounts["/dev/shm"]]["hostPath"]["path"] == "/dev/shm"


def test_systemd_unit(daemon_flags, tmp_path, local_tls):
    unit = (DEPLOY / "systemd" / "shardcastd.service").read_text()
    env_file = DEPLOY / "systemd" / "shardcastd.env"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#"))
    assert env["SHARDCAST_TLS_CERT"].startswith(TLS_DIR) and "SHARDCAST_INSECURE" not in env
    env = {k: localize(v, local_tls) for k, v in env.items()}
    assert set(env) <= daemon_flags.envs
    assert env["SHARDCAST_SOCKET"] == shardcast.DEFAULT_SOCKET
    assert "RuntimeDirectory=shardcast" in unit  # /run/shardcast, where the socket goes
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
    r = subprocess.run([binary("shardcastd"), "--print-config"], env={**clean, **env}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "peers=10.0.0.1:7070,10.0.0.2:7070" in r.stdout
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit's syntax is not verified here")
    # Verify the unit as installed, with ExecStart pointing at the binary built here.
    local = tmp_path / "shardcastd.service"
    local.write_text(unit.replace("/usr/local/bin/shardcastd", binary("shardcastd")))
    r = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True)
    problems = [l for l in r.stderr.splitlines() if "shardcastd.service" in l]
    assert not problems, r.stderr


def test_dockerfile_builds_with_the_readme_scripts_and_ships_every_library():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "bash scripts/deps.sh build" in text
    assert "bash scripts/build.sh shardcastd shardcast" in text
    runtime = text[text.index("AS runtime"):text.index("AS ucx-cuda")]
    assert re.search(r"^USER 10001", runtime, re.M), "the runtime stage must not run as root"
    assert 'ENTRYPOINT ["/usr/local/bin/shardcastd"]' in runtime
    install = re.search(r"apt-get install[^\n]*\\\n((?:.*\\\n)+?)\s*&& rm", runtime).group(1)
    listed = set(install.replace("\\", " ").split())
    # Every Debian package providing a shared library of the binaries must be installed.
    needed = set()
    for name in ("shardcastd", "shardcast"):
        for line in subprocess.run(["ldd", binary(name)], capture_output=True, text=True, check=True).stdout.splitlines():
            m = re.search(r"=> (/\S+)", line)
            if not m:
                continue
            owner = subprocess.run(["dpkg", "-S", os.path.realpath(m.group(1))], capture_output=True, text=True)
            if owner.returncode != 0:  # usrmerge: dpkg knows the /lib path
                owner = subprocess.run(["dpkg", "-S", m.group(1)], capture_output=True, text=True)
            if owner.returncode == 0:
                needed.add(owner.stdout.split(":")[0])
    essential = {"libc6", "libgcc-s1", "zlib1g"}  # in every Debian image
    sanitizers = {"libasan8", "libubsan1"}  # when these tests run on the ASan build; images are not sanitized
    missing = needed - listed - essential - sanitizers
    assert not missing, f"the runtime stage lacks {sorted(missing)}"


@pytest.mark.parametrize("where", [d for d in DEPLOYMENTS if "gpu" in components_of(d)])
def test_gpu_component_gives_the_daemon_every_gpu_and_the_cuda_image(kubectl, where):
    """The GPU component, alone or with others: the NVIDIA runtime with every GPU visible and none
    claimed (claiming nvidia.com/gpu would take GPUs from the workloads), host IPC for CUDA IPC,
    and the image the Dockerfile's runtime-cuda stage builds (the daemon compiled with CUDA, its
    runtime shipped)."""
    pod, container, _ = daemon_container(where)
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["hostIPC"] is True
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    for kind in ("requests", "limits"):
        assert not any("nvidia.com" in r for r in container.get("resources", {}).get(kind, {})), kind
    assert container["image"].endswith(f":{daemon_version()}-cuda")
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    build = text[text.index("AS build-cuda"):text.index("AS runtime-cuda")]
    assert "FROM ucx-cuda AS build-cuda" in text, "the CUDA build must have the toolkit (stage ucx-cuda)"
    assert "bash scripts/build.sh shardcastd shardcast" in build
    assert "libcudart.so" in build
    runtime = text[text.index("AS runtime-cuda"):]
    assert "COPY --from=build-cuda /out/ /" in runtime
    assert f"shardcastd:{daemon_version()}-cuda" in text


def daemon_version() -> str:
    """The release: kShardcastVersion in common/defaults.h, what `shardcastd --version` prints."""
    return re.search(r'kShardcastVersion = "([^"]+)"', (ROOT / "common" / "defaults.h").read_text()).group(1)


SHARDCASTD_IMAGE = "ghcr.io/shardcast/shardcastd"


def shardcastd_images(objects: List[dict]) -> List[str]:
    """Every container image of shardcastd's repository in these objects (init containers too)."""
    images = []
    for o in objects:
        pod = (((o.get("spec") or {}).get("template") or {}).get("spec")) or {}
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            if c["image"].split(":")[0] == SHARDCASTD_IMAGE:
                images.append(c["image"])
    return images


@pytest.mark.parametrize("where", SHIPPED)
def test_every_shardcastd_image_is_the_daemons_version(kubectl, where):
    """The image tag is the release the daemon reports: <version>, or <version>-cuda where the gpu
    component (or the GPU sidecar) runs the CUDA build. An image without a tag would be :latest."""
    version = daemon_version()
    out = subprocess.run([binary("shardcastd"), "--version"], capture_output=True, text=True)
    assert out.stdout.split() == ["shardcastd", version], out.stdout + out.stderr
    if where == "native-sidecar":
        objects = list(yaml.safe_load_all((K8S / "examples" / "native-sidecar.yaml").read_text()))
        cuda = True
    else:
        objects = render_deployment(where)
        cuda = "gpu" in components_of(where)
    images = shardcastd_images(objects)
    assert images, where
    expected = f"{SHARDCASTD_IMAGE}:{version}" + ("-cuda" if cuda else "")
    assert set(images) == {expected}, where


def test_the_docs_and_the_dockerfile_name_the_daemons_version():
    """The build commands a reader copies tag the image as the manifests expect it."""
    version = daemon_version()
    for path in (ROOT / "docs" / "deploy.md", DEPLOY / "docker" / "Dockerfile"):
        tags = re.findall(r"shardcastd:([0-9][A-Za-z0-9.\-]*)", path.read_text())
        assert tags, path
        assert set(tags) <= {version, f"{version}-cuda"}, (path, tags)
        tags = re.findall(r"tag `([0-9][A-Za-z0-9.\-]*)`", path.read_text())
        assert set(tags) <= {version, f"{version}-cuda"}, (path, tags)


def test_the_python_package_is_the_daemons_version():
    text = (ROOT / "client" / "python" / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == daemon_version()
