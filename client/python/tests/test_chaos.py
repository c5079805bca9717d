"""The chaos soak, CI-sized (bench/chaos.sh runs it for minutes): 5 real daemons, a SIGKILL or a
SIGSTOP of a random daemon (the coordinator included) at a random moment of every third sync, the
version contract checked against the bytes after every sync (see chaos.py)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

import chaos


@pytest.mark.slow
def test_chaos_soak_no_torn_no_wedged_no_unnamed_failures():
    lines = []
    with chaos.Soak(seed=7, log=lines.append) as soak:
        fig = soak.run(syncs=24)
    print({k: v for k, v in asdict(fig).items() if k != "problems"})
    assert fig.faults == 8
    assert fig.syncs == 24 + fig.recovery_syncs
    assert fig.problems == [], "\n".join(fig.problems + lines)
    assert (fig.torn, fig.mislabeled, fig.unnamed, fig.wedged, fig.crashed) == (0, 0, 0, 0, 0)
    assert fig.committed >= 24 - fig.faults  # every sync without a fault committed
