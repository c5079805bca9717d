"""A Shardcast cluster on this machine, for development, examples and tests: one shardcastd per
named node on loopback, each knowing all the others (what a DaemonSet gives on a real cluster).

    with LocalCluster(["trainer-0", "inference-0"]) as cluster:
        client = Client(cluster.target("trainer-0"))
"""

from __future__ import annotations

import os
import re
import random
import select
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shardcast.client import TlsFiles


def find_shardcastd() -> str:
    """$SHARDCASTD, else $SHARDCAST_BUILD/bin/shardcastd, else the source tree's build/, else PATH."""
    if os.environ.get("SHARDCASTD"):
        return os.environ["SHARDCASTD"]
    candidates = []
    if os.environ.get("SHARDCAST_BUILD"):
        candidates.append(Path(os.environ["SHARDCAST_BUILD"]) / "bin" / "shardcastd")
    candidates.append(Path(__file__).resolve().parents[3] / "build" / "bin" / "shardcastd")
    for c in candidates:
        if c.exists():
            return str(c.resolve())
    found = shutil.which("shardcastd")
    if found:
        return found
    raise FileNotFoundError("shardcastd not found: build it (bash scripts/build.sh) and set SHARDCASTD (the binary) or "
                            "SHARDCAST_BUILD (the build directory), or put it on PATH")


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range so that no outgoing connection is given
    it before its listener binds it (a port from bind(0) is ephemeral: any connect() may take it
    meanwhile). Where the caller's own process can listen, bind port 0 instead (TorchRendezvous)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    candidates = random.sample(range(10000, ephemeral_low), 64) if ephemeral_low > 12000 else []
    for port in candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


