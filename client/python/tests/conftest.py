"""Real shardcastd processes for the Python client's tests, started on loopback per test."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client" / "python"))


def build_dir() -> Path:
    return Path(os.environ.get("SHARDCAST_BUILD", ROOT / "build"))


def shardcastd_path() -> Path:
    path = build_dir() / "bin" / "shardcastd"
    if not path.exists():
        pytest.fail(f"{path} is missing: build first (bash scripts/build.sh) or set SHARDCAST_BUILD")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, node: str, port: int, peers: List[str], tmp: str) -> None:
        self.node = node
        self.address = f"127.0.0.1:{port}"
        self.socket = os.path.join(tmp, f"{node}.sock")
        argv = [str(shardcastd_path()), "--node", node, "--listen", self.address, "--socket", self.socket,
                "--peers", ",".join(peers), "--ucx-tls", "tcp", "--metrics", "127.0.0.1:0", "--log-level", "warn"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("shardcastd ready"):
            self.stop()
            raise RuntimeError(f"shardcastd {node} did not start: {line!r}")

    @property
    def target(self) -> str:
        return "unix:" + self.socket

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cluster():
    """Two daemons, nodes n0 and n1, that know each other."""
    with tempfile.TemporaryDirectory(prefix="shardcast-py-") as tmp:
        ports = [free_port(), free_port()]
        peers = [f"127.0.0.1:{p}" for p in ports]
        daemons = []
        try:
            for i, port in enumerate(ports):
                daemons.append(Daemon(f"n{i}", port, peers, tmp))
            yield daemons
        finally:
            for d in daemons:
                d.stop()
