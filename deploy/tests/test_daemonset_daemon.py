"""shardcastd started exactly as the DaemonSet's command line says (args, environment from the
ConfigMap and the downward API, socket path, ports, the TLS Secret's files), then asked on
/healthz (what the probes call), through grpc.health.v1 over mutual TLS (what a TCP client does),
and through the CLI with its default socket (what workload pods use)."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time

import grpc
import pytest

from conftest import K8S, binary, by_kind, localize, render
from test_consistency import env_of, expand


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon does (TIME_WAIT is no conflict)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def health_check(address: str, credentials: grpc.ChannelCredentials) -> int:
    """grpc.health.v1.Health/Check over mutual TLS; returns the ServingStatus number (1 = SERVING).
    The messages are one string field in and one enum field out, encoded by hand to stay
    independent of stubs."""
    options = [("grpc.ssl_target_name_override", "shardcast-daemon")]
    with grpc.secure_channel(address, credentials, options=options) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        response = check(b"", timeout=5)
    assert response[:1] == b"\x08", response  # field 1, varint
    return response[1]


def http_get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        body = b""
        deadline = time.time() + 5
        while time.time() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    return body


def test_daemon_started_as_the_daemonset_says(kubectl, local_tls):
    objects = render(K8S / "base")
    pod = by_kind(objects, "DaemonSet")["shardcastd"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = env_of(container, objects)
    env["NODE_NAME"] = "daemonset-test-node"
    args = [localize(expand(a, env), local_tls) for a in container["args"]]
    socket_path = next(a.split("=", 1)[1] for a in args if a.startswith("--socket="))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    socket_dir = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "socket-dir")
    if os.geteuid() != 0:
        pytest.skip(f"needs root to create {socket_dir} as the DaemonSet's hostPath volume does")
    busy = [p for p in ports.values() if not port_free(p)]
    if busy:
        pytest.skip(f"ports {busy} are in use on this machine; the DaemonSet's ports are fixed")
    os.makedirs(socket_dir, exist_ok=True)  # hostPath type DirectoryOrCreate

    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
    proc = subprocess.Popen([binary("shardcastd"), *args], env={**clean, **env}, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("shardcastd ready node=daemonset-test-node"), line
        assert os.path.exists(socket_path)
        probe = container["readinessProbe"]["httpGet"]
        assert http_get(ports[probe["port"]], probe["path"]).startswith(b"HTTP/1.1 200")
        tls = {name: (local_tls / name).read_bytes() for name in ("ca.crt", "client.crt", "client.key")}
        client = grpc.ssl_channel_credentials(tls["ca.crt"], tls["client.key"], tls["client.crt"])
        assert health_check(f"127.0.0.1:{ports['grpc']}", client) == 1  # SERVING
        anonymous = grpc.ssl_channel_credentials(tls["ca.crt"])  # no client certificate: no handshake
        with pytest.raises(grpc.RpcError):
            health_check(f"127.0.0.1:{ports['grpc']}", anonymous)

        # A workload pod's client: no address given, so the default socket.
        cli_env = {k: v for k, v in clean.items() if k not in ("SHARDCAST_ADDRESS", "SHARDCAST_SOCKET")}
        status = subprocess.run([binary("shardcast"), "status", "--json"], env=cli_env, capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        assert '"node":"daemonset-test-node"' in status.stdout.replace(" ", "")
        health = subprocess.run([binary("shardcast"), "health"], env=cli_env, capture_output=True, text=True, timeout=30)
        assert health.returncode == 0 and "SERVING" in health.stdout
        # /metrics on the metrics port, as the metrics Service scrapes it.
        assert b"shardcast_" in http_get(ports["metrics"], "/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not os.path.exists(socket_path)  # unlinked on SIGTERM, as a pod's shutdown does
