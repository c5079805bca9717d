"""Replica-set chaos soak (docs/reliability.md): a trainer on node t0 syncs every step into replica
set "rollout" while its data-parallel replicas (each a group `rollout.r<id>` of TP=2 ranks on a
node of its own, i0..i5) join, leave and fail:

- between syncs a replica joins (registers on a free node; half the time its catch-up from peers
  races the next sync) or leaves (its ranks unregister);
- during a sync, at a random moment, one replica's daemon is killed (SIGKILL; restarted after the
  sync, its client registers the ranks again and catches up), frozen (SIGSTOP past the sync's
  replica deadline, then SIGCONT) or, with --netns, partitioned (its switch port down, then up).

After every sync it checks:
- torn / mislabeled: every rank of every replica that reports ready(V) holds exactly V's bytes
  (mislabeled: some of them are a newer version's);
- healthy cut: every replica registered when the sync started, not hit by its fault and not in a
  racing catch-up (as seed or as the one caught up), committed (one hit by an earlier sync's fault
  may stay cut for RECOVERY_S while its daemon fails the writes cancelled under it: counted as
  recovering_cut, and the longest a replica took to commit again after a fault is recovery_max_s;
  one still exchanging the first attempt's bytes with the replica this sync froze or cut off, when
  the sync runs again without it, is held until that transfer fails or completes: downstream_cut,
  and held_cut when that hold outlasts the sync, within RECOVERY_S of the fault);
- failed: the sync failed as a whole (the trainer is never hit: it must not);
- wedged: after recovery, a sync that still fails 3 times;
- late: a sync with a frozen replica that took longer than its replica deadline plus a clean
  sync's time (a moving average) plus 0.5 s;
- crashed: a daemon that died without being killed.

With --delta auto every sync is a delta sync, with --delta mixed each sync is dense (zero copy)
or a delta sync at random, and a version changes 1 element in 64 (the rest keep the bytes of an
earlier version): counted are the syncs that sent some chunk as a delta (delta_syncs) and the
chunks sent each way, with every byte still checked as above.

    python replica_chaos.py --syncs 300 [--netns] [--delta auto]   # bench/chaos.sh --replicas runs this
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
from typing import Dict, List, Optional

import numpy as np

import shardcast
import chaos
from chaos import TENSORS, restart_dead, wait_registered, wrong_elements
from shardcast.local import LocalCluster, Namespaces

TRAINER = "t0"
SLOTS = [f"i{k}" for k in range(6)]  # a node per replica
NODES = [TRAINER] + SLOTS
TRAINER_WORLD = 2
TP = 2
MIN_LIVE, MAX_LIVE = 3, 5
RECOVERY_S = 15.0  # how long a replica hit by a fault may stay cut after it (then it counts as healthy)  # replicas kept registered (at least one is left healthy whatever is hit)


def trainer_layout() -> dict:
    return {"group": "trainer", "mesh": {"shape": [TRAINER_WORLD]}, "nodes": [TRAINER] * TRAINER_WORLD,
            "tensors": [{"name": n, "shape": list(shape), "dtype": "int32", "placements": [{"shard": {"dim": d}}]}
                        for n, (shape, d, _) in TENSORS.items()]}


def replica_layout(replica: int, node: str) -> dict:
    tensors = []
    for n, (shape, _, tp_dim) in TENSORS.items():
        tp = {"replicate": {}} if tp_dim is None else {"shard": {"dim": tp_dim}}
        tensors.append({"name": n, "shape": list(shape), "dtype": "int32", "placements": [tp]})
    return {"group": f"rollout.r{replica}", "replica_set": "rollout", "replica": replica, "mesh": {"shape": [TP]},
            "nodes": [node] * TP, "tensors": tensors}


SPARSE_PERIOD = 64  # with deltas: version V changes the elements i with i = V (mod 64)


def sparse_full(name: str, version: int) -> np.ndarray:
    """Version `version` of a tensor of which each version changes 1 element in 64: element i holds
    chaos.full's value of the last version u <= `version` with u = i (mod 64), or of version 0."""
    shape = TENSORS[name][0]
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    last = version - (version - i) % SPARSE_PERIOD
    last = np.where(last < 1, 0, last)
    return ((i * 7 + last * 1_000_003) % (2 ** 31 - 1)).astype(np.int32).reshape(shape)


