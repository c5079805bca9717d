"""What the cluster is asked to allow, and what it gives back: the Pod Security level of the
daemons' namespace and of the workloads' (examples/00-namespace.yaml), exactly which baseline
controls each pod we ship goes beyond, the
PriorityClass and PodDisruptionBudget of the daemons, and the host firewall that replaces the
NetworkPolicy under hostNetwork."""

from __future__ import annotations

import re
from typing import Set

import pytest
import yaml

from conftest import (DAEMONSET_EXAMPLES, DEPLOYMENTS, EXAMPLES_NAMESPACE, K8S, ROOT, by_kind, components_of,
                      daemonset_pod, example_pods, render_deployment, render_with_examples, workload_pods)

#: Capabilities the baseline Pod Security Standard lets a container add; anything else is beyond it.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def beyond_baseline(pod: dict) -> Set[str]:
    """What in a pod spec the baseline Pod Security Standard forbids, for the controls our pods
    touch: host namespaces, privileged containers, added capabilities, hostPath volumes, host ports
    (under hostNetwork the API server sets every container port's hostPort to it)."""
    found = {ns for ns in ("hostNetwork", "hostPID", "hostIPC") if pod.get(ns)}
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        context = c.get("securityContext") or {}
        if context.get("privileged"):
            found.add("privileged")
        found |= {f"capability {cap}" for cap in (context.get("capabilities") or {}).get("add", [])
                  if cap not in BASELINE_CAPABILITIES}
        found |= {f"hostPort {p['containerPort']}" for p in c.get("ports", []) if p.get("hostPort") or pod.get("hostNetwork")}
    found |= {f"hostPath {v['hostPath']['path']}" for v in pod.get("volumes", []) if "hostPath" in v}
    return found


DAEMONSET_NEEDS = {"hostIPC", "hostPath /run/shardcast", "hostPath /dev/shm", "capability IPC_LOCK"}
RDMA_NEEDS = {"hostNetwork", "hostPort 7070", "hostPort 9464"}


def pod_security_section() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index("### Pod Security")
    return text[start:text.index("\n#", start + 1)]


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_the_daemons_namespace_admits_privileged_pods_and_reports_them(kubectl, where):
    """The DaemonSet is beyond baseline, so its namespace enforces privileged (and only it: the
    label is on the shardcast Namespace); audit and warn stay at baseline so the exceptions show."""
    objects = render_deployment(where)
    namespaces = by_kind(objects, "Namespace")
    assert set(namespaces) == {"shardcast"}
    labels = namespaces["shardcast"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/audit"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    assert by_kind(objects, "DaemonSet")["shardcastd"]["metadata"]["namespace"] == "shardcast"


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_the_daemonset_goes_beyond_baseline_only_where_documented(kubectl, where):
    needs = DAEMONSET_NEEDS | (RDMA_NEEDS if "rdma" in components_of(where) else set())
    assert beyond_baseline(daemonset_pod(render_deployment(where))) == needs
    # DAC_OVERRIDE, CHOWN and FOWNER are within baseline; restricted would refuse them too.
    section = pod_security_section()
    for item in ("hostIPC", "/run/shardcast", "/dev/shm", "IPC_LOCK", "DAC_OVERRIDE", "hostNetwork", "host port"):
        assert item in section, f'docs/deploy.md, "Pod Security", does not mention {item}'


def test_workload_pods_go_beyond_baseline_only_where_documented():
    """Pods using the DaemonSet need hostIPC and the two host directories (so their namespace needs
    the label too); the native sidecar pattern needs neither, only IPC_LOCK for its daemon."""
    for name in DAEMONSET_EXAMPLES:
        for pod in example_pods(name).values():
            assert beyond_baseline(pod) == DAEMONSET_NEEDS - {"capability IPC_LOCK"}, name
    sidecar = by_kind(list(yaml.safe_load_all((K8S / "examples" / "native-sidecar.yaml").read_text())), "Job")
    assert beyond_baseline(sidecar["rl-trainer-sidecar"]["spec"]["template"]["spec"]) == {"capability IPC_LOCK"}
    assert "native sidecar" in pod_security_section()


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_the_workloads_namespace_admits_them(kubectl, where):
    """Every workload example goes beyond baseline (hostIPC and host directories, or a sidecar's
    IPC_LOCK), so the namespace the examples run in, created by examples/00-namespace.yaml, enforces
    privileged; audit and warn stay at baseline, as for the daemons' namespace."""
    objects = render_with_examples(where)
    [workloads] = yaml.safe_load_all((K8S / "examples" / EXAMPLES_NAMESPACE).read_text())
    name = workloads["metadata"]["name"]
    namespaces = by_kind(objects, "Namespace")
    assert set(namespaces) == {"shardcast", name}
    labels = namespaces[name]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/audit"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    pods = workload_pods(objects)
    assert len(pods) >= 5 and all(beyond_baseline(pod) for _, pod in pods.values())
    for path in sorted((K8S / "examples").glob("*.yaml")):
        for o in yaml.safe_load_all(path.read_text()):
            if o["kind"] != "Namespace":
                assert o["metadata"]["namespace"] == name, f"{path.name}: {o['kind']} {o['metadata']['name']}"


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_priority_class_is_shipped_and_used(kubectl, where):
    objects = render_deployment(where)
    name = daemonset_pod(objects)["priorityClassName"]
    assert not name.startswith("system-"), "system-* classes are admitted only in kube-system"
    cls = by_kind(objects, "PriorityClass")[name]
    assert "namespace" not in cls["metadata"], "a PriorityClass is cluster-scoped"
    # Above any workload class, at most the highest value a class outside kube-system may have.
    assert 10 ** 8 <= cls["value"] <= 10 ** 9
    assert cls.get("globalDefault") is False


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_disruption_budget_selects_the_daemons_and_can_be_computed(kubectl, where):
    objects = render_deployment(where)
    ds = by_kind(objects, "DaemonSet")["shardcastd"]
    budgets = by_kind(objects, "PodDisruptionBudget")
    assert set(budgets) == {"shardcastd"}
    budget = budgets["shardcastd"]
    assert budget["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    # The disruption controller sizes maxUnavailable and percentages from the pods' controller's
    # scale; a DaemonSet has none, so such a budget never syncs and refuses every eviction.
    assert "maxUnavailable" not in budget["spec"], "not computable for a DaemonSet's pods"
    assert isinstance(budget["spec"]["minAvailable"], int), "a percentage is not computable for a DaemonSet's pods"


def test_host_network_has_a_firewall_rule_for_the_daemons_ports(kubectl):
    """NetworkPolicy does not apply to hostNetwork pods: the docs give the host firewall rule, for
    exactly the daemon's ports, and the NetworkPolicy says it is moot there."""
    policy_text = (K8S / "base" / "networkpolicy.yaml").read_text()
    assert "hostNetwork" in policy_text and "host firewall" in policy_text
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for where in DEPLOYMENTS:
        pod = daemonset_pod(render_deployment(where))
        if not pod.get("hostNetwork"):
            continue
        ports = {str(p["containerPort"]) for c in pod["containers"] for p in c["ports"]}
        dropped = re.findall(r"tcp dport \{ ([0-9, ]+) \} drop", docs)
        assert dropped, "docs/deploy.md gives no host firewall rule"
        assert {p.strip() for p in dropped[0].split(",")} == ports, where
