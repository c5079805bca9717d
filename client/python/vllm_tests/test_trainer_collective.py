"""The trainer engine's exchanges between trainer ranks are all ranks or none: a step that raises on
one rank raises on every rank, naming it (a rank that raised alone would leave the others waiting in
the next collective for good), and a step that works everywhere gathers every rank's result."""

from __future__ import annotations

import torch.multiprocessing as mp


def _rank(rank: int, port: int, results) -> None:
    from shardcast.local import join_process_group
    from shardcast.vllm.trainer import _Collective

    join_process_group(port, rank, 2)
    collective = _Collective()
    out = {"gathered": collective.gather("saying hello", lambda: f"hello from {rank}")}

    def fails_on_rank_1():
        if rank == 1:
            raise ValueError("its daemon refused the registration")
        return rank

    try:
        collective.gather("registering", fails_on_rank_1)
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    # Still in step: the next exchange works on both ranks.
    out["after"] = collective.gather("going on", lambda: rank)
    results.put((rank, out))


def test_a_step_failing_on_one_rank_raises_on_every_rank():
    from shardcast.local import TorchRendezvous

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = TorchRendezvous()
    procs = [ctx.Process(target=_rank, args=(r, rendezvous.port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):
        assert got[rank]["gathered"] == ["hello from 0", "hello from 1"]
        assert got[rank]["error"] == ("shardcast: registering failed on trainer rank(s) 1: ValueError: its daemon "
                                      "refused the registration")
        assert got[rank]["after"] == [0, 1]
