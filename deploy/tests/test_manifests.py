"""Every manifest and rendered overlay is a valid Kubernetes 1.30 object by the API's published
JSON schemas (strict), rendered by the real `kubectl kustomize`; the validator fails on what it
must fail on, naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import validate
from conftest import K8S, SHIPPED_DIRS, TOOLS

#: The base first, then every overlay (test_components validates every combination of components).
OVERLAYS = list(SHIPPED_DIRS.values())


def run_validate(*paths) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / "validate.py"), *map(str, paths)], capture_output=True,
                          text=True, timeout=300)


def test_every_manifest_and_rendered_overlay_validates(kubectl):
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
    r = run_validate(*OVERLAYS, *files)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "all valid" in r.stdout
    assert "Kubernetes 1.30" in r.stdout


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
     ".spec.template.spec.containers[0]: Additional properties are not allowed ('imagePullPolice' was unexpected)"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(ports=[{"containerPort": "7070"}]),
     ".spec.template.spec.containers[0].ports[0].containerPort: '7070' is not of type 'integer'"),
    (lambda d: d["spec"]["template"]["spec"].update(hostIPC="yes"),
     ".spec.template.spec.hostIPC: 'yes' is not of type 'boolean'"),
    (lambda d: d["spec"].pop("selector"),
     ".spec: 'selector' is a required property"),
    (lambda d: d.update(apiVersion="apps/v9"),
     'apiVersion "apps/v9" kind "DaemonSet" is not in Kubernetes 1.30'),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinessProbe={"grpc": {"service": "x"}}),
     ".spec.template.spec.containers[0].readinessProbe.grpc: 'port' is a required property"),
    (lambda d: d["metadata"].update(labels={"a": 1}),
     ".metadata.labels.a: 1 is not of type 'string'"),
])
def test_validator_rejects_unknown_fields_wrong_types_and_missing_fields(tmp_path, change, message):
    doc = yaml.safe_load(DAEMONSET)
    assert validate.problem(doc) == ""  # the unchanged document is valid
    change(doc)
    assert message in validate.problem(doc)
    f = tmp_path / "doc.yaml"
    f.write_text(yaml.safe_dump(doc))
    r = run_validate(f)
    assert r.returncode == 1
    assert message in r.stderr
    assert "1 problem(s)" in r.stdout


def test_a_broken_kustomization_is_a_problem_with_kustomizes_message(kubectl, tmp_path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n")
    cases = {
        "resources: [missing.yaml]\n": "missing.yaml",
        "resources: [cm.yaml]\npatches:\n  - target: {kind: ConfigMap}\n    patch: '[{op: remove, path: /data/zz}]'\n":
            "kubectl kustomize failed",
        "resourcez: [cm.yaml]\n": "resourcez",
    }
    for text, message in cases.items():
        (tmp_path / "kustomization.yaml").write_text(text)
        r = run_validate(tmp_path)
        assert r.returncode == 1, text
        assert message in r.stderr, (text, r.stderr)


def test_what_the_overlays_render_is_what_kustomize_renders(kubectl):
    """The renderer is kubectl itself: every overlay renders, and the overlays keep the base's
    objects (the consistency tests read the same rendering)."""
    base = {(o["kind"], o["metadata"]["name"]) for o in validate.render(K8S / "base")}
    assert ("DaemonSet", "shardcastd") in base
    for overlay in OVERLAYS[1:]:
        rendered = {(o["kind"], o["metadata"]["name"]) for o in validate.render(overlay)}
        assert base <= rendered, overlay