def piece(name: str, version: int, dim: Optional[int], index: int, parts: int, sparse: bool) -> np.ndarray:
    if not sparse:
        return chaos.piece(name, version, dim, index, parts)
    a = sparse_full(name, version)
    return a if dim is None else np.array_split(a, parts, axis=dim)[index].copy()


def replica_piece(name: str, rank: int, version: int, sparse: bool = False) -> np.ndarray:
    return piece(name, version, TENSORS[name][2], rank, TP, sparse)


@dataclass
class Figures:
    syncs: int = 0
    committed: int = 0
    failed: int = 0
    events: int = 0  # membership events: joins + leaves + kills + freezes + partitions + rejoins
    joins: int = 0
    leaves: int = 0
    leaves_waited: int = 0  # closes refused while a sync still used the rank (then tried again)
    kills: int = 0
    freezes: int = 0
    partitions: int = 0
    rejoins: int = 0
    catch_ups: int = 0
    catch_ups_raced: int = 0
    catch_ups_failed: int = 0
    delta_syncs: int = 0  # with --delta auto: syncs that sent some chunk as a delta
    delta_chunks: int = 0
    dense_chunks: int = 0
    replica_commits: int = 0
    replicas_cut: int = 0
    healthy_cut: int = 0
    downstream_cut: int = 0  # held by a transfer with the replica this sync froze or partitioned
    held_cut: int = 0  # the same, for a fault of an earlier sync (within RECOVERY_S)
    recovering_cut: int = 0  # cut while still recovering from the fault of an earlier sync
    recovery_max_s: float = 0.0  # the longest from a fault's end to the replica's next commit
    torn: int = 0
    mislabeled: int = 0
    wedged: int = 0
    crashed: int = 0
    late: int = 0
    frozen_syncs: int = 0  # syncs whose frozen replica was cut (a freeze that missed the sync: not counted)
    frozen_max_over_deadline_s: float = 0.0  # the slowest frozen sync minus its replica deadline
    frozen_median_over_deadline_s: float = 0.0
    clean_sync_s: float = 0.0
    seconds: float = 0.0
    problems: List[str] = field(default_factory=list)


@dataclass
class Replica:
    id: int
    node: str
    regs: List[shardcast.Registration]

    @property
    def group(self) -> str:
        return f"rollout.r{self.id}"


