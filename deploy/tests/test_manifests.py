"""Every manifest and rendered overlay is a valid Kubernetes 1.30 object; the validator and the
renderer fail on what they must fail on; where kubectl exists, the renderer agrees with it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import K8S, TOOLS, render

OVERLAYS = [K8S / "base", K8S / "overlays" / "dev", K8S / "overlays" / "rdma"]


def validate(*paths) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(TOOLS / "validate.js"), *map(str, paths)], capture_output=True, text=True)


def test_every_manifest_and_rendered_overlay_validates(node_tools):
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
    r = validate(*OVERLAYS, *files)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "all valid" in r.stdout


DAEMONSET = """
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: probe}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers:
        - name: c
          image: i
"""


@pytest.mark.parametrize("change, message", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolice="Always"),
     "'\"imagePullPolice\"' does not exist in type 'Container'"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(ports=[{"containerPort": "7070"}]),
     "Type 'string' is not assignable to type 'number'"),
    (lambda d: d["spec"]["template"]["spec"].update(hostIPC="yes"),
     "Type 'string' is not assignable to type 'boolean"),
    (lambda d: d["spec"].pop("selector"),
     "Property 'selector' is missing"),
    (lambda d: d.update(apiVersion="apps/v9"),
     'apiVersion "apps/v9" is not in Kubernetes 1.30'),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinessProbe={"grpc": {"service": "x"}}),
     "Property 'port' is missing"),
])
def test_validator_rejects_unknown_fields_wrong_types_and_missing_fields(node_tools, tmp_path, change, message):
    doc = yaml.safe_load(DAEMONSET)
    assert validate(_write(tmp_path, doc)).returncode == 0  # the unchanged document is valid
    change(doc)
    r = validate(_write(tmp_path, doc))
    assert r.returncode == 1
    assert message in r.stderr


def _write(tmp_path: Path, doc: dict) -> Path:
    f = tmp_path / "doc.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_renderer_refuses_what_it_does_not_implement(node_tools, tmp_path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n")
    cases = {
        "commonLabels: {a: b}\nresources: [cm.yaml]\n": '"commonLabels" is not supported',
        "resources: [cm.yaml]\npatches:\n  - target: {kind: Secret}\n    patch: '[{op: remove, path: /data}]'\n":
            "matches no resource",
        "resources: [cm.yaml]\npatches:\n  - target: {kind: ConfigMap}\n    patch: '[{op: move, from: /data, path: /x}]'\n":
            '"move" is not supported',
        "resources: [cm.yaml]\npatches:\n  - target: {kind: ConfigMap}\n    patch: '[{op: remove, path: /data/zz}]'\n":
            "nothing there",
        "resources: [missing.yaml]\n": '"missing.yaml" does not exist',
    }
    for text, message in cases.items():
        (tmp_path / "kustomization.yaml").write_text(text)
        r = subprocess.run(["node", str(TOOLS / "render.js"), str(tmp_path)], capture_output=True, text=True)
        assert r.returncode == 1, text
        assert message in r.stderr, (text, r.stderr)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_renderer_agrees_with_kubectl_kustomize(node_tools, overlay):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the renderer is not compared with kustomize on this machine")
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout)}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in render(overlay)}
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert json.dumps(ours[key], sort_keys=True) == json.dumps(theirs[key], sort_keys=True), key
