"""The replica-set chaos soak, CI-sized (bench/chaos.sh --replicas runs it for minutes): a trainer
syncs every step into a replica set whose replicas join, leave, and are killed, frozen or (in
network namespaces, as root) partitioned at random moments of the syncs; every rank's bytes are
checked against its reported version after every sync (see replica_chaos.py); on loopback each sync
is dense or a delta sync at random (versions that change 1 element in 64)."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

import replica_chaos


def soak(netns: bool, seed: int, syncs: int, delta: str = "off") -> replica_chaos.Figures:
    # At least 4 replicas: with 3, a frozen middle replica of the relay chain can leave none able
    # to take part (both neighbours still exchanging its bytes), a failure the bench soak counts
    # (docs/reliability.md) and this test would only meet by chance.
    lines = []
    # A 3 s sync lease and a 2 s replica deadline (the bench's soak: 1 s each): CI runs this beside
    # the vLLM tests and the fuzzers on 2 cores, where a healthy daemon went unanswered by the
    # lease keeper once for a whole 1 s lease and once for a 1 s replica deadline (cut as if
    # frozen). Frozen and partitioned replicas are held 1.5 to 2.5 deadlines, so still cut.
    with replica_chaos.ReplicaSoak(seed, netns=netns, min_live=4, deadline=2.0, lease_ms=3000, delta=delta,
                                   log=lines.append) as s:
        fig = s.run(syncs)
    print({k: v for k, v in asdict(fig).items() if k != "problems"})
    # Figures that depend on the machine's speed (late) are the bench's; the rest must hold.
    problems = [p for p in fig.problems if "frozen took" not in p]
    assert problems == [], "\n".join(problems + lines)
    assert (fig.torn, fig.mislabeled, fig.healthy_cut, fig.failed, fig.wedged, fig.crashed) == (0, 0, 0, 0, 0, 0)
    assert fig.committed == fig.syncs == syncs
    return fig


@pytest.mark.slow
def test_replicas_join_leave_die_and_freeze_while_the_trainer_syncs_every_step():
    # Each sync dense (zero copy) or a delta sync at random: both paths under the same faults.
    fig = soak(netns=False, seed=11, syncs=30, delta="mixed")
    assert fig.joins > 0 and fig.leaves > 0 and fig.kills > 0 and fig.freezes > 0, fig
    assert fig.replica_commits > 0 and fig.replicas_cut > 0
    assert fig.delta_syncs > 0 and fig.delta_chunks > 0 and fig.dense_chunks > 0, fig


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_replicas_partitioned_from_the_network_are_cut_and_repaired():
    fig = soak(netns=True, seed=12, syncs=20)
    assert fig.partitions > 0, fig

