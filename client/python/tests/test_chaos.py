"""The chaos soak, CI-sized (bench/chaos.sh runs it for minutes): 5 real daemons, a SIGKILL or a
SIGSTOP of a random daemon (the coordinator included) at a random moment of every third sync, the
version contract checked against the bytes after every sync (see chaos.py); once with the
coordinator calling every daemon directly, once through relays."""

from __future__ import annotations

from dataclasses import asdict

import pytest

import chaos


@pytest.mark.slow
@pytest.mark.parametrize("relay_fanout", [None, 2], ids=["direct", "through-relays"])
def test_chaos_soak_no_torn_no_wedged_no_unnamed_failures(relay_fanout):
    # through-relays: --relay-fanout 2, so the coordinator's calls to the 5 daemons go through
    # relays, which are killed and frozen like any daemon.
    lines = []
    with chaos.Soak(seed=7, log=lines.append, relay_fanout=relay_fanout) as soak:
        fig = soak.run(syncs=24)
    print({k: v for k, v in asdict(fig).items() if k != "problems"})
    assert fig.faults == 8
    assert fig.syncs == 24 + fig.recovery_syncs
    assert fig.problems == [], "\n".join(fig.problems + lines)
    assert (fig.torn, fig.mislabeled, fig.unnamed, fig.wedged, fig.crashed) == (0, 0, 0, 0, 0)
    assert fig.committed >= 24 - fig.faults  # every sync without a fault committed
