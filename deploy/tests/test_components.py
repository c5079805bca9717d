"""The gpu, rdma, cert-manager and monitoring (or monitoring-service) components compose over the
base in every combination docs/deploy.md offers: each renders with the real `kubectl kustomize`,
validates against Kubernetes' schemas (and the CRDs' fields we use), has each of its components'
effects and no other's, and does not depend on the order the components are listed in; the two
monitoring components refuse to be listed together. The rdma component writes by RMA put over
transports that bound it, the CUDA ones too with the gpu component; the kustomizations
docs/deploy.md shows render as shown."""

from __future__ import annotations

import math
import os
import re
import textwrap
from pathlib import Path
from typing import List, Set

import pytest
import yaml

import validate
from conftest import (ALTERNATIVES, COMBINATIONS, COMPONENTS, DEPLOYMENTS, K8S, ROOT, by_kind, components_of,
                      daemonset_pod, deployment_dir, localize, render, render_deployment)
from test_consistency import env_of, expand, print_config
from test_manifests import run_validate

RDMA_RESOURCE = "rdma/rdma_shared_device_a"


def test_every_combination_is_a_deployment_we_check():
    names = {"+".join(c) for c in COMBINATIONS}
    # Each independent component in or out, one of each set of alternatives or none; not nothing.
    independent = len(COMPONENTS) - sum(len(a) for a in ALTERNATIVES)
    assert len(names) == 2 ** independent * math.prod(len(a) + 1 for a in ALTERNATIVES) - 1
    for c in COMPONENTS:  # each component alone is shipped as an overlay of its own
        assert components_of(c) == {c}
    assert components_of("gpu-rdma-cert-manager") == {"gpu", "rdma", "cert-manager"}
    assert names <= set(DEPLOYMENTS)


@pytest.mark.parametrize("alternatives", ALTERNATIVES, ids=lambda a: "+".join(sorted(a)))
def test_alternative_components_refuse_to_be_listed_together(kubectl, tmp_path, alternatives):
    """monitoring-service includes monitoring and replaces its PodMonitor: listing both would
    bring a second copy of the alerts and the dashboard, which kustomize refuses."""
    up = os.path.relpath(K8S, tmp_path)
    listed = "".join(f"  - {up}/components/{c}\n" for c in sorted(alternatives))
    (tmp_path / "kustomization.yaml").write_text(
        f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {up}/base\n"
        f"components:\n{listed}")
    with pytest.raises(validate.RenderError, match="already registered id"):
        validate.render(tmp_path)