class TorchRendezvous:
    """The rendezvous store of a torch.distributed group whose ranks run on this host, served by
    this process on a port the kernel assigned as it bound it. (A free_port() that rank 0 binds
    later races with every socket opened in between: CI saw EADDRINUSE.) Keep it alive until the
    ranks are done; each rank calls join_process_group(rendezvous.port, rank, world)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        self.port: int = self._store.port


def join_process_group(port: int, rank: int, world: int, backend: str = "gloo") -> None:
    """torch.distributed.init_process_group through the TorchRendezvous listening on `port`."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def freeze_process(pid: int, timeout: float = 10) -> None:
    """SIGSTOP, then waits until every thread of `pid` is stopped: a stop is delivered to each
    thread as it next runs, so for a moment after kill() the process can still answer a call."""
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append(task.joinpath("stat").read_text().rsplit(") ", 1)[1][:1])
            except (OSError, IndexError):
                pass  # a thread that just exited
        if states and all(s in "tT" for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop within {timeout} s (thread states {states})")
        time.sleep(0.005)


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited within `timeout` seconds; reaps it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ending_with_this_process() -> List[str]:
    """A prefix for a child's argv that has the kernel send it SIGTERM when this process ends, killed
    or not (util-linux's `setpriv --pdeathsig`, which then executes the command: the child keeps
    its pid). The kernel sends it when the *thread* that started the child ends, so only a child
    started from the main thread is tied; none where setpriv is missing."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "TERM"]


class LocalDaemon:
    """One shardcastd process standing for node `node`; stopped with SIGTERM by stop(), and by the
    kernel when the process that started it ends without stopping it (killed; started from the main
    thread, where setpriv is installed): no daemon outlives its test or example."""

    def __init__(self, node: str, port: int, peers: Sequence[str], socket_dir: str, binary: str,
                 extra: Sequence[str] = (), stderr: Any = None, tls: Optional[TlsFiles] = None,
                 host: str = "127.0.0.1", launcher: Sequence[str] = ()) -> None:
        self.node = node
        self.address = f"{host}:{port}"
        self.tls = tls  # what it presents (None: --insecure)
        self.socket = os.path.join(socket_dir, f"{node}.sock")
        argv = [*launcher, binary, "--node", node, "--listen", self.address, "--socket", self.socket, "--peers", ",".join(peers),
                "--metrics", "127.0.0.1:0", *extra]
        if "--log-level" not in extra:
            argv += ["--log-level", "warn"]
        if "--ucx-tls" not in extra:
            argv += ["--ucx-tls", "tcp"]  # what separate hosts would use
        if tls is not None and "--insecure" not in extra:
            argv += ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]
        self.proc = subprocess.Popen([*_ending_with_this_process(), *argv], stdout=subprocess.PIPE, stderr=stderr,
                                     text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("shardcastd ready"):
            self.stop()
            raise RuntimeError(f"shardcastd for node {node} did not start: {line.strip()!r}")
        # The port its /metrics and /healthz were given (0: none, --metrics "").
        found = re.search(r"\bmetrics_port=(\d+)", line)
        self.metrics_port = int(found.group(1)) if found else 0

    @property
    def target(self) -> str:
        """The gRPC target of its Unix socket, as local clients use it."""
        return "unix:" + self.socket

    def stop(self) -> None:
        stop_process(self.proc)
        if self.proc.stdout:
            self.proc.stdout.close()


def mint_certificates(directory: str, binary: str) -> Tuple[TlsFiles, TlsFiles]:
    """A CA, a daemon identity and a client identity in `directory`, by shardcast-certs (installed
    beside shardcastd; scripts/certs.sh in the source tree). Returns (daemon, client) files."""
    script = Path(binary).resolve().parent / "shardcast-certs"
    if not script.exists():
        script = Path(__file__).resolve().parents[3] / "scripts" / "certs.sh"
    done = subprocess.run(["bash", str(script), directory], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"minting certificates with {script} failed: {done.stderr.strip()}")
    d = Path(directory)
    return (TlsFiles(ca=str(d / "ca.pem"), cert=str(d / "daemon.pem"), key=str(d / "daemon.key")),
            TlsFiles(ca=str(d / "ca.pem"), cert=str(d / "client.pem"), key=str(d / "client.key")))


class Namespaces:
    """Network namespaces for LocalCluster(netns=True), as bench/cluster.sh makes them: one per node ("sc-<node>", node k at 10.77.0.<k+2>/24) and a switch ("sc-switch")
    bridging them. Made on entry, removed on exit whatever happens (root only: ip netns). A node
    can be cut off the network (partition) and joined again (heal) while its daemon runs.
    `rate_mbit`: each node's link limited to that rate both ways (tc tbf), as on a real fabric."""

    def __init__(self, nodes: Sequence[str], rate_mbit: int = 0) -> None:
        self.nodes: List[str] = list(nodes)
        self.rate_mbit = rate_mbit
        self._made: List[str] = []

    @staticmethod
    def _ip(*args: str, ns: Optional[str] = None) -> None:
        argv = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def __enter__(self) -> "Namespaces":
        try:
            self._ip("netns", "add", "sc-switch")
            self._made.append("sc-switch")
            self._ip("link", "add", "br0", "type", "bridge", ns="sc-switch")
            self._ip("link", "set", "br0", "up", ns="sc-switch")
            for k, node in enumerate(self.nodes):
                ns = f"sc-{node}"
                self._ip("netns", "add", ns)
                self._made.append(ns)
                self._ip("link", "add", f"scv{k}", "netns", ns, "type", "veth", "peer", "name", f"p{k}", "netns",
                         "sc-switch")
                self._ip("link", "set", f"scv{k}", "name", "eth0", ns=ns)
                self._ip("addr", "add", f"10.77.0.{k + 2}/24", "dev", "eth0", ns=ns)
                self._ip("link", "set", "eth0", "up", ns=ns)
                self._ip("link", "set", "lo", "up", ns=ns)
                self._ip("link", "set", f"p{k}", "master", "br0", ns="sc-switch")
                self._ip("link", "set", f"p{k}", "up", ns="sc-switch")
                if rate_mbit := self.rate_mbit:
                    burst = str(max(65536, rate_mbit * 1_000_000 // 8 // 100))  # 10 ms at the rate
                    for ns_, dev in ((ns, "eth0"), ("sc-switch", f"p{k}")):  # its egress, then its ingress
                        tc = ["ip", "netns", "exec", ns_, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                              f"{rate_mbit}mbit", "burst", burst, "latency", "200ms"]
                        done = subprocess.run(tc, capture_output=True, text=True)
                        if done.returncode != 0:
                            raise RuntimeError(f"{' '.join(tc)} failed: {done.stderr.strip()}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def partition(self, node: str) -> None:
        """Cuts `node` off: its switch port goes down (packets to and from it are lost)."""
        self._ip("link", "set", f"p{self.nodes.index(node)}", "down", ns="sc-switch")

    def heal(self, node: str) -> None:
        self._ip("link", "set", f"p{self.nodes.index(node)}", "up", ns="sc-switch")

    def __exit__(self, *exc) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []


class LocalCluster:
    """Daemons for `nodes`, started on entry (or start()) and stopped on exit (or stop()), with
    mutual TLS between them (certificates minted into the cluster's temporary directory; pass
    "--insecure" in `extra` for plaintext). `client_tls` is what a TCP client presents."""

    def __init__(self, nodes: Sequence[str], *, binary: Optional[str] = None, extra: Sequence[str] = (),
                 netns: bool = False) -> None:
        self.nodes: List[str] = list(nodes)
        # netns: node k's daemon runs in network namespace "sc-<node>" at 10.77.0.<k+2>:7070, as
        # bench/cluster.sh makes them (root only); clients still reach it over its Unix socket.
        self.netns = netns
        self.binary = binary or find_shardcastd()
        self.extra = list(extra)
        self.daemons: Dict[str, LocalDaemon] = {}
        self.ports: Dict[str, int] = {}
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self.daemon_tls: Optional[TlsFiles] = None
        self.client_tls: Optional[TlsFiles] = None

    def start(self) -> "LocalCluster":
        self._tmp = tempfile.TemporaryDirectory(prefix="shardcast-local-")
        if "--insecure" not in self.extra:
            self.daemon_tls, self.client_tls = mint_certificates(os.path.join(self._tmp.name, "certs"), self.binary)
        self.ports = {}
        for node in self.nodes:  # a port each: two draws of free_port() may give the same one
            port = 7070 if self.netns else free_port()
            while not self.netns and port in self.ports.values():
                port = free_port()
            self.ports[node] = port
        try:
            for node in self.nodes:
                self.restart(node)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, node: str, extra: Optional[Sequence[str]] = None) -> LocalDaemon:
        """(Re)starts the daemon of `node` on its port (the old process must be gone), with the
        cluster's flags, or `extra` instead."""
        assert self._tmp is not None, "start the cluster first"
        hosts = {n: f"10.77.0.{k + 2}" if self.netns else "127.0.0.1" for k, n in enumerate(self.nodes)}
        peers = [f"{hosts[n]}:{p}" for n, p in self.ports.items()]
        launcher = ["ip", "netns", "exec", f"sc-{node}"] if self.netns else []
        self.daemons[node] = LocalDaemon(node, self.ports[node], peers, self._tmp.name, self.binary,
                                         self.extra if extra is None else extra, tls=self.daemon_tls,
                                         host=hosts[node], launcher=launcher)
        return self.daemons[node]

    def target(self, node: str) -> str:
        return self.daemons[node].target

    def stop(self) -> None:
        for d in self.daemons.values():
            d.stop()
        self.daemons = {}
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
