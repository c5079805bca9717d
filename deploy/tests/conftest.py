"""Shared helpers of the deployment checks: the daemon's own flag set, the rendered manifests."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TOOLS = DEPLOY / "tools"
K8S = DEPLOY / "k8s"
sys.path.insert(0, str(ROOT / "client" / "python"))

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
def node_tools() -> Path:
    """deploy/tools with its npm packages installed (npm ci from the committed lockfile)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed for the manifest checks (scripts/deps.sh installs them)")
    stamp = TOOLS / "node_modules" / ".package-lock.json"
    if not stamp.exists() or stamp.stat().st_mtime < (TOOLS / "package-lock.json").stat().st_mtime:
        r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=TOOLS, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.fail(f"npm ci in deploy/tools failed: {r.stderr[-2000:]}")
    return TOOLS


def render(directory: Path) -> List[dict]:
    r = subprocess.run(["node", str(TOOLS / "render.js"), str(directory), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_kind(objects: List[dict], kind: str) -> Dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}
