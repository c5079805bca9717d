#!/usr/bin/env python3
"""Replica sets on an emulated network (docs/performance.md, "Replica sets"): a trainer node t0
and data-parallel replicas i0..i3 (TP=2 each, a node of its own), every node a network namespace
with its link limited to --rate-mbit both ways, one shardcastd per node (UCX over TCP). Prints:

- the set's sync with 3 replicas (the trainer sends each byte once, the replicas relay);
- catch-up of a replica that joins: from its peers (the trainer's egress meanwhile) against from
  the trainer (a version only the trainer holds), the same bytes either way;
- the trainer's next sync into the set while that catch-up runs (its time against a sync alone);
- a sync with one replica frozen (SIGSTOP) from its start, per replica deadline: its time against
  the deadline plus a clean sync's.

Every replica's bytes are checked after each step. Needs root (ip netns, tc).

    sudo .venv/bin/python bench/replica_bench.py [--rate-mbit 1000] [--mib 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))

import numpy as np  # noqa: E402

import shardcast  # noqa: E402
from shardcast.local import LocalCluster, Namespaces  # noqa: E402

TRAINER = "t0"
REPLICAS = ["i0", "i1", "i2", "i3"]


def layouts(rows: int, cols: int):
    tensor = [{"name": "w", "shape": [rows, cols], "dtype": "float32", "placements": [{"shard": {"dim": 0}}]}]
    trainer = {"group": "trainer", "mesh": {"shape": [2]}, "nodes": [TRAINER] * 2, "tensors": tensor}

    def replica(k: int) -> dict:
        return {"group": f"rollout.r{k}", "replica_set": "rollout", "replica": k, "mesh": {"shape": [2]},
                "nodes": [REPLICAS[k]] * 2,
                "tensors": [{"name": "w", "shape": [rows, cols], "dtype": "float32",
                             "placements": [{"shard": {"dim": 1}}]}]}
    return trainer, replica


def weights(rows: int, cols: int, version: int) -> np.ndarray:
    return (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + version * 0.5)


def bytes_sent(cluster: LocalCluster, node: str) -> float:
    # The daemon's /metrics listens on its own namespace's loopback: read it from inside.
    import subprocess
    out = subprocess.run(["ip", "netns", "exec", f"sc-{node}", "python3", "-c",
                          "import urllib.request,sys;sys.stdout.write(urllib.request.urlopen("
                          f"'http://127.0.0.1:{cluster.daemons[node].metrics_port}/metrics',timeout=10).read().decode())"],
                         capture_output=True, text=True, check=True).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("shardcast_bytes_sent_total ")))


class Bench:
    def __init__(self, cluster: LocalCluster, rows: int, cols: int) -> None:
        self.c = cluster
        self.rows, self.cols = rows, cols
        self.clients = {n: shardcast.Client(cluster.target(n), timeout=30) for n in cluster.nodes}
        tl, self.replica_layout = layouts(rows, cols)
        self.version = 1
        full = weights(rows, cols, 1)
        self.trainer = [self.clients[TRAINER].register("trainer", r, 2, {"w": np.array_split(full, 2, 0)[r].copy()}, tl,
                                                       role="source", version=1) for r in range(2)]
        self.replicas = {k: self.register(k) for k in range(3)}

    def register(self, k: int):
        layout = self.replica_layout(k)
        return [self.clients[REPLICAS[k]].register(layout["group"], r, 2,
                                                   {"w": np.zeros((self.rows, self.cols // 2), np.float32)}, layout)
                for r in range(2)]

    def step(self) -> int:
        self.version += 1
        full = weights(self.rows, self.cols, self.version)
        for r, reg in enumerate(self.trainer):
            with reg.writing(self.version):
                reg.tensors["w"][...] = np.array_split(full, 2, 0)[r]
        return self.version

    def check(self, regs, version: int) -> None:
        full = weights(self.rows, self.cols, version)
        for r, reg in enumerate(regs):
            if not np.array_equal(reg.tensors["w"], np.array_split(full, 2, 1)[r]):
                raise AssertionError(f"{reg.group} rank {r} does not hold version {version}")

    def sync(self, **options) -> shardcast.client.service_pb2.SyncResponse:
        return self.clients[TRAINER].sync("trainer", "rollout", self.version, timeout=120, **options)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mbit", type=int, default=1000)
    ap.add_argument("--mib", type=int, default=64, help="the model's size (one float32 tensor)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--deadlines", default="0.5,1,2", help="replica deadlines (s) of the frozen-replica syncs")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("replica_bench: needs root (network namespaces)", file=sys.stderr)
        return 2
    cols = 1024
    rows = a.mib * (1 << 20) // 4 // cols
    mib = rows * cols * 4 / (1 << 20)
    link = a.rate_mbit / 8  # MB/s
    nodes = [TRAINER] + REPLICAS
    print(f"{mib:.0f} MiB model, links of {a.rate_mbit} Mbit/s ({mib * 1.048576 / link:.2f} s per copy at the rate)")
    with Namespaces(nodes, rate_mbit=a.rate_mbit), \
            LocalCluster(nodes, netns=True, extra=["--nic-gbps", str(a.rate_mbit / 1000)]) as c:
        b = Bench(c, rows, cols)
        b.sync()  # plans and connections made
        alone = []
        for _ in range(a.repeat):
            b.step()
            t = time.monotonic()
            b.sync()
            alone.append(time.monotonic() - t)
            for regs in b.replicas.values():
                b.check(regs, b.version)
        print(f"sync into 3 replicas: {min(alone):.2f} s (best of {a.repeat})")

        peer, peer_egress, source, source_egress, during, during_catch = [], [], [], [], [], []
        for _ in range(a.repeat):
            joiner = b.register(3)
            sent = bytes_sent(c, TRAINER)
            t = time.monotonic()
            resp = b.clients["i3"].catch_up("rollout.r3", "trainer", timeout=120)
            peer.append(time.monotonic() - t)
            peer_egress.append(bytes_sent(c, TRAINER) - sent)
            assert resp.seeded_from.startswith("rollout.r"), resp.seeded_from
            b.check(joiner, b.version)
            # A version only the trainer holds: the trainer seeds the same bytes.
            b.step()
            sent = bytes_sent(c, TRAINER)
            t = time.monotonic()
            resp = b.clients["i3"].catch_up("rollout.r3", "trainer", b.version, timeout=120)
            source.append(time.monotonic() - t)
            source_egress.append(bytes_sent(c, TRAINER) - sent)
            assert resp.seeded_from == "trainer", resp.seeded_from
            b.check(joiner, b.version)
            b.sync()  # the others to the version too
            for reg in joiner:
                reg.close()
            # The trainer's next sync while a new joiner catches up from its peers.
            joiner = b.register(3)
            done = {}
            catching = threading.Thread(target=lambda: done.setdefault(
                "t", (time.monotonic(), b.clients["i3"].catch_up("rollout.r3", "trainer", timeout=120),
                      time.monotonic())))
            b.step()
            catching.start()
            time.sleep(0.05)
            t = time.monotonic()
            resp = b.sync()
            during.append(time.monotonic() - t)
            catching.join()
            began, caught, ended = done["t"]
            during_catch.append(ended - began)
            b.sync()  # whatever the race cut, repaired
            for regs in b.replicas.values():
                b.check(regs, b.version)
            for reg in joiner:
                reg.close()
        print(f"catch-up of a joining replica from its peers: {statistics.median(peer):.2f} s, "
              f"trainer egress {statistics.median(peer_egress) / (1 << 20):.1f} MiB")
        print(f"catch-up from the trainer (a version no replica holds): {statistics.median(source):.2f} s, "
              f"trainer egress {statistics.median(source_egress) / (1 << 20):.1f} MiB")
        print(f"the trainer's sync into the set while a replica catches up from its peers: "
              f"{statistics.median(during):.2f} s (alone {statistics.median(alone):.2f} s); the catch-up "
              f"{statistics.median(during_catch):.2f} s")

        for deadline in [float(x) for x in a.deadlines.split(",")]:
            times = []
            for _ in range(a.repeat):
                b.step()
                pid = c.daemons["i2"].proc.pid
                os.kill(pid, signal.SIGSTOP)
                t = time.monotonic()
                resp = b.sync(replica_deadline_s=deadline)
                times.append(time.monotonic() - t)
                os.kill(pid, signal.SIGCONT)
                cut = {o.group for o in resp.replicas if not o.committed}
                assert cut == {"rollout.r2"}, cut
                b.check(b.replicas[0], b.version)
                b.check(b.replicas[1], b.version)
                time.sleep(1.0)  # r2's daemon back and its abort done
                b.sync()  # repairs r2
                b.check(b.replicas[2], b.version)
            print(f"sync with replica r2 frozen, replica deadline {deadline:.1f} s: {statistics.median(times):.2f} s "
                  f"(deadline + a clean sync: {deadline + statistics.median(alone):.2f} s)")
        for reg in b.trainer + [reg for regs in b.replicas.values() for reg in regs]:
            reg.close()
        for client in b.clients.values():
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
