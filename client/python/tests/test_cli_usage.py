"""The `shardcast` CLI's answers to a user's mistakes: a mistyped command gets the nearest one,
a version out of range is a usage error (exit 2) rather than a wrapped number, and a TCP daemon
reached with only a CA is told apart from one that is not there; a socket served by a uid the
client does not trust is told apart from no daemon at all (exit 6, not 4) and says which uid to
trust."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from shardcast.local import LocalCluster

from conftest import shardcastd_path


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cli = shardcastd_path().parent / "shardcast"
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=60, env=env)


def test_a_mistyped_command_is_named_with_the_nearest_one():
    typo = _cli("statuss")
    assert typo.returncode == 2
    assert 'no command "statuss"; did you mean "status"?' in typo.stderr
    unknown = _cli("frobnicate")
    assert unknown.returncode == 2
    assert 'no command "frobnicate"' in unknown.stderr and "did you mean" not in unknown.stderr


def test_versions_out_of_range_are_usage_errors_not_wrapped():
    for args in (("sync", "--src", "a", "--dst", "b", "--version", "-1"),
                 ("sync", "--src", "a", "--dst", "b", "--version", "9223372036854775808"),
                 ("wait", "--group", "a", "--version", "0"),
                 ("publish", "--group", "a", "--rank", "0", "--version", "-1")):
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "not in range" in out.stderr


def test_a_ca_without_a_client_certificate_is_named_as_such():
    import os
    with LocalCluster(["n0"]) as c:
        env = dict(os.environ, SHARDCAST_TLS_CA=c.client_tls.ca)
        for name in ("SHARDCAST_TLS_CERT", "SHARDCAST_TLS_KEY", "SHARDCAST_TOKEN_FILE", "SHARDCAST_ADDRESS"):
            env.pop(name, None)
        out = _cli("status", "--daemon", f"127.0.0.1:{c.ports['n0']}", env=env)
        assert out.returncode != 0
        assert "only a CA was given" in out.stderr
        assert "SHARDCAST_TLS_CERT" in out.stderr


def test_a_daemon_of_an_untrusted_uid_is_not_reported_as_unreachable():
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (setpriv) and /usr/bin/python3 to serve a socket as another uid")
    where = tempfile.mkdtemp(prefix="shardcast-uid-", dir="/tmp")
    os.chmod(where, 0o777)
    path = os.path.join(where, "shardcastd.sock")
    served = subprocess.Popen(  # uid 65534 listens where the daemon's socket would be
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
         "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(64)\n"
         "print('listening', flush=True)\nwhile True:\n    s.accept()\n", path],
        stdout=subprocess.PIPE, text=True)
    try:
        assert served.stdout.readline().strip() == "listening"
        env = {k: v for k, v in os.environ.items() if k != "SHARDCAST_DAEMON_UID"}
        out = _cli("status", "--daemon", "unix:" + path, env=env)
        assert out.returncode == 6, (out.returncode, out.stderr)
        assert "runs as uid 65534" in out.stderr and "set SHARDCAST_DAEMON_UID=65534" in out.stderr, out.stderr
        gone = _cli("status", "--daemon", "unix:" + os.path.join(where, "none.sock"), env=env)
        assert gone.returncode == 4 and "not reachable" in gone.stderr, gone.stderr
    finally:
        served.kill()
        served.wait()
        shutil.rmtree(where, ignore_errors=True)
