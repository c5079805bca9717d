"""The other-language examples against real daemons: the Node.js script (when npm can install its
dependencies) and the shell script around the CLI. Ranks are registered from Python workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import rank_worker
from conftest import ROOT, build_dir, shardcastd_path
from rank_worker import Ranks, recv


@pytest.fixture
def registered(cluster):
    """Trainer ranks on n0 and inference ranks on n1, each in its own process."""
    n0, n1 = cluster
    specs = [("trainer", 0, n0.target, False), ("trainer", 1, n0.target, False),
             ("infer", 0, n1.target, False), ("infer", 1, n1.target, False)]
    with Ranks(specs) as ranks:
        yield cluster, ranks.workers


def write_and_check(workers, version, run_sync):
    for role, conn, _ in workers:
        if role == "trainer":
            conn.send(("write", version))
            recv(conn, "written")
    run_sync()
    for role, conn, _ in workers:
        if role == "infer":
            conn.send(("check", version))
            assert recv(conn, "checked") == (version, 0)


def test_node_example_triggers_a_sync(registered, tmp_path):
    (n0, _), workers = registered
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js example not run: node/npm are not installed")
    example = ROOT / "client" / "examples" / "node"
    for f in ("package.json", "package-lock.json", "sync.js"):
        shutil.copy(example / f, tmp_path / f)
    install = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
    if install.returncode != 0:
        pytest.skip(f"Node.js example not run: npm could not install @grpc/grpc-js ({install.stderr.strip()[-300:]})")
    env = dict(os.environ, SHARDCAST_PROTO_DIR=str(ROOT / "proto"))

    def run_sync():
        out = subprocess.run(["node", "sync.js", "--daemon", n0.target, "--src", "trainer", "--dst", "infer",
                              "--version", "1", "--verify"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert '"version":"1"' in out.stdout
        assert "committed" in out.stderr

    write_and_check(workers, 1, run_sync)
    again = subprocess.run(["node", "sync.js", "--daemon", n0.target, "--src", "trainer", "--dst", "infer",
                            "--version", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 5 and "not newer" in again.stderr
    nowhere = subprocess.run(["node", "sync.js", "--daemon", "unix:/tmp/shardcast-node-nobody.sock", "--src", "a",
                              "--dst", "b", "--version", "1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
    assert nowhere.returncode == 4
    assert subprocess.run(["node", "sync.js", "--src", "a"], cwd=tmp_path, env=env, capture_output=True).returncode == 2


def test_shell_example_syncs_with_the_cli(registered):
    (n0, n1), workers = registered
    env = dict(os.environ, SHARDCAST_ADDRESS=n0.target, SHARDCAST_CLI=str(build_dir() / "bin" / "shardcast"))

    def run_sync():
        out = subprocess.run(["bash", str(ROOT / "client" / "examples" / "shell" / "sync.sh"), "trainer", "infer", "2",
                              n1.target],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "sync result:" in out.stdout
        assert "GROUP" in out.stdout  # the layouts table

    write_and_check(workers, 2, run_sync)


def test_rl_loop_example_sees_every_step():
    shardcastd_path()
    out = subprocess.run([sys.executable, str(ROOT / "client" / "examples" / "rl_loop" / "run.py"), "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 steps, every inference rank saw every step exactly" in out.stdout
    assert out.stdout.count("every weight matches the trainer") == 8  # 4 ranks x 2 steps