def test_components_are_kustomize_components():
    """Overlays each bring their own copy of the base, so two of them cannot be combined (kustomize
    refuses the second Namespace); Components add to whichever base includes them."""
    for c in COMPONENTS:
        spec = yaml.safe_load((K8S / "components" / c / "kustomization.yaml").read_text())
        assert (spec["apiVersion"], spec["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component"), c
        assert not any(r.rstrip("/").endswith("base") for r in spec.get("resources", [])), (
            f"{c}: a component must not include the base itself")


def test_every_deployment_validates_against_kubernetes(kubectl):
    r = run_validate(*(deployment_dir(d) for d in DEPLOYMENTS))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "all valid" in r.stdout


def effects(objects: List[dict]) -> Set[str]:
    """Which components' changes a rendering shows, each checked in full where it is present."""
    pod = daemonset_pod(objects)
    containers = pod["initContainers"] + pod["containers"]
    daemon = pod["containers"][0]
    env = env_of(daemon, objects)
    found = set()

    if pod.get("runtimeClassName") == "nvidia" or "NVIDIA_VISIBLE_DEVICES" in env:
        assert pod["runtimeClassName"] == "nvidia"
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
        assert all(c["image"].endswith("-cuda") for c in containers), "every container runs the CUDA image"
        assert not any("nvidia.com/gpu" in daemon["resources"].get(k, {}) for k in ("requests", "limits"))
        found.add("gpu")

    if pod.get("hostNetwork"):
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # the Service names still resolve
        for kind in ("requests", "limits"):
            assert daemon["resources"][kind][RDMA_RESOURCE] == "1", kind
        assert env["UCX_NET_DEVICES"] and env["UCX_IB_GID_INDEX"]
        assert env["SHARDCAST_PROTOCOL"] == "put"
        # No tcp, shared memory or ud (the daemon's own check: test_rdma_writes_by_put_...).
        transports = env["SHARDCAST_UCX_TLS"].split(",")
        assert all(t.startswith(("rc", "dc", "cuda")) or t in ("gdr_copy", "self") for t in transports)
        # GPUDirect RDMA with the gpu component, whichever of the two is listed first; no CUDA
        # transport in the plain image's daemon.
        cuda = {"cuda_copy", "cuda_ipc", "gdr_copy"}
        assert cuda & set(transports) == (cuda if "gpu" in found else set()), transports
        found.add("rdma")
    else:
        assert RDMA_RESOURCE not in daemon["resources"].get("limits", {})

    certificates = by_kind(objects, "Certificate")
    if certificates:
        secret = next(v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v)
        assert certificates["shardcastd"]["spec"]["secretName"] == secret, "the identity the daemon mounts"
        assert "shardcast-daemon" in certificates["shardcastd"]["spec"]["dnsNames"]
        assert "client auth" in certificates["shardcast-client"]["spec"]["usages"]
        issuers = by_kind(objects, "Issuer")
        for cert in certificates.values():
            assert cert["spec"]["issuerRef"]["name"] in issuers
            assert cert["metadata"]["namespace"] == "shardcast"
        found.add("cert-manager")

    # Both monitoring components bring the alerts and the dashboard; they differ in the monitor.
    rules, dashboards = by_kind(objects, "PrometheusRule"), by_kind(objects, "ConfigMap")
    pod_monitors, service_monitors = by_kind(objects, "PodMonitor"), by_kind(objects, "ServiceMonitor")
    if rules or pod_monitors or service_monitors:
        assert set(rules) == {"shardcastd"}
        assert dashboards["shardcast-dashboard"]["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert len(pod_monitors) + len(service_monitors) == 1, "one way to scrape, never both"
        found.add("monitoring" if pod_monitors else "monitoring-service")
    else:
        assert "shardcast-dashboard" not in dashboards
    return found


@pytest.mark.parametrize("where", DEPLOYMENTS)
def test_each_deployment_has_its_components_effects_and_no_others(kubectl, where):
    objects = render_deployment(where)
    assert effects(objects) == components_of(where)
    # One of each base object: the components add to the base, they do not bring another copy.
    base = render_deployment("base")
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), where
    assert {(o["kind"], o["metadata"]["name"]) for o in base} <= set(names)


def test_the_order_of_the_components_does_not_matter(kubectl, tmp_path):
    """Same objects whatever the order; only the daemon's environment lists the components'
    variables in another order, which means nothing as none refers to another."""
    def key(objects):
        for o in objects:
            if o["kind"] == "DaemonSet":
                env = daemonset_pod([o])["containers"][0]["env"]
                assert not any("$(" in e.get("value", "") for e in env)
                env.sort(key=lambda e: e["name"])
        return sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"]))

    reference = key(render_deployment("gpu+rdma+cert-manager+monitoring"))
    up = os.path.relpath(K8S, tmp_path)
    for order in (("monitoring", "cert-manager", "rdma", "gpu"), ("rdma", "gpu", "monitoring", "cert-manager")):
        listed = "".join(f"  - {up}/components/{c}\n" for c in order)
        (tmp_path / "kustomization.yaml").write_text(
            f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {up}/base\n"
            f"components:\n{listed}")
        assert key(render(tmp_path)) == reference, order


# ---- the rdma component's transports and protocol ----

def rdma_daemon(local_tls, where="rdma"):
    objects = render_deployment(where)
    container = daemonset_pod(objects)["containers"][0]
    env = env_of(container, objects)
    return [localize(expand(a, env), local_tls) for a in container["args"]], env


def test_rdma_writes_by_put_over_transports_that_bound_it(kubectl, local_tls):
    """The daemon itself judges the list: with --protocol put it refuses, at start, any transport
    whose hardware does not bound a remote write to the registered region (daemon/server/config.cc)."""
    args, env = rdma_daemon(local_tls)
    assert env["SHARDCAST_PROTOCOL"] == "put"
    r = print_config(args, env)
    assert r.returncode == 0, r.stderr
    assert "protocol=put" in r.stdout.split()


@pytest.mark.parametrize("tls", ["rc_x,ud_x,self", "rc_x,ud_x,sm,self", "rc_x,tcp,self"])
def test_rdma_refuses_transports_that_cannot_bound_a_put(kubectl, local_tls, tls):
    """What the rdma overlay and docs/deploy.md used to list: with ud or shared memory in the list,
    auto would silently have chosen active messages; put makes the daemon say so and stop."""
    args, env = rdma_daemon(local_tls)
    r = print_config(args, {**env, "SHARDCAST_UCX_TLS": tls})
    assert r.returncode == 2, r.stdout
    assert "cannot bound a peer's writes" in r.stderr


def test_the_docs_name_the_transports_the_manifests_set(kubectl):
    """Every SHARDCAST_UCX_TLS=... and SHARDCAST_PROTOCOL=... docs/deploy.md quotes is a value
    some deployment sets."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    set_tls, set_protocols = set(), set()
    for name in DEPLOYMENTS:
        data = by_kind(render_deployment(name), "ConfigMap")["shardcastd-config"]["data"]
        set_tls.add(data["SHARDCAST_UCX_TLS"])
        set_protocols.add(data["SHARDCAST_PROTOCOL"])
    tls_of = lambda where: by_kind(render_deployment(where), "ConfigMap")["shardcastd-config"]["data"]["SHARDCAST_UCX_TLS"]  # noqa: E731
    quoted_tls = set(re.findall(r"SHARDCAST_UCX_TLS=([a-z0-9_,]+)", text))
    quoted_protocols = set(re.findall(r"SHARDCAST_PROTOCOL=([a-z]+)", text))
    assert {tls_of("rdma"), tls_of("gpu+rdma")} <= quoted_tls and "put" in quoted_protocols
    assert quoted_tls <= set_tls, quoted_tls - set_tls
    assert quoted_protocols <= set_protocols


def test_gpudirect_transports_still_bound_puts(kubectl, local_tls):
    """gpu with rdma (GPUDirect RDMA: the CUDA transports beside rc verbs) is a list the daemon
    accepts with put."""
    args, env = rdma_daemon(local_tls, "gpu+rdma")
    assert {"rc_x", "cuda_copy", "cuda_ipc", "gdr_copy"} <= set(env["SHARDCAST_UCX_TLS"].split(","))
    r = print_config(args, env)
    assert r.returncode == 0, r.stderr
    assert "protocol=put" in r.stdout.split()


# ---- the kustomizations docs/deploy.md shows: a user's own, beside a checkout ----

def documented_kustomizations() -> List[str]:
    """Every whole kustomization docs/deploy.md shows (its indented blocks of kind Kustomization)."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"(?m)^    apiVersion: kustomize\.config\.k8s\.io/v1beta1\n(?:^    .*\n|^\n(?=    ))*", text)
    return [textwrap.dedent(b) for b in blocks]


def render_documented(kustomization: str, tmp_path: Path) -> List[dict]:
    """`kustomization` rendered where docs/deploy.md puts it: in a directory `cluster/` beside the
    checkout `shardcast/`."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "shardcast").symlink_to(ROOT)
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "kustomization.yaml").write_text(kustomization)
    return render(tmp_path / "cluster")


def test_the_documented_kustomizations_render(kubectl, tmp_path):
    blocks = documented_kustomizations()
    assert len(blocks) >= 2, "docs/deploy.md shows a kustomization of components and the NIC patch"
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert "<checkout>" not in text, "a placeholder invites an absolute path, which kustomize refuses"
    for i, block in enumerate(blocks):
        objects = render_documented(block, tmp_path / str(i))
        assert effects(objects) == {c for c in COMPONENTS if f"components/{c}\n" in block}, block


def test_kustomize_refuses_an_absolute_path(kubectl, tmp_path):
    """Why docs/deploy.md's paths are relative: kustomize takes no absolute one."""
    (tmp_path / "kustomization.yaml").write_text(f"resources:\n  - {K8S / 'base'}\n")
    with pytest.raises(validate.RenderError, match="cannot be absolute"):
        validate.render(tmp_path)
    assert "cannot be absolute" in (ROOT / "docs" / "deploy.md").read_text()


def test_the_documented_nic_patch_sets_the_rdma_ports(kubectl, tmp_path):
    """The patch docs/deploy.md gives for UCX_NET_DEVICES replaces the rdma component's value:
    one entry, the documented ports (a kustomization's own patches run after its components)."""
    [block] = [b for b in documented_kustomizations() if "UCX_NET_DEVICES" in b]
    wanted = re.search(r"name: UCX_NET_DEVICES\n\s+value: (\S+)", block).group(1)
    default = env_of(daemonset_pod(render_deployment("rdma"))["containers"][0], render_deployment("rdma"))
    assert wanted != default["UCX_NET_DEVICES"]
    env = daemonset_pod(render_documented(block, tmp_path))["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "UCX_NET_DEVICES"] == [wanted]
