"""Shared helpers of the deployment checks: the daemon's own flag set, the rendered manifests."""

from __future__ import annotations

import atexit
import copy
import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TOOLS = DEPLOY / "tools"
K8S = DEPLOY / "k8s"
sys.path.insert(0, str(TOOLS))

import validate  # noqa: E402  (deploy/tools/validate.py)
from shardcast.local import find_shardcastd  # noqa: E402


def binary(name: str) -> str:
    path = Path(find_shardcastd()).parent / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build first (bash scripts/build.sh)")
    return str(path)


class DaemonFlags:
    """What `shardcastd --help` says: flag names and their SHARDCAST_* variables."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
        text = subprocess.run([binary("shardcastd"), "--help"], capture_output=True, text=True, check=True, env=env).stdout
        self.flags: Set[str] = set(re.findall(r"^\s+(?:-\w,)?--([a-z][a-z0-9-]*)", text, re.M))
        self.envs: Set[str] = set(re.findall(r"Env:(SHARDCAST_[A-Z0-9_]+)", text))


@pytest.fixture(scope="session")
def daemon_flags() -> DaemonFlags:
    return DaemonFlags()


@pytest.fixture(scope="session")
def kubectl() -> str:
    """kubectl (with kustomize v5), which renders the kustomizations as `kubectl apply -k` would."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is needed for the manifest checks (it renders the kustomize overlays)")
    return path


def render(directory: Path) -> List[dict]:
    """The objects `kubectl kustomize DIR` renders."""
    try:
        return validate.render(directory)
    except validate.RenderError as e:
        pytest.fail(str(e))


#: The kustomize Components under deploy/k8s/components; docs/deploy.md offers any combination of
#: them over the base, with at most one of each set of ALTERNATIVES.
COMPONENTS: Tuple[str, ...] = ("gpu", "rdma", "cert-manager", "monitoring", "monitoring-service")
#: Components that stand for each other: monitoring-service is monitoring with a ServiceMonitor
#: instead of the PodMonitor, and kustomize refuses the two together (test_components).
ALTERNATIVES: Tuple[Set[str], ...] = ({"monitoring", "monitoring-service"},)
#: Each component alone, each pair, ..., all that may be listed together.
COMBINATIONS: List[Tuple[str, ...]] = [c for n in range(1, len(COMPONENTS) + 1)
                                       for c in itertools.combinations(COMPONENTS, n)
                                       if all(len(a & set(c)) <= 1 for a in ALTERNATIVES)]
#: The kustomization directories we ship: the base and every overlay.
SHIPPED_DIRS: Dict[str, Path] = {"base": K8S / "base",
                                 **{p.name: p for p in sorted((K8S / "overlays").iterdir()) if p.is_dir()}}
#: Every deployment the checks render: the shipped directories, then every combination of
#: components not shipped as an overlay of its own ("gpu+rdma": the base with both).
DEPLOYMENTS: List[str] = list(dict.fromkeys([*SHIPPED_DIRS, *("+".join(c) for c in COMBINATIONS)]))


def components_of(name: str) -> Set[str]:
    """The components a deployment is made of, as its directory's kustomization lists them."""
    text = (deployment_dir(name) / "kustomization.yaml").read_text()
    return {c for c in COMPONENTS if f"components/{c}\n" in text}


_scratch: List[Path] = []


