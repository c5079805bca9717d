"""Chaos soak: a 5-daemon cluster on loopback syncs a trainer group into an inference group again
and again while a random daemon (the coordinator included) is killed (SIGKILL) or frozen
(SIGSTOP, then SIGCONT) at a random moment of every third sync. After every sync it checks the
version contract against the bytes themselves:

- torn: a rank reports ready(V) while any of its elements differs from the source's V;
- mislabeled: of those, a rank whose bytes are partly a newer version than the one it reports;
- unnamed: a failed sync whose error names no node;
- wedged: after recovery (daemons restarted, ranks re-registered by their clients), a sync
  without a fault still fails after 3 tries;
- crashed: a daemon that died without being targeted.

Ranks live in this process: one shardcast.Client per node (each with its own session, so the
clients re-register by themselves after their daemon restarts), numpy arrays in shared memory.

    python chaos.py --syncs 300            # bench/chaos.sh runs this; prints the figures
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

import shardcast
from shardcast.local import LocalCluster

TRAINER_NODES = ["t0", "t1"]
INFERENCE_NODES = ["i0", "i1", "i2"]
NODES = TRAINER_NODES + INFERENCE_NODES

# name -> (global shape, trainer shard dim, inference tensor-parallel shard dim or None = replicated)
TENSORS = {
    "w": ((1024, 2048), 0, 0),
    "o": ((2048, 1024), 0, 1),
    "e": ((256, 256), 1, 0),
    "b": ((1024,), 0, None),
}
TRAINER_WORLD = 4   # ranks 0, 1 on t0; 2, 3 on t1
TP, DP = 2, 3       # inference: replica d on node i<d>, tensor-parallel ranks 2d, 2d+1


def trainer_layout() -> dict:
    return {"group": "trainer", "mesh": {"shape": [TRAINER_WORLD]}, "nodes": ["t0", "t0", "t1", "t1"],
            "tensors": [{"name": n, "shape": list(shape), "dtype": "int32", "placements": [{"shard": {"dim": d}}]}
                        for n, (shape, d, _) in TENSORS.items()]}


def inference_layout() -> dict:
    tensors = []
    for n, (shape, _, tp_dim) in TENSORS.items():
        tp = {"replicate": {}} if tp_dim is None else {"shard": {"dim": tp_dim}}
        tensors.append({"name": n, "shape": list(shape), "dtype": "int32", "placements": [{"replicate": {}}, tp]})
    nodes = [INFERENCE_NODES[r // TP] for r in range(DP * TP)]
    return {"group": "infer", "mesh": {"shape": [DP, TP]}, "nodes": nodes, "tensors": tensors}


def full(name: str, version: int) -> np.ndarray:
    shape = TENSORS[name][0]
    n = int(np.prod(shape))
    return ((np.arange(n, dtype=np.int64) * 7 + version * 1_000_003) % (2 ** 31 - 1)).astype(np.int32).reshape(shape)


def piece(name: str, version: int, dim: Optional[int], index: int, parts: int) -> np.ndarray:
    a = full(name, version)
    if dim is None:
        return a
    return np.array_split(a, parts, axis=dim)[index].copy()  # even splits: torch.chunk's pieces


def trainer_piece(name: str, rank: int, version: int) -> np.ndarray:
    return piece(name, version, TENSORS[name][1], rank, TRAINER_WORLD)


def inference_piece(name: str, rank: int, version: int) -> np.ndarray:
    return piece(name, version, TENSORS[name][2], rank % TP, TP)


def wait_registered(clients: Dict[str, "shardcast.Client"], want: set, timeout: float = 30) -> None:
    """Until every (group, rank) in `want` is registered with one of `clients`' daemons again
    (clients re-register by themselves after their daemon restarts)."""
    deadline = time.monotonic() + timeout
    got: set = set()
    error = ""
    while True:
        try:
            got = set()
            for client in clients.values():
                got |= {(r.group, r.rank) for r in client.list(all_nodes=False).ranks}
            if want <= got:
                return
        except shardcast.ShardcastError as e:
            error = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks not registered again within {timeout} s: missing {sorted(want - got)} {error}")
        time.sleep(0.05)


def restart_dead(cluster: LocalCluster, killed: Optional[str], version: int, problems: List[str]) -> int:
    """Restarts every daemon that died; one that died without being `killed` is a crash, named in
    `problems`. Returns how many crashed."""
    crashed = 0
    for node, d in cluster.daemons.items():
        if d.proc.poll() is not None:
            if node != killed:
                crashed += 1
                problems.append(f"v{version}: daemon {node} died untargeted (exit {d.proc.returncode})")
            d.stop()
            cluster.restart(node)
    return crashed


def wrong_elements(tensors: Dict[str, np.ndarray], expected, version: int, newest: int) -> Tuple[int, bool]:
    """How many elements of a rank reporting ready(`version`) differ from `expected(name,
    version)`, and whether some of the wrong ones are a newer version's (up to `newest`): torn,
    and mislabeled."""
    wrong, newer = 0, False
    for n, got in tensors.items():
        bad = got != expected(n, version)
        count = int(np.count_nonzero(bad))
        wrong += count
        if count and version < newest:
            newer = newer or any(np.count_nonzero(got[bad] == expected(n, w)[bad]) > 0
                                 for w in range(version + 1, newest + 1))
    return wrong, newer


@dataclass
class Figures:
    syncs: int = 0
    committed: int = 0
    repeated: int = 0   # of those committed: skipped the gather (the coordinator's last sync repeated)
    folded: int = 0     # ... and their Prepare rode on the first wave (--fold-prepare)
    failed: int = 0
    faults: int = 0
    kills: int = 0
    stops: int = 0
    coordinator_faults: int = 0
    torn: int = 0
    mislabeled: int = 0
    unnamed: int = 0
    wedged: int = 0
    crashed: int = 0
    recovery_syncs: int = 0
    recovery_retries: int = 0
    dirty_seen: int = 0
    seconds: float = 0.0
    problems: List[str] = field(default_factory=list)


class Soak:
    def __init__(self, seed: int, lease_ms: int = 1000, log=print, verbose: bool = False,
                 relay_fanout: Optional[int] = None) -> None:
        self.rng = random.Random(seed)
        self.log = log
        self.verbose = verbose
        self.fig = Figures()
        self.version = 0
        self.clean_seconds = 0.05  # a clean sync's duration (moving average)
        # relay_fanout: the daemons' --relay-fanout (2: the 5 daemons' calls go through relays).
        relay = [] if relay_fanout is None else ["--relay-fanout", str(relay_fanout)]
        self.cluster = LocalCluster(NODES, extra=["--sync-lease-ms", str(lease_ms), "--peer-timeout-ms", "1000",
                                                  "--shutdown-grace-ms", "2000"] + relay)
        self.clients: Dict[str, shardcast.Client] = {}
        self.trainer: Dict[int, shardcast.Registration] = {}
        self.inference: Dict[int, shardcast.Registration] = {}

    # ---- setup ----

    def __enter__(self) -> "Soak":
        self.cluster.start()
        for node in NODES:
            self.clients[node] = shardcast.Client(self.cluster.target(node), timeout=10)
        tl, il = trainer_layout(), inference_layout()
        for r in range(TRAINER_WORLD):
            node = tl["nodes"][r]
            tensors = {n: trainer_piece(n, r, 0) for n in TENSORS}
            self.trainer[r] = self.clients[node].register("trainer", r, TRAINER_WORLD, tensors, tl, role="source")
        for r in range(DP * TP):
            node = il["nodes"][r]
            tensors = {n: np.zeros_like(inference_piece(n, r, 0)) for n in TENSORS}
            self.inference[r] = self.clients[node].register("infer", r, DP * TP, tensors, il)
        return self

    def __exit__(self, *exc) -> None:
        for node in NODES:
            d = self.cluster.daemons.get(node)
            if d is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
        for c in self.clients.values():
            c.close()
        self.cluster.stop()

    # ---- one step ----

    def step_trainer(self, version: int) -> None:
        """Acquire, write `version`, publish: what a trainer does every step."""
        for r, reg in self.trainer.items():
            reg.acquire(timeout=30)
            for n in TENSORS:
                reg.tensors[n][...] = trainer_piece(n, r, version)
            reg.publish(version)

    def wait_registered(self, timeout: float = 30) -> None:
        want = {("trainer", r) for r in range(TRAINER_WORLD)} | {("infer", r) for r in range(DP * TP)}
        wait_registered(self.clients, want, timeout)

    def inject(self, node: str, kind: str, delay: float, hold: float, done: threading.Event) -> None:
        time.sleep(delay)
        pid = self.cluster.daemons[node].proc.pid
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
            self.cluster.daemons[node].proc.wait()
        else:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(hold)
            os.kill(pid, signal.SIGCONT)

    def sync(self, fault: bool) -> Tuple[bool, str, Optional[str]]:
        """One trainer step and one sync, with a fault injected or not. Returns (committed, error,
        the daemon killed by the fault or None)."""
        self.version += 1
        v = self.version
        self.step_trainer(v)
        coordinator = self.rng.choice(NODES)
        target = None
        injector = None
        done = threading.Event()
        if fault:
            target = self.rng.choice(NODES)
            kind = self.rng.choice(["kill", "stop"])
            # A random moment of the sync: its clean duration so far tells how long it lasts.
            delay = self.rng.uniform(0.0, 1.2 * self.clean_seconds)
            hold = self.rng.uniform(0.3, 2.5)
            self.fig.faults += 1
            self.fig.kills += kind == "kill"
            self.fig.stops += kind == "stop"
            self.fig.coordinator_faults += target == coordinator
            if self.verbose:
                self.log(f"[chaos] v{v}: {kind} {target} after {delay * 1e3:.0f} ms"
                         f"{f' for {hold:.1f} s' if kind == 'stop' else ''} (coordinator {coordinator})")
            injector = threading.Thread(target=self.inject, args=(target, kind, delay, hold, done), daemon=True)
            injector.start()
        self.fig.syncs += 1
        ok, error = True, ""
        began = time.monotonic()
        try:
            out = self.clients[coordinator].sync("trainer", "infer", v, timeout=5, verify=self.rng.random() < 0.3)
            self.fig.repeated += out.repeated
            self.fig.folded += out.folded
        except shardcast.ShardcastError as e:
            ok, error = False, e.details
        if ok and not fault:
            self.clean_seconds = 0.8 * self.clean_seconds + 0.2 * (time.monotonic() - began)
        done.set()
        if injector is not None:
            injector.join()
        self.fig.committed += ok
        self.fig.failed += not ok
        killed = target if fault and kind == "kill" else None
        if not ok and 'node "' not in error and "node '" not in error:
            self.fig.unnamed += 1
            self.fig.problems.append(f"v{v}: failure names no node: {error}")
        return ok, error, killed

    # ---- checks ----

    def recover(self, killed: Optional[str]) -> None:
        self.fig.crashed += restart_dead(self.cluster, killed, self.version, self.fig.problems)
        self.wait_registered()

    def check(self) -> None:
        """Every inference rank that reports ready(V) holds exactly V's bytes."""
        for r, reg in self.inference.items():
            client = self.clients[reg.node]
            try:
                st = reg.state()
            except (RuntimeError, shardcast.ShardcastError) as e:
                self.fig.problems.append(f"v{self.version}: infer rank {r}: no state ({e})")
                continue
            if st.state == shardcast.client.service_pb2.RANK_DIRTY:
                self.fig.dirty_seen += 1
            if st.state != shardcast.client.service_pb2.RANK_READY:
                continue
            wrong, newer = wrong_elements({n: reg.tensors[n] for n in TENSORS},
                                          lambda n, v: inference_piece(n, r, v), st.version, self.version)
            if wrong:
                self.fig.torn += 1
                self.fig.mislabeled += newer
                self.fig.problems.append(f"v{self.version}: infer rank {r} on {client.target} reports ready({st.version}) "
                                         f"with {wrong} wrong elements{' (newer bytes)' if newer else ''}")

    def run(self, syncs: int, fault_every: int = 3) -> Figures:
        start = time.monotonic()
        for i in range(1, syncs + 1):
            fault = i % fault_every == 0
            ok, error, killed = self.sync(fault)
            self.recover(killed)
            self.check()
            if fault:
                # The next sync after recovery must commit (retries only for a daemon still
                # finishing its restart): otherwise something is wedged.
                for attempt in range(3):
                    self.fig.recovery_syncs += 1
                    rok, rerror, _ = self.sync(False)
                    self.recover(None)
                    self.check()
                    if rok:
                        break
                    self.fig.recovery_retries += 1
                    time.sleep(1.0)
                else:
                    self.fig.wedged += 1
                    self.fig.problems.append(f"v{self.version}: no sync commits after recovery: {rerror}")
            if i % 10 == 0 or not ok or self.verbose:
                self.log(f"[chaos] {i}/{syncs}: {'committed' if ok else 'failed: ' + error[:200]}"
                         f"{' (a fault)' if fault else ''}")
        self.fig.seconds = time.monotonic() - start
        return self.fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--syncs", type=int, default=300, help="syncs with a fault every third (recovery syncs come on top)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease-ms", type=int, default=1000)
    ap.add_argument("--relay-fanout", type=int, default=None,
                    help="the daemons' --relay-fanout (2: calls through relays; default: the daemons' own)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="a line per sync and fault")
    a = ap.parse_args()
    with Soak(a.seed, a.lease_ms, log=lambda s: print(s, file=sys.stderr, flush=True), verbose=a.verbose,
              relay_fanout=a.relay_fanout) as soak:
        fig = soak.run(a.syncs)
    if a.json:
        print(json.dumps(asdict(fig)))
    else:
        for k, v in asdict(fig).items():
            if k != "problems":
                print(f"{k:>20}: {v:.1f}" if isinstance(v, float) else f"{k:>20}: {v}")
        for p in fig.problems:
            print("problem:", p)
    bad = fig.torn + fig.mislabeled + fig.unnamed + fig.wedged + fig.crashed
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
