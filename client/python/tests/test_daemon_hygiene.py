"""shardcastd's own hygiene, on real processes: --version, unknown config keys, duplicate node
names, a live daemon's socket, bounded and quiet shutdown, registered memory truncated under it;
and that of the tools beside it: docs/clients.md lists the CLI as its --help does, and
shardcast-certs explains itself."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import shardcast
from shardcast.local import LocalCluster, LocalDaemon, free_port, freeze_process, mint_certificates

import rank_worker
from conftest import ROOT, shardcastd_path


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([str(shardcastd_path()), *args], capture_output=True, text=True, timeout=timeout)


def test_version_flags_of_both_binaries():
    daemon = _run("--version")
    assert daemon.returncode == 0
    assert daemon.stdout.startswith("shardcastd 0.")
    cli = subprocess.run([str(shardcastd_path().parent / "shardcast"), "--version"], capture_output=True, text=True)
    assert cli.returncode == 0
    assert cli.stdout.startswith("shardcast 0.")
    assert cli.stdout.split()[1] == daemon.stdout.split()[1]


def _cli_help(*subcommand: str) -> str:
    cli = shardcastd_path().parent / "shardcast"
    return subprocess.run([str(cli), *subcommand, "--help"], capture_output=True, text=True, check=True).stdout


def test_the_cli_list_in_clients_md_matches_the_cli():
    """Every subcommand of `shardcast --help` has a line in docs/clients.md's CLI list, with every
    option its own --help shows (--daemon and --json are said once for all of them)."""
    section = (ROOT / "docs" / "clients.md").read_text().split("## The `shardcast` CLI", 1)[1].split("\n## ", 1)[0]
    documented = {}  # subcommand -> its usage line(s) in the list
    for line in section.splitlines():
        if line.startswith("    shardcast "):
            name = line.split()[1]
            documented[name] = line
        elif line.startswith("        ") and documented:  # a usage line continued
            documented[name] += line
    subcommands = re.findall(r"^  (\w+) ", _cli_help().split("Subcommands:", 1)[1], re.M)
    assert "health" in subcommands
    for sub in subcommands:
        assert sub in documented, f"docs/clients.md does not list `shardcast {sub}`"
        options = set(re.findall(r"^ +(--[\w-]+)", _cli_help(sub), re.M)) - {"--help", "--daemon", "--json"}
        missing = sorted(o for o in options if o not in documented[sub])
        assert not missing, f"docs/clients.md's `shardcast {sub}` lacks {missing}"
    assert set(documented) <= set(subcommands) | {"--version"}


def test_shardcast_certs_help_says_what_it_makes(tmp_path):
    # The script as installed beside shardcastd (build/bin/shardcast-certs, a copy made at configure time).
    script = tmp_path / "bin" / "shardcast-certs"
    script.parent.mkdir()
    shutil.copy(ROOT / "scripts" / "certs.sh", script)
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0
    assert usage.stdout.startswith("Usage: shardcast-certs DIR [NODE...]\n")
    assert "set -euo pipefail" not in usage.stdout
    for output in ("ca.pem, ca.key", "daemon.pem, daemon.key", "NODE.pem, NODE.key", "client.pem, client.key"):
        assert output in usage.stdout
    bare = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stdout == "" and bare.stderr == usage.stdout
    made = subprocess.run(["bash", str(script), str(tmp_path / "certs"), "a", "b"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"certificates in {tmp_path / 'certs'}: ca.pem/.key, a.pem/.key, b.pem/.key, client.pem/.key\n"
    assert sorted(p.name for p in (tmp_path / "certs").glob("*.pem")) == ["a.pem", "b.pem", "ca.pem", "client.pem"]


def test_unknown_config_keys_are_an_error(tmp_path):
    config = tmp_path / "shardcastd.toml"
    config.write_text('node = "n9"\nstaging-mib = 64\nstagin-mib = 128\n')
    out = _run("--config", str(config), "--print-config", "--insecure")
    assert out.returncode == 2
    assert "stagin-mib" in out.stdout + out.stderr
    config.write_text('node = "n9"\nstaging-mib = 64\n')
    out = _run("--config", str(config), "--print-config", "--insecure")
    assert out.returncode == 0, out.stderr
    assert "node=n9" in out.stdout and "staging_mib=64" in out.stdout


def test_a_second_daemon_with_a_taken_node_name_or_socket_is_refused(tmp_path):
    with LocalCluster(["n0", "n1"]) as c:
        peers = ",".join(f"127.0.0.1:{p}" for p in c.ports.values())
        tls = c.daemon_tls
        tls_args = ("--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca)
        # The same node name as n1, its own socket and port: refused loudly at start.
        dup = _run("--node", "n1", "--listen", f"127.0.0.1:{free_port()}", "--socket", str(tmp_path / "dup.sock"),
                   "--peers", peers, "--metrics", "", "--ucx-tls", "tcp", *tls_args)
        assert dup.returncode == 1
        assert 'already serves node "n1"' in dup.stderr
        # n0's socket is held by n0: a daemon given it refuses and leaves it alone.
        taken = _run("--node", "n7", "--listen", f"127.0.0.1:{free_port()}", "--socket", c.daemons["n0"].socket,
                     "--metrics", "", "--ucx-tls", "tcp", *tls_args)
        assert taken.returncode == 1
        assert "another shardcastd" in taken.stderr and "refusing to take its socket" in taken.stderr
        assert shardcast.Client(c.target("n0")).status().node == "n0"  # still served


def _sync_once(c_src: shardcast.Client, c_dst: shardcast.Client):
    regs = rank_worker.register_trainers(c_src)
    regs += rank_worker.register_inference(c_dst)
    c_src.sync("trainer", "infer", 1)
    return regs


def _two_daemons(tmp_path, flags):
    """Daemons n0 and n1 with mutual TLS, each logging to tmp_path/<node>.log; and those files."""
    ports = {"n0": free_port(), "n1": free_port()}
    peers = [f"127.0.0.1:{p}" for p in ports.values()]
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ports}
    tls, _ = mint_certificates(str(tmp_path / "certs"), str(shardcastd_path()))
    daemons = {n: LocalDaemon(n, ports[n], peers, str(tmp_path), str(shardcastd_path()), flags, stderr=logs[n],
                              tls=tls) for n in ports}
    return daemons, logs


def test_a_clean_stop_is_quiet_on_both_sides(tmp_path):
    daemons, logs = _two_daemons(tmp_path, ["--log-level", "info"])
    try:
        src, dst = shardcast.Client(daemons["n0"].target), shardcast.Client(daemons["n1"].target)
        _sync_once(src, dst)
        dst.close()
        daemons["n1"].stop()
        assert daemons["n1"].proc.returncode == 0
        src.close()
        daemons["n0"].stop()
        assert daemons["n0"].proc.returncode == 0
    finally:
        for d in daemons.values():
            d.stop()
        for f in logs.values():
            f.close()
    for n in daemons:
        text = (tmp_path / f"{n}.log").read_text()
        assert " warning " not in text and " error " not in text and " critical " not in text, f"{n}:\n{text}"
        assert "stopped" in text


def test_json_logs_are_one_object_per_line_naming_node_and_sync(tmp_path):
    """--log-format json: every line of both daemons is a JSON object with time, level and node;
    the coordinator's line for each sync names the sync and the group and carries its figures:
    phases and bytes for the committed one, phases, the node at fault and the error for one that
    failed on its daemons."""
    import json
    daemons, logs = _two_daemons(tmp_path, ["--log-level", "info", "--log-format", "json"])
    try:
        src, dst = shardcast.Client(daemons["n0"].target), shardcast.Client(daemons["n1"].target)
        regs = _sync_once(src, dst)
        trainers, infers = regs[:2], regs[2:]

        def step(version):
            for t in trainers:
                with t.writing(version):
                    for name, x in t.tensors.items():
                        x[...] = rank_worker.shard("trainer", name, t.rank, version)

        step(2)
        src.sync("trainer", "infer", 2, delta="auto", sync_id="keeps-bases")
        for t in trainers:  # version 3 changes one element of each trainer shard: it travels as a delta
            with t.writing(3):
                t.tensors["w"].flat[0] += 1
        infers[0].tensors["w"][...] += 1  # written outside a sync: the delta cannot rebuild version 3 there
        with pytest.raises(shardcast.ShardcastError) as failed:
            src.sync("trainer", "infer", 3, delta="auto", sync_id="fails-on-n1")
        assert failed.value.code.name == "DATA_LOSS", failed.value
        dst.close()
        src.close()
    finally:
        for d in daemons.values():
            d.stop()
        for f in logs.values():
            f.close()
    for n in daemons:
        lines = (tmp_path / f"{n}.log").read_text().splitlines()
        assert lines, f"{n} logged nothing"
        parsed = [json.loads(line) for line in lines]
        for p in parsed:
            assert p["node"] == n and p["level"] in ("info", "warning") and p["time"].endswith("Z"), p
    committed = [p for p in (json.loads(line) for line in (tmp_path / "n0.log").read_text().splitlines())
                 if "committed in" in p["msg"]]
    assert len(committed) == 2, committed
    line = committed[0]
    assert line["group"] == "infer" and line["sync"], line  # the id the client chose
    assert "execute" in line["msg"] and "bytes over the network" in line["msg"], line
    failed = [p for p in (json.loads(line) for line in (tmp_path / "n0.log").read_text().splitlines())
              if "failed after" in p["msg"]]
    assert len(failed) == 1, failed
    line = failed[0]
    assert line["level"] == "warning" and line["sync"] == "fails-on-n1" and line["group"] == "infer", line
    for figure in ("gather", "plan", "prepare", "execute", '"n1"', "version 3"):
        assert figure in line["msg"], line


def test_shutdown_is_bounded_while_a_peer_is_frozen():
    with LocalCluster(["n0", "n1"], extra=["--shutdown-grace-ms", "1000"]) as c:
        src, dst = shardcast.Client(c.target("n0")), shardcast.Client(c.target("n1"))
        _sync_once(src, dst)  # n0 holds a transport endpoint to n1 now
        n1 = c.daemons["n1"]
        freeze_process(n1.proc.pid)
        try:
            began = time.monotonic()
            c.daemons["n0"].proc.send_signal(signal.SIGTERM)
            c.daemons["n0"].proc.wait(timeout=20)
            # The grace period, then 2 s more at most before the daemon abandons what is left.
            assert time.monotonic() - began < 6
        finally:
            os.kill(n1.proc.pid, signal.SIGCONT)
        src.close()
        dst.close()


def _ended(pid: int) -> bool:
    """Whether process `pid` has exited (gone, or a zombie its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is not installed")
def test_a_local_clusters_daemons_end_with_the_process_that_started_it_even_killed():
    """A script using LocalCluster that is killed (a test's timeout, kill -9) runs no cleanup: its
    daemons end with it all the same, rather than running on, holding ports and sockets."""
    script = ("import sys, time\n"
              "from shardcast.local import LocalCluster\n"
              "c = LocalCluster(['n0', 'n1'], extra=['--insecure']).start()\n"
              "print(' '.join(str(d.proc.pid) for d in c.daemons.values()), flush=True)\n"
              "time.sleep(600)\n")
    env = dict(os.environ, SHARDCASTD=str(shardcastd_path()))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        assert not any(_ended(p) for p in pids)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15  # SIGTERM: the daemons shut down as they do when stopped
        while not all(_ended(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_ended(p) for p in pids), f"daemons {pids} still run after the process that started them died"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_a_truncated_registered_segment_fails_the_sync_not_the_daemon(cluster):
    n0, n1 = cluster
    src, dst = shardcast.Client(n0.target), shardcast.Client(n1.target)
    regs = rank_worker.register_trainers(src)
    outs = rank_worker.register_inference(dst)
    fd = os.open("/dev/shm" + outs[1].segment, os.O_RDWR)
    os.ftruncate(fd, 64)  # its owner frees most of it
    os.close(fd)
    with pytest.raises(shardcast.ShardcastError) as e:
        src.sync("trainer", "infer", 1)
    assert e.value.code.name == "FAILED_PRECONDITION"
    assert f'shm segment "{outs[1].segment}" was truncated' in e.value.details
    assert 'group "infer" rank 1 on node "n1"' in e.value.details
    assert dst.status().node == "n1"  # alive
    for reg in regs + outs:
        reg.close()
