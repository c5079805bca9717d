#!/usr/bin/env python3
"""What a sync costs per tensor (docs/performance.md, "Syncs at a MoE's tensor count"): about the
same bytes (rows are rounded to a multiple of 4: 586-600 MiB by default) cut into more and more
tensors, as a MoE's checkpoint is (Qwen3-30B-A3B: 18 432 expert tensors; a 1T MoE:
tens of thousands more). A trainer group of 2 ranks (each tensor sharded on rows) syncs into an
inference group of 2 ranks (sharded on columns: every tensor is cut again), on one node (the two
groups on one daemon, as a colocated vLLM) or two (one daemon each, UCX over loopback TCP). Each
rank's tensors are views of one storage, as a trainer's fused experts or flat buffers are.

Per tensor count it prints the registration (the Python client's, for all four ranks), then each
sync's time and its phases as the coordinating daemon reports them; the first sync gathers and
plans, the later ones reuse the plan. Last, what each tensor adds to a steady sync: the
difference to the fewest tensors' time, per tensor. Every destination byte is checked after every
sync.

    .venv/bin/python bench/tensor_count.py [--counts 200,2000,20000] [--mib 600] [--syncs 4] [--nodes 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))

import torch  # noqa: E402

import shardcast  # noqa: E402
from shardcast.local import LocalCluster  # noqa: E402

COLS = 128  # float32 columns per tensor; rows follow from the bytes and the count


def views(names, shape, values: torch.Tensor) -> dict:
    """`values` (one storage) cut into one tensor of `shape` per name."""
    size = shape[0] * shape[1]
    return {n: values[i * size:(i + 1) * size].view(*shape) for i, n in enumerate(names)}


def run(count: int, args, cluster: LocalCluster) -> float:
    """Registers and syncs `count` tensors; returns the median steady-state sync (seconds)."""
    rows = max(4, args.mib * 2**20 // 4 // COLS // count // 4 * 4)
    names = [f"model.layers.{i // 256}.mlp.experts.{i % 256}.w" for i in range(count)]
    nodes = {"trainer": "n0", "vllm": "n0" if args.nodes == 1 else "n1"}
    group = lambda g, dim: {"group": g, "mesh": {"shape": [2]}, "nodes": [nodes[g]] * 2,
                            "tensors": [{"name": n, "shape": [rows, COLS], "dtype": "float32",
                                         "placements": [{"shard": {"dim": dim}}]} for n in names]}
    weights = torch.randn(count * rows * COLS)
    whole = weights.view(count, rows, COLS)
    clients = {g: shardcast.Client(cluster.target(nodes[g])) for g in nodes}
    trainer_l, vllm_l = group("trainer", 0), group("vllm", 1)
    started = time.monotonic()
    half = rows // 2
    src = [clients["trainer"].register("trainer", r, 2,
                                       views(names, (half, COLS), whole[:, r * half:(r + 1) * half].clone().view(-1)),
                                       trainer_l, role="source", version=1) for r in range(2)]
    dst = [clients["vllm"].register("vllm", r, 2,
                                    views(names, (rows, COLS // 2), torch.zeros(count * rows * COLS // 2)), vllm_l)
           for r in range(2)]
    registered = time.monotonic() - started
    mib = count * rows * COLS * 4 / 2**20
    print(f"== {count} tensors of {rows} x {COLS} float32 ({mib:.0f} MiB), {args.nodes} node(s): "
          f"registration {registered:.2f} s (4 ranks)", flush=True)
    steady = []
    for version in range(1, args.syncs + 1):
        if version > 1:
            for r, s in enumerate(src):
                clients["trainer"].acquire("trainer", r)
                for t in s.tensors.values():
                    t.add_(1.0)
                clients["trainer"].publish("trainer", r, version)
            whole += 1.0
        t0 = time.monotonic()
        res = clients["trainer"].sync("trainer", "vllm", version)
        seconds = time.monotonic() - t0
        for r, d in enumerate(dst):
            got = torch.stack([d.tensors[n] for n in names])
            if not torch.equal(got, whole[:, :, r * COLS // 2:(r + 1) * COLS // 2]):
                raise SystemExit(f"{count} tensors, version {version}: rank {r} of the inference group holds "
                                 "other bytes")
        if version > 1:
            steady.append(seconds)
        print(f"  sync v{version}: {seconds:.3f} s ({mib / 1024 / seconds:.2f} GiB/s): "
              f"gather {res.gather_seconds:.3f}, plan {res.plan_seconds:.3f}, prepare {res.prepare_seconds:.3f}, "
              f"execute {res.execute_seconds:.3f}, "
              f"finish {res.finish_seconds:.3f}{' (plan cached)' if res.plan_cached else ''}; verified", flush=True)
    median = statistics.median(steady) if steady else seconds
    print(f"  steady state (syncs 2..{args.syncs}): median {median:.3f} s", flush=True)
    for regs in (dst, src):
        for reg in regs:
            reg.close()
    for c in clients.values():
        c.close()
    return median


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="200,2000,20000", help="tensor counts, comma-separated")
    p.add_argument("--mib", type=int, default=600, help="the model's bytes, the same at every count")
    p.add_argument("--syncs", type=int, default=4)
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="1: both groups on one daemon; 2: a daemon each, UCX over loopback TCP")
    args = p.parse_args()
    with LocalCluster(["n0", "n1"][:args.nodes]) as cluster:
        medians = {count: run(count, args, cluster) for count in (int(c) for c in args.counts.split(","))}
    # What each tensor adds: the same bytes, so the difference to the fewest tensors' time.
    fewest = min(medians)
    for count, median in medians.items():
        if count != fewest:
            more = (median - medians[fewest]) / (count - fewest) * 1e6
            print(f"== {count} tensors: steady sync {median:.3f} s, {more:.1f} us per tensor more than at {fewest}")


if __name__ == "__main__":
    main()
