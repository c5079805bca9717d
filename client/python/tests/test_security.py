"""The Python client over TCP, as a remote client connects (docs/security.md): mutual TLS with a
client certificate, the bearer token over TLS, and what is refused; registration stays local."""

from __future__ import annotations

import grpc
import pytest

import shardcast
from shardcast.client import TlsFiles
from shardcast.local import LocalCluster

import rank_worker


@pytest.fixture
def secured(tmp_path):
    token = tmp_path / "token"
    token.write_text("py-t0ken\n")
    with LocalCluster(["n0", "n1"], extra=["--client-token-file", str(token)]) as c:
        yield c, token


def test_a_client_certificate_or_the_token_reaches_a_daemon_over_tcp(secured, tmp_path):
    cluster, token = secured
    address = cluster.daemons["n0"].address
    with shardcast.Client(address, tls=cluster.client_tls) as c:
        assert c.status().node == "n0"
    ca_only = TlsFiles(ca=cluster.client_tls.ca)
    with shardcast.Client(address, tls=ca_only, token_file=str(token)) as c:
        assert c.status().node == "n0"
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    with shardcast.Client(address, tls=ca_only, token_file=str(wrong)) as c:
        with pytest.raises(shardcast.ShardcastError) as e:
            c.status()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Plaintext to a TLS port: no connection at all.
    with pytest.raises(shardcast.ShardcastError) as e:
        shardcast.Client(address, tls=TlsFiles(), token_file="", connect_timeout=2)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_environment_configures_tcp_clients(secured, monkeypatch):
    cluster, _ = secured
    monkeypatch.setenv("SHARDCAST_TLS_CA", cluster.client_tls.ca)
    monkeypatch.setenv("SHARDCAST_TLS_CERT", cluster.client_tls.cert)
    monkeypatch.setenv("SHARDCAST_TLS_KEY", cluster.client_tls.key)
    with shardcast.Client(cluster.daemons["n1"].address) as c:
        assert c.status().node == "n1"


def test_ranks_register_only_over_the_unix_socket(secured):
    cluster, _ = secured
    with shardcast.Client(cluster.daemons["n0"].address, tls=cluster.client_tls) as remote:
        with pytest.raises(shardcast.ShardcastError) as e:
            rank_worker.register_trainers(remote)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "Unix socket" in str(e.value)
    with shardcast.Client(cluster.target("n0")) as local:
        regs = rank_worker.register_trainers(local)
        assert regs


def test_segments_the_client_creates_are_0600_whatever_the_umask(cluster):
    import os
    import stat

    n0, _ = cluster
    client = shardcast.Client(n0.target)
    before = os.umask(0)  # the most permissive: a 0660 segment would stay group-writable
    try:
        tensors = {n: rank_worker.shard("trainer", n, 0, 1) for n in rank_worker.SHAPES}  # numpy: copied
        reg = client.register("trainer", 0, 2, tensors, rank_worker.TRAINER, role="source", version=1)
    finally:
        os.umask(before)
    try:
        mode = stat.S_IMODE(os.stat("/dev/shm" + reg.segment).st_mode)
        assert mode == 0o600, oct(mode)
    finally:
        reg.close()


def test_a_process_of_another_uid_in_the_daemons_place_is_not_believed():
    import os
    import shutil
    import subprocess
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (setpriv) and /usr/bin/python3 to run an impostor as another uid")
    where = tempfile.mkdtemp(prefix="shardcast-impostor-", dir="/tmp")  # reachable by nobody
    os.chmod(where, 0o777)
    path = os.path.join(where, "shardcast.sock")
    # nobody listens on the socket path (it could answer WaitVersion with any version it likes).
    impostor = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
         "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(64)\n"
         "print('listening', flush=True)\nwhile True:\n    s.accept()\n", path],
        stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout.readline().strip() == "listening"
        with pytest.raises(shardcast.ShardcastError) as refused:
            shardcast.Client("unix:" + path, connect_timeout=2)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "runs as uid 65534" in str(refused.value) and "not a daemon this client trusts" in str(refused.value)
        from shardcast.client import check_daemon_uid
        assert check_daemon_uid(path, [65534]) == 65534  # a deployment that says so ($SHARDCAST_DAEMON_UID)
    finally:
        impostor.kill()
        impostor.wait()
        shutil.rmtree(where, ignore_errors=True)