class ReplicaSoak:
    def __init__(self, seed: int, *, netns: bool = False, deadline: float = 1.0, lease_ms: int = 1000,
                 min_live: int = MIN_LIVE, delta: str = "off", log=print, verbose: bool = False) -> None:
        self.min_live = min_live
        self.delta = delta
        self.sparse = delta != "off"  # versions that change a few elements: deltas worth sending
        self.delta_rng = random.Random(seed + 1)  # "mixed": apart, so the faults are the seed's as ever
        self.rng = random.Random(seed)
        self.log = log
        self.verbose = verbose
        self.netns = netns
        self.deadline = deadline
        self.fig = Figures()
        self.version = 0
        self.clean_seconds = 0.1  # a clean sync's duration (moving average)
        self.next_id = 0
        self.network = Namespaces(NODES) if netns else None
        self.cluster = LocalCluster(NODES, netns=netns,
                                    extra=["--sync-lease-ms", str(lease_ms), "--peer-timeout-ms", "1000",
                                           "--shutdown-grace-ms", "2000"])
        self.clients: Dict[str, shardcast.Client] = {}
        self.trainer: List[shardcast.Registration] = []
        self.replicas: Dict[str, Replica] = {}  # node -> the replica on it
        self.last_fault = -1e9  # when the last fault ended
        self.frozen_over: List[float] = []  # each frozen sync's seconds past its replica deadline
        self.recovering: Dict[str, float] = {}  # replica group -> when the fault that hit it ended

    # ---- setup ----

    def __enter__(self) -> "ReplicaSoak":
        if self.network:
            self.network.__enter__()
        try:
            self.cluster.start()
            for node in NODES:
                self.clients[node] = shardcast.Client(self.cluster.target(node), timeout=10)
            tl = trainer_layout()
            self.trainer = [self.clients[TRAINER].register(
                "trainer", r, TRAINER_WORLD,
                {n: piece(n, 0, TENSORS[n][1], r, TRAINER_WORLD, self.sparse) for n in TENSORS}, tl,
                role="source") for r in range(TRAINER_WORLD)]
            for node in SLOTS[:self.min_live + 1]:
                self.join(node, count=False)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for d in self.cluster.daemons.values():
            if d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
        if self.network:
            for node in SLOTS:
                self.network.heal(node)
        for c in self.clients.values():
            c.close()
        self.cluster.stop()
        if self.network:
            self.network.__exit__()

    # ---- membership ----

    def join(self, node: str, count: bool = True) -> Replica:
        rid = self.next_id
        self.next_id += 1
        layout = replica_layout(rid, node)
        regs = [self.clients[node].register(layout["group"], r, TP,
                                            {n: np.zeros_like(replica_piece(n, r, 0)) for n in TENSORS}, layout)
                for r in range(TP)]
        self.replicas[node] = Replica(rid, node, regs)
        if self.verbose:
            self.log(f"[replicas] v{self.version}: rollout.r{rid} joins on {node}")
        if count:
            self.fig.joins += 1
            self.fig.events += 1
        return self.replicas[node]

    def leave(self, node: str) -> None:
        self.recovering.pop(self.replicas[node].group, None)
        if self.verbose:
            self.log(f"[replicas] v{self.version}: {self.replicas[node].group} leaves {node}")
        for reg in self.replicas.pop(node).regs:
            # Refused while a sync still uses the rank (writes of one that ended still landing):
            # it stays registered, and closing again later works.
            deadline = time.monotonic() + 30
            while True:
                try:
                    reg.close()
                    break
                except shardcast.ShardcastError as e:
                    if "in use by sync" not in e.details or time.monotonic() > deadline:
                        raise
                    self.fig.leaves_waited += 1
                    time.sleep(0.2)
        self.fig.leaves += 1
        self.fig.events += 1

    def catch_up(self, replica: Replica, out: list) -> None:
        """A catch-up of `replica` from its peers (the trainer the fallback): its outcome in `out`."""
        try:
            out.append(self.clients[replica.node].catch_up(replica.group, "trainer", timeout=20))
        except shardcast.ShardcastError as e:
            out.append(e)

    # ---- one step ----

    def step_trainer(self, version: int) -> None:
        for r, reg in enumerate(self.trainer):
            reg.acquire(timeout=30)
            for n in TENSORS:
                reg.tensors[n][...] = piece(n, version, TENSORS[n][1], r, TRAINER_WORLD, self.sparse)
            reg.publish(version)

    def delta_of_sync(self) -> str:
        return self.delta_rng.choice(["off", "auto"]) if self.delta == "mixed" else self.delta

    def inject(self, node: str, kind: str, delay: float, hold: float) -> None:
        time.sleep(delay)
        proc = self.cluster.daemons[node].proc
        if kind == "kill":
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        elif kind == "freeze":
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(hold)
            os.kill(proc.pid, signal.SIGCONT)
        else:
            self.network.partition(node)
            time.sleep(hold)
            self.network.heal(node)

    def membership_between_syncs(self) -> Optional[Replica]:
        """A join or a leave, or nothing. Returns a replica that joined."""
        roll = self.rng.random()
        free = [n for n in SLOTS if n not in self.replicas]
        if roll < 0.2 and free and len(self.replicas) < MAX_LIVE:
            return self.join(self.rng.choice(free))
        if roll < 0.35 and len(self.replicas) > self.min_live:
            self.leave(self.rng.choice(sorted(self.replicas)))
        return None

    def sync(self, faults: bool) -> bool:
        self.version += 1
        v = self.version
        self.step_trainer(v)
        joined = self.membership_between_syncs() if faults else None
        members = dict(self.replicas)
        racing: List[object] = []
        racer = None
        if joined is not None and self.rng.random() < 0.5:
            self.fig.catch_ups_raced += 1
            racer = threading.Thread(target=self.catch_up, args=(joined, racing), daemon=True)
        target, kind = None, ""
        injector = None
        if faults and self.rng.random() < 0.45:
            target = self.rng.choice(sorted(n for n in members if members[n] is not joined))
            kind = self.rng.choice(["kill", "freeze", "partition"] if self.netns else ["kill", "freeze"])
            delay = self.rng.uniform(0.0, 1.2 * self.clean_seconds)
            hold = self.rng.uniform(1.5 * self.deadline, 2.5 * self.deadline)
            self.fig.events += 1
            self.fig.kills += kind == "kill"
            self.fig.freezes += kind == "freeze"
            self.fig.partitions += kind == "partition"
            if self.verbose:
                self.log(f"[replicas] v{v}: {kind} {target} ({members[target].group}) after {delay * 1e3:.0f} ms")
            injector = threading.Thread(target=self.inject, args=(target, kind, delay, hold), daemon=True)
        if racer:
            racer.start()
        if injector:
            injector.start()
        self.fig.syncs += 1
        began = time.monotonic()
        resp, error = None, ""
        try:
            resp = self.clients[TRAINER].sync("trainer", "rollout", v, timeout=30, replica_deadline_s=self.deadline,
                                              verify=self.rng.random() < 0.2, delta=self.delta_of_sync())
        except shardcast.ShardcastError as e:
            error = e.details
        took = time.monotonic() - began
        if injector:
            injector.join()
            self.recovering[members[target].group] = self.last_fault = time.monotonic()
        if racer:
            racer.join()
        if resp is None:
            self.fig.failed += 1
            self.fig.problems.append(f"v{v}: the sync failed as a whole: {error}")
        else:
            self.fig.committed += 1
            self.fig.delta_syncs += resp.delta_chunks > 0
            self.fig.delta_chunks += resp.delta_chunks
            self.fig.dense_chunks += resp.dense_chunks
            self.judge(v, resp, members, target, kind, joined, racing)
            if target is None and racer is None:
                self.clean_seconds = 0.8 * self.clean_seconds + 0.2 * took
        # A freeze that hit the sync (its replica cut): the sync's time against its deadline.
        if kind == "freeze" and resp is not None and any(o.group == members[target].group and not o.committed
                                                         for o in resp.replicas):
            self.fig.frozen_syncs += 1
            self.fig.frozen_max_over_deadline_s = max(self.fig.frozen_max_over_deadline_s, took - self.deadline)
            self.frozen_over.append(took - self.deadline)
            if took > self.deadline + self.clean_seconds + 0.5:
                self.fig.late += 1
                self.fig.problems.append(f"v{v}: a sync with {target} frozen took {took:.2f} s (deadline "
                                         f"{self.deadline:.1f} s, a clean sync {self.clean_seconds:.2f} s)")
        if racing and isinstance(racing[0], shardcast.ShardcastError):
            self.fig.catch_ups_failed += 1
        self.recover(target if kind == "kill" else None)
        self.check()
        if self.verbose or resp is None:
            self.log(f"[replicas] v{v}: {'committed' if resp is not None else 'failed: ' + error[:300]} in {took:.2f} s"
                     + (f"; cut {[(o.group, o.cut[:120]) for o in resp.replicas if not o.committed]}" if resp else ""))
        return resp is not None

    def judge(self, v: int, resp, members: Dict[str, Replica], target: Optional[str], kind: str,
              joined: Optional[Replica], racing: list) -> None:
        """Every healthy member committed: not hit, not the one caught up, not a racing catch-up's seed."""
        outcomes = {o.group: o for o in resp.replicas}
        seed = racing[0].seeded_from if racing and not isinstance(racing[0], shardcast.ShardcastError) else ""
        now = time.monotonic()
        for node, replica in members.items():
            o = outcomes.get(replica.group)
            hit_before = self.recovering.get(replica.group) if node != target else None
            if o is not None and o.committed:
                self.fig.replica_commits += 1
                if hit_before is not None:
                    self.fig.recovery_max_s = max(self.fig.recovery_max_s, now - hit_before)
                    del self.recovering[replica.group]
                continue
            self.fig.replicas_cut += 1
            cut = o.cut if o else ""
            excused = node == target or (racing and replica is joined) or (racing and (
                "a catch-up is reading it" in cut or "(a catch-up seeded from it)" in cut or replica.group == seed))
            if not excused and hit_before is not None and now - hit_before < RECOVERY_S:
                # Frozen or cut off mid-write by an earlier sync: held until the writes cancelled
                # under it have failed on its side (docs/reliability.md, "Replica sets under chaos").
                self.fig.recovering_cut += 1
                excused = True
            why = o.cut if o else ""
            busy = "another sync is writing it" in why or "still landing" in why or "is in progress on node" in why
            if not excused and busy and kind in ("freeze", "partition"):
                # Still exchanging the first attempt's bytes with the replica that froze or was cut
                # off (its relay chain ran through it) when the sync ran again without that one.
                self.fig.downstream_cut += 1
                excused = True
            elif not excused and busy and now - self.last_fault < RECOVERY_S:
                # The same, past the sync of that fault: held until the transfer fails or completes.
                self.fig.held_cut += 1
                excused = True
            if not excused:
                self.fig.healthy_cut += 1
                self.fig.problems.append(f"v{v}: healthy replica {replica.group} on {node} did not commit: "
                                         f"{o.cut if o else 'not in the response'}")

    # ---- recovery and checks ----

    def recover(self, killed: Optional[str]) -> None:
        self.fig.crashed += restart_dead(self.cluster, killed, self.version, self.fig.problems)
        self.wait_registered()
        if killed is not None and killed in self.replicas:
            # Its client registered the ranks again (not ready: their daemon lost what they held);
            # half the time it catches up at once, else the next sync repairs it.
            self.fig.rejoins += 1
            self.fig.events += 1
            if self.rng.random() < 0.5:
                out: list = []
                self.catch_up(self.replicas[killed], out)
                self.fig.catch_ups += 1
                if isinstance(out[0], shardcast.ShardcastError):
                    self.fig.catch_ups_failed += 1
                    self.fig.problems.append(f"v{self.version}: catch-up of {self.replicas[killed].group} failed "
                                             f"with nothing racing it: {out[0].details}")

    def wait_registered(self, timeout: float = 30) -> None:
        want = {("trainer", r) for r in range(TRAINER_WORLD)} | {
            (rep.group, r) for rep in self.replicas.values() for r in range(TP)}
        wait_registered(self.clients, want, timeout)

    def check(self) -> None:
        """Every rank that reports ready(V) holds exactly V's bytes."""
        ready = shardcast.client.service_pb2.RANK_READY
        for replica in self.replicas.values():
            for reg in replica.regs:
                try:
                    st = reg.state()
                except (RuntimeError, shardcast.ShardcastError) as e:
                    self.fig.problems.append(f"v{self.version}: {replica.group} rank {reg.rank}: no state ({e})")
                    continue
                if st.state != ready:
                    continue
                wrong, newer = wrong_elements({n: reg.tensors[n] for n in TENSORS},
                                              lambda n, v: replica_piece(n, reg.rank, v, self.sparse), st.version,
                                              self.version)
                if wrong:
                    self.fig.torn += 1
                    self.fig.mislabeled += newer
                    self.fig.problems.append(f"v{self.version}: {replica.group} rank {reg.rank} on {replica.node} reports "
                                             f"ready({st.version}) with {wrong} wrong elements"
                                             f"{' (newer bytes)' if newer else ''}")

    def run(self, syncs: int) -> Figures:
        start = time.monotonic()
        for i in range(1, syncs + 1):
            if not self.sync(faults=True):
                for _ in range(3):  # after recovery, a sync without faults must commit
                    if self.sync(faults=False):
                        break
                    time.sleep(1.0)
                else:
                    self.fig.wedged += 1
                    self.fig.problems.append(f"v{self.version}: no sync commits after recovery")
            if i % 10 == 0 and not self.verbose:
                self.log(f"[replicas] {i}/{syncs}: {self.fig.events} membership events, {self.fig.replicas_cut} "
                         f"replicas cut, {len(self.fig.problems)} problems")
        self.fig.seconds = time.monotonic() - start
        if self.frozen_over:
            self.fig.frozen_median_over_deadline_s = sorted(self.frozen_over)[len(self.frozen_over) // 2]
        self.fig.clean_sync_s = self.clean_seconds
        return self.fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--syncs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--netns", action="store_true", help="daemons in network namespaces; partitions too (root)")
    ap.add_argument("--deadline-s", type=float, default=1.0, help="the syncs' replica deadline")
    ap.add_argument("--delta", choices=["off", "auto", "dense", "mixed"], default="off",
                    help="the syncs' delta mode (mixed: off or auto at random)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="a line per sync and fault")
    a = ap.parse_args()
    with ReplicaSoak(a.seed, netns=a.netns, deadline=a.deadline_s, delta=a.delta, verbose=a.verbose,
                     log=lambda s: print(s, file=sys.stderr, flush=True)) as soak:
        fig = soak.run(a.syncs)
    if a.json:
        print(json.dumps(asdict(fig)))
    else:
        for k, v in asdict(fig).items():
            if k != "problems":
                print(f"{k:>27}: {v:.2f}" if isinstance(v, float) else f"{k:>27}: {v}")
        for p in fig.problems:
            print("problem:", p)
    return 0 if not fig.problems else 1


if __name__ == "__main__":
    sys.exit(main())
