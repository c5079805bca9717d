#!/usr/bin/env python3
"""Validates Kubernetes manifests against the Kubernetes API's published JSON schemas (the
kubernetes-validate package from PyPI, which ships them), strictly: an unknown field, a wrong type
or a missing required field is an error. Kustomization directories are rendered first with the real
`kubectl kustomize`, so what is checked is exactly what `kubectl apply -k` would send.

    validate.py [--kubernetes-version 1.30] FILE_OR_KUSTOMIZATION_DIR...

Custom resources (CRDs, not in Kubernetes' schemas) are checked against the subset of their API
the manifests use: cert-manager's Issuer and Certificate (cert-manager.io/v1), the Prometheus
Operator's PodMonitor, ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1). Known fields
only, required ones present, durations, label maps and enumerations well formed.

Prints one line per problem on stderr and a summary on stdout; exit status 1 when anything is
invalid, 2 on bad usage."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Tuple

import kubernetes_validate
import yaml

#: The oldest Kubernetes release the manifests must work on; pinned so that a new schema release
#: cannot change what passes.
KUBERNETES_VERSION = "1.30"


class RenderError(Exception):
    pass


#: Custom resources' fields the manifests may use, per kind: {field: what its value must be}; "!"
#: marks a required field. Anything else is an error, as with Kubernetes' strict schemas. A value
#: is None (anything), a {field: ...} mapping, [x] (a list of x), or a check(value, where) that
#: returns the problem or "".
Check = Callable[[object, str], str]


def _string(value, where: str) -> str:
    return "" if isinstance(value, str) else f"{where}: {value!r} is not a string"


def _boolean(value, where: str) -> str:
    return "" if isinstance(value, bool) else f"{where}: {value!r} is not a boolean"


def _integer(value, where: str) -> str:
    return "" if isinstance(value, int) and not isinstance(value, bool) else f"{where}: {value!r} is not an integer"


def _strings(value, where: str) -> str:
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    return "" if ok else f"{where}: {value!r} is not a list of strings"


def _string_map(value, where: str) -> str:
    ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    return "" if ok else f"{where}: {value!r} is not a mapping of strings to strings"


#: A Prometheus duration, as the Prometheus Operator's CRDs accept it: 30s, 5m, 1h30m, 0.
_DURATION = re.compile(r"0|(?=\d)(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")


def _duration(value, where: str) -> str:
    ok = isinstance(value, str) and _DURATION.fullmatch(value) is not None
    return "" if ok else f"{where}: {value!r} is not a duration (30s, 5m, 1h)"


def _one_of(*allowed: str) -> Check:
    def check(value, where: str) -> str:
        return "" if value in allowed else f"{where}: {value!r} is not one of {list(allowed)}"
    return check


#: cert-manager.io/v1 fields the manifests may use.
_KEY_USAGES = {"digital signature", "key encipherment", "server auth", "client auth", "cert sign", "crl sign"}
_ISSUER_REF = {"!name": None, "kind": None, "group": None}
CERT_MANAGER = {
    "Issuer": {"selfSigned": {}, "ca": {"!secretName": None}},
    "Certificate": {
        "!secretName": None, "!issuerRef": _ISSUER_REF, "commonName": None, "dnsNames": None, "isCA": None,
        "duration": None, "renewBefore": None, "usages": None,
        "privateKey": {"algorithm": None, "size": None, "rotationPolicy": None, "encoding": None},
    },
}


#: monitoring.coreos.com/v1 (Prometheus Operator) fields the manifests may use.
_LABEL_SELECTOR = {
    "matchLabels": _string_map,
    "matchExpressions": [{"!key": _string, "!operator": _one_of("In", "NotIn", "Exists", "DoesNotExist"),
                          "values": _strings}],
}
_RELABEL_ACTIONS = ("replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase",
                    "uppercase", "keepequal", "dropequal")
_RELABELING = {
    "sourceLabels": _strings, "separator": _string, "targetLabel": _string, "regex": _string,
    "modulus": _integer, "replacement": _string,
    "action": _one_of(*_RELABEL_ACTIONS, *(a.capitalize() for a in _RELABEL_ACTIONS)),
}
_ENDPOINT = {
    "port": _string, "path": _string, "scheme": _one_of("http", "https"), "interval": _duration,
    "scrapeTimeout": _duration, "honorLabels": _boolean, "relabelings": [_RELABELING],
    "metricRelabelings": [_RELABELING],
}
_NAMESPACE_SELECTOR = {"any": _boolean, "matchNames": _strings}
_RULE = {
    "alert": _string, "record": _string, "!expr": _string, "for": _duration, "keep_firing_for": _duration,
    "labels": _string_map, "annotations": _string_map,
}
MONITORING = {
    "PodMonitor": {
        "!selector": _LABEL_SELECTOR, "!podMetricsEndpoints": [_ENDPOINT], "namespaceSelector": _NAMESPACE_SELECTOR,
        "jobLabel": _string, "podTargetLabels": _strings, "sampleLimit": _integer,
    },
    "ServiceMonitor": {
        "!selector": _LABEL_SELECTOR, "!endpoints": [_ENDPOINT], "namespaceSelector": _NAMESPACE_SELECTOR,
        "jobLabel": _string, "targetLabels": _strings, "podTargetLabels": _strings, "sampleLimit": _integer,
    },
    "PrometheusRule": {
        "groups": [{"!name": _string, "interval": _duration, "limit": _integer, "rules": [_RULE]}],
    },
}
#: The custom resources checked here, by apiVersion.
CUSTOM = {"cert-manager.io/v1": CERT_MANAGER, "monitoring.coreos.com/v1": MONITORING}


def _value_problem(value, allowed, where: str) -> str:
    if allowed is None:
        return ""
    if isinstance(allowed, dict):
        return _spec_problem(value, allowed, where)
    if isinstance(allowed, list):
        if not isinstance(value, list):
            return f"{where}: expected a list"
        for i, item in enumerate(value):
            found = _value_problem(item, allowed[0], f"{where}[{i}]")
            if found:
                return found
        return ""
    return allowed(value, where)


def _spec_problem(spec, allowed: dict, where: str) -> str:
    if not isinstance(spec, dict):
        return f"{where}: expected a mapping"
    names = {k.lstrip("!"): (k.startswith("!"), v) for k, v in allowed.items()}
    for key in spec:
        if key not in names:
            return f"{where}.{key}: unknown field"
    for key, (required, nested) in names.items():
        if required and key not in spec:
            return f"{where}: '{key}' is a required property"
        if key in spec:
            found = _value_problem(spec[key], nested, f"{where}.{key}")
            if found:
                return found
    return ""


def monitoring_problem(doc: dict) -> str:
    spec = doc.get("spec") or {}
    found = _spec_problem(spec, MONITORING[doc["kind"]], ".spec")
    if found:
        return found
    for g, group in enumerate(spec.get("groups", [])):
        for r, rule in enumerate(group.get("rules", [])):
            where = f".spec.groups[{g}].rules[{r}]"
            if ("alert" in rule) == ("record" in rule):
                return f"{where}: a rule has exactly one of alert or record"
            if "record" in rule and ("for" in rule or "annotations" in rule):
                return f"{where}: a recording rule has no for or annotations"
    return ""


def custom_problem(doc: dict) -> str:
    """Why a custom resource of CUSTOM is not valid, or "" when it is."""
    extra = set(doc) - {"apiVersion", "kind", "metadata", "spec"}
    if extra:
        return f"(top): unknown fields {sorted(extra)}"
    if not isinstance(doc.get("metadata"), dict) or not doc["metadata"].get("name"):
        return ".metadata: 'name' is a required property"
    if doc["apiVersion"] == "cert-manager.io/v1":
        return cert_manager_problem(doc)
    return monitoring_problem(doc)


def cert_manager_problem(doc: dict) -> str:
    spec = doc.get("spec") or {}
    if doc["kind"] == "Issuer" and len(spec) != 1:
        return ".spec: an Issuer has exactly one of selfSigned or ca"
    found = _spec_problem(spec, CERT_MANAGER[doc["kind"]], ".spec")
    if found:
        return found
    unknown = set(spec.get("usages", [])) - _KEY_USAGES
    return f".spec.usages: unknown usages {sorted(unknown)}" if unknown else ""


def render(directory: Path) -> List[dict]:
    """`kubectl kustomize DIR` as a list of objects; RenderError with kustomize's message."""
    try:
        out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RenderError("kubectl is not installed: it renders the kustomizations") from None
    if out.returncode != 0:
        raise RenderError(f"{directory}: kubectl kustomize failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def documents(path: Path) -> Iterator[Tuple[str, dict]]:
    """(where, object) for every object in a file or a rendered kustomization directory."""
    if path.is_dir():
        docs = render(path)
    else:
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        except yaml.YAMLError as e:
            raise RenderError(f"{path}: not YAML: {e}") from None
    for doc in docs:
        if not isinstance(doc, dict):
            raise RenderError(f"{path}: a document is not a mapping")
        yield f"{path} [{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}]", doc


def problem(doc: dict, version: str = KUBERNETES_VERSION) -> str:
    """Why `doc` is not a valid object of Kubernetes `version`, or "" when it is."""
    if doc.get("kind") == "Kustomization":
        return ""  # kubectl kustomize checks these when it renders them
    if doc.get("kind") in CUSTOM.get(doc.get("apiVersion"), {}):
        return custom_problem(doc)
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return f'apiVersion "{doc.get("apiVersion")}" kind "{doc.get("kind")}" is not in Kubernetes {version}'
    except kubernetes_validate.ValidationError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path) or "(top)"
        return f"{where}: {e.message}"
    except kubernetes_validate.InvalidSchemaError as e:
        return f"schema problem: {e}"
    return ""


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    ap.add_argument("paths", nargs="+", type=Path)
    a = ap.parse_args(argv)
    problems, count = [], 0
    for path in a.paths:
        if not path.exists():
            problems.append(f"{path}: no such file or directory")
            continue
        try:
            for where, doc in documents(path):
                count += 1
                why = problem(doc, a.kubernetes_version)
                if why:
                    problems.append(f"{where}: {why}")
        except RenderError as e:
            problems.append(str(e))
    for p in problems:
        print(p, file=sys.stderr)
    print(f"validate: {count} object(s) against Kubernetes {a.kubernetes_version}'s schemas (strict): "
          + (f"{len(problems)} problem(s)" if problems else "all valid"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
