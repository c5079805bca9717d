#!/usr/bin/env python3
"""Validates Kubernetes manifests against the Kubernetes API's published JSON schemas (the
kubernetes-validate package from PyPI, which ships them), strictly: an unknown field, a wrong type
or a missing required field is an error. Kustomization directories are rendered first with the real
`kubectl kustomize`, so what is checked is exactly what `kubectl apply -k` would send.

    validate.py [--kubernetes-version 1.30] FILE_OR_KUSTOMIZATION_DIR...

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