def deployment_dir(name: str) -> Path:
    """The kustomization directory of a deployment: a shipped one, or for "a+b" one written here as
    a user would write it (the base as its resource, the components listed), in a temporary
    directory outside the repository (kustomize takes relative paths only)."""
    if name in SHIPPED_DIRS:
        return SHIPPED_DIRS[name]
    if not _scratch:
        _scratch.append(Path(tempfile.mkdtemp(prefix="shardcast-k8s-")))
        atexit.register(shutil.rmtree, _scratch[0], True)
    directory = _scratch[0] / name.replace("+", "_")
    if not directory.exists():
        directory.mkdir()
        up = os.path.relpath(K8S, directory)
        listed = "".join(f"  - {up}/components/{c}\n" for c in name.split("+"))
        (directory / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources:\n  - {up}/base\ncomponents:\n{listed}")
    return directory


@functools.lru_cache(maxsize=None)
def _rendered(name: str) -> List[dict]:
    return render(deployment_dir(name))


def render_deployment(name: str) -> List[dict]:
    """What `kubectl kustomize` renders for a deployment of DEPLOYMENTS (a copy: callers may edit it)."""
    return copy.deepcopy(_rendered(name))


def daemonset_pod(objects: List[dict]) -> dict:
    return by_kind(objects, "DaemonSet")["shardcastd"]["spec"]["template"]["spec"]


def by_kind(objects: List[dict], kind: str) -> Dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


#: The workload examples that use the DaemonSet (its socket, /dev/shm, hostIPC, group 10001).
DAEMONSET_EXAMPLES: Tuple[str, ...] = ("trainer-job.yaml", "inference-deployment.yaml", "rollout-replicas.yaml")


#: The example that creates the workloads' namespace; every other example's objects live in it.
EXAMPLES_NAMESPACE = "00-namespace.yaml"


def example_files() -> List[str]:
    return sorted(p.name for p in (K8S / "examples").glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _rendered_with_examples(name: str) -> List[dict]:
    directory = deployment_dir(name)
    scratch = Path(tempfile.mkdtemp(prefix="shardcast-examples-"))
    atexit.register(shutil.rmtree, scratch, True)
    for f in example_files():  # kustomize reads files only from inside the kustomization's directory
        shutil.copy(K8S / "examples" / f, scratch / f)
    listed = "".join(f"  - {f}\n" for f in example_files())
    (scratch / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(directory, scratch)}\n{listed}")
    return render(scratch)


def render_with_examples(name: str) -> List[dict]:
    """A deployment of DEPLOYMENTS and every workload example in one kustomization, as one cluster
    holds them: what `kubectl kustomize` renders (a copy: callers may edit it)."""
    return copy.deepcopy(_rendered_with_examples(name))


def workload_pods(objects: List[dict]) -> Dict[str, Tuple[dict, dict]]:
    """{"Kind/name": (object, pod spec)} of the objects with a pod template, the daemons' DaemonSet
    left out: the workloads."""
    return {f"{o['kind']}/{o['metadata']['name']}": (o, o["spec"]["template"]["spec"]) for o in objects
            if "template" in o.get("spec", {}) and not (o["kind"] == "DaemonSet" and o["metadata"]["name"] == "shardcastd")}


def example_pods(name: str) -> Dict[str, dict]:
    """{object name: pod spec} of the workloads (objects with a pod template) in an example file;
    the Services beside them are left out."""
    objects = yaml.safe_load_all((K8S / "examples" / name).read_text())
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})}


#: Where the manifests and the systemd unit mount the daemon's TLS identity (cert-manager's names).
TLS_DIR = "/etc/shardcast/tls"


@pytest.fixture(scope="session")
def local_tls(tmp_path_factory) -> Path:
    """A directory laid out as TLS_DIR is in a pod (tls.crt, tls.key, ca.crt), minted here by
    scripts/certs.sh, so that the shipped command lines run on this machine."""
    minted = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(ROOT / "scripts" / "certs.sh"), str(minted)], check=True, capture_output=True)
    layout = tmp_path_factory.mktemp("tls")
    for src, dst in (("daemon.pem", "tls.crt"), ("daemon.key", "tls.key"), ("ca.pem", "ca.crt"),
                     ("client.pem", "client.crt"), ("client.key", "client.key")):
        (layout / dst).write_bytes((minted / src).read_bytes())
    return layout


def localize(value: str, tls: Path) -> str:
    """`value` with the pod's TLS directory replaced by this machine's copy."""
    return value.replace(TLS_DIR, str(tls))


def pytest_configure(config):
    # scripts/test.sh --quick runs -m "not slow"; the complete suite runs everything.
    config.addinivalue_line("markers", "slow: left out of the quick tier (scripts/test.sh --quick)")
