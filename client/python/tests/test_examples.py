"""The other-language examples against real daemons: the Go client (built from Debian's Go packages)
and the shell script around the CLI. Ranks are registered from Python workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="module")
def go_example(tmp_path_factory):
    """The Go example client, built with Debian's Go toolchain and packages (GOPATH mode)."""
    out = tmp_path_factory.mktemp("go") / "shardcast-sync"
    r = subprocess.run(["bash", str(ROOT / "client" / "examples" / "go" / "build.sh"), str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"the Go example does not build (scripts/deps.sh installs Go): {r.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_go_example_syncs_watches_and_waits(go_example, registered):
    (n0, n1), workers = registered
    go = str(go_example)

    def run_sync():
        out = subprocess.run([go, "sync", "--daemon", n0.target, "--src", "trainer", "--dst", "infer", "--version", "1",
                              "--verify"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["version"] == 1 and result["network_bytes"] > 0
        assert "committed" in out.stderr  # the progress stream, followed while the sync ran
        waited = subprocess.run([go, "wait", "--daemon", n1.target, "--group", "infer", "--version", "1",
                                 "--timeout-s", "10"], capture_output=True, text=True, timeout=60)
        assert waited.returncode == 0, waited.stderr
        assert json.loads(waited.stdout) == {"group": "infer", "version": 1}

    write_and_check(workers, 1, run_sync)
    again = subprocess.run([go, "sync", "--daemon", n0.target, "--src", "trainer", "--dst", "infer", "--version", "1"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 5 and "not newer" in again.stderr
    later = subprocess.run([go, "wait", "--daemon", n1.target, "--group", "infer", "--version", "2", "--timeout-s",
                            "0.5"], capture_output=True, text=True, timeout=60)
    assert later.returncode == 5 and "at version 1" in later.stderr
    nowhere = subprocess.run([go, "sync", "--daemon", "unix:/tmp/shardcast-go-nobody.sock", "--src", "a", "--dst",
                              "b", "--version", "1"], capture_output=True, text=True, timeout=60)
    assert nowhere.returncode == 4 and "not reachable" in nowhere.stderr
    for usage in (["sync", "--src", "a"], ["wait", "--group", "g"], ["frobnicate"], [], ["sync", "--bogus"]):
        assert subprocess.run([go, *usage], capture_output=True).returncode == 2, usage
    # Over TCP: mutual TLS with the client certificate from the environment, or nothing at all.
    certs = Path(n1.tls.ca).parent
    tls_env = dict(os.environ, SHARDCAST_TLS_CA=str(certs / "ca.pem"), SHARDCAST_TLS_CERT=str(certs / "client.pem"),
                   SHARDCAST_TLS_KEY=str(certs / "client.key"))
    remote = subprocess.run([go, "wait", "--daemon", n1.address, "--group", "infer", "--version", "1"],
                            capture_output=True, text=True, timeout=60, env=tls_env)
    assert remote.returncode == 0, remote.stderr
    plaintext = subprocess.run([go, "wait", "--daemon", n1.address, "--group", "infer", "--version", "1"],
                               capture_output=True, text=True, timeout=60)
    assert plaintext.returncode == 4


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


@pytest.mark.slow
def test_rl_loop_example_sees_every_step():
    shardcastd_path()
    out = subprocess.run([sys.executable, str(ROOT / "client" / "examples" / "rl_loop" / "run.py"), "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 steps, every inference rank saw every step exactly" in out.stdout
    assert out.stdout.count("every weight matches the trainer") == 8  # 4 ranks x 2 steps
