#!/usr/bin/env python3
"""Validates Kubernetes manifests against the Kubernetes API's published JSON schemas (the
kubernetes-validate package from PyPI, which ships them), strictly: an unknown field, a wrong type
or a missing required field is an error. Kustomization directories are rendered first with the real
`kubectl kustomize`, so what is checked is exactly what `kubectl apply -k` would send.

    validate.py [--kubernetes-version 1.30] FILE_OR_KUSTOMIZATION_DIR...

cert-manager's Issuer and Certificate (a CRD, not in Kubernetes' schemas) are checked against the
subset of cert-manager.io/v1 the manifests use: known fields only, required ones present.

Prints one line per problem on stderr and a summary on stdout; exit status 1 when anything is
invalid, 2 on bad usage."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import kubernetes_validate
import yaml

#: The oldest Kubernetes release the manifests must work on; pinned so that a new schema release
#: cannot change what passes.
KUBERNETES_VERSION = "1.30"


class RenderError(Exception):
    pass


#: cert-manager.io/v1 fields the manifests may use, per kind: {field: nested spec or None}; "!"
#: marks a required field. Anything else is an error, as with Kubernetes' strict schemas.
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
        if key in spec and nested:
            found = _spec_problem(spec[key], nested, f"{where}.{key}")
            if found:
                return found
    return ""


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
    if doc.get("apiVersion") == "cert-manager.io/v1" and doc.get("kind") in CERT_MANAGER:
        return cert_manager_problem(doc)
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
