#!/usr/bin/env python3
"""Delta syncs under real optimizer steps: a small transformer trained with AdamW at RL-like
learning rates, fp32 master weights on the trainer node, synced after every step into two bf16
inference groups on the inference node (tensor parallel over 2 ranks): one dense (delta off), one
with deltas (delta auto), from the same version, in the same run. Per step it prints the fraction
of bf16 elements that changed, the bytes each sync put on the wire, the two sync times and their
ratio; every destination byte is checked against the trainer's weights rounded to bf16.

    .venv/bin/python bench/delta_bench.py [--lrs 1e-6,3e-6,1e-5] [--steps 5] [--d-model 512]
        [--layers 6] [--netns]      (--netns: inside bench/cluster.sh --scenario delta's namespaces)
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


def model_of(args) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model, dropout=0.0,
                                             batch_first=True)
    return torch.nn.ModuleDict({"embed": torch.nn.Embedding(args.vocab, args.d_model),
                                "body": torch.nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False),
                                "head": torch.nn.Linear(args.d_model, args.vocab)})


def layouts(params, trainer: str, inference: str, group: str):
    tensors_src, tensors_dst = [], []
    for name, p in params.items():
        shard = p.dim() >= 1 and p.shape[0] % 2 == 0 and p.dim() == 2
        tensors_src.append({"name": name, "shape": list(p.shape), "dtype": "float32",
                            "placements": [{"replicate": {}}]})
        tensors_dst.append({"name": name, "shape": list(p.shape), "dtype": "bfloat16",
                            "placements": [{"shard": {"dim": 0}} if shard else {"replicate": {}}]})
    src = {"group": f"trainer-{group}", "mesh": {"shape": [1]}, "nodes": [trainer], "tensors": tensors_src}
    dst = lambda kind: {"group": f"{kind}-{group}", "mesh": {"shape": [2]}, "nodes": [inference, inference],
                        "tensors": tensors_dst}
    return src, dst("dense"), dst("delta")


def local_shard(p: torch.Tensor, rank: int, shard: bool) -> torch.Tensor:
    return p.chunk(2, dim=0)[rank] if shard else p


def run_lr(lr: float, args, c_train: shardcast.Client, c_inf: shardcast.Client, trainer: str, inference: str):
    model = model_of(args)
    params = {n.replace(".", "_"): p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    tag = f"{lr:g}".replace("-", "m").replace(".", "p")
    src_l, dense_l, delta_l = layouts(params, trainer, inference, tag)
    src = c_train.register(src_l["group"], 0, 1, {n: p.data for n, p in params.items()}, src_l, role="source",
                           version=1)
    shard = {n: t["placements"][0].get("shard") is not None for n, t in zip(params, dense_l["tensors"])}
    dests = {}
    for kind, lay in (("dense", dense_l), ("delta", delta_l)):
        dests[kind] = [c_inf.register(lay["group"], r, 2, {
            n: torch.zeros_like(local_shard(p.data, r, shard[n]), dtype=torch.bfloat16) for n, p in params.items()},
            lay) for r in range(2)]
    g = torch.Generator().manual_seed(1)
    rows = []
    before = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    for version in range(1, args.steps + 2):
        if version > 1:  # one optimizer step, the trainer's ranks acquired meanwhile
            with src.writing(version):
                tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
                logits = model["head"](model["body"](model["embed"](tokens)))
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, args.vocab),
                                                         tokens[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
        now = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
        changed = sum(int((now[n].view(torch.int16) != before[n].view(torch.int16)).sum()) for n in now)
        total = sum(t.numel() for t in now.values())
        before = now
        dense = c_train.sync(src_l["group"], dense_l["group"], version)
        delta = c_train.sync(src_l["group"], delta_l["group"], version, delta="auto")
        for kind in ("dense", "delta"):
            for r, reg in enumerate(dests[kind]):
                for n in params:
                    want = local_shard(now[n], r, shard[n]).contiguous()
                    if not torch.equal(reg.tensors[n].view(torch.int16), want.view(torch.int16)):
                        raise SystemExit(f"lr {lr:g} version {version}: {kind} rank {r} tensor {n} differs")
        rows.append({"lr": lr, "version": version, "changed": changed / total if version > 1 else 1.0,
                     "dense_bytes": dense.network_bytes, "wire_bytes": delta.wire_bytes,
                     "dense_s": dense.seconds, "delta_s": delta.seconds, "delta_chunks": delta.delta_chunks,
                     "dense_chunks": delta.dense_chunks})
        r = rows[-1]
        print(f"lr {lr:g} v{version}: {100 * r['changed']:5.2f}% of bf16 elements changed, "
              f"wire {r['wire_bytes'] / 1e6:7.2f} MB of {r['dense_bytes'] / 1e6:.2f} "
              f"({100 * r['wire_bytes'] / r['dense_bytes']:5.1f}%), delta {r['delta_s'] * 1e3:7.1f} ms, "
              f"dense {r['dense_s'] * 1e3:7.1f} ms ({r['dense_s'] / r['delta_s']:.1f}x), "
              f"chunks {r['delta_chunks']} delta / {r['dense_chunks']} dense", flush=True)
    for kind in dests:
        for reg in dests[kind]:
            reg.close()
    src.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--netns", action="store_true", help="daemons in bench/cluster.sh's namespaces")
    ap.add_argument("--daemon-arg", action="append", default=[], help="passed to every shardcastd")
    args = ap.parse_args()
    torch.set_num_threads(2)
    trainer, inference = "trainer-0", "inference-0"
    t0 = time.time()
    with LocalCluster([trainer, inference], netns=args.netns, extra=args.daemon_arg) as cluster, \
            shardcast.Client(cluster.target(trainer)) as c_train, \
            shardcast.Client(cluster.target(inference)) as c_inf:
        print(f"daemons {'in network namespaces' if args.netns else 'on loopback'}; "
              f"model d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}", flush=True)
        rows = [r for lr in args.lrs.split(",") for r in run_lr(float(lr), args, c_train, c_inf, trainer, inference)]
    print("\n| lr | steps | changed (median) | wire / dense (median) | delta sync | dense sync | dense / delta |")
    print("|---|---|---|---|---|---|---|")
    for lr in sorted({r["lr"] for r in rows}):
        steps = [r for r in rows if r["lr"] == lr and r["version"] > 1]
        med = lambda k: statistics.median(r[k] for r in steps)
        print(f"| {lr:g} | {len(steps)} | {100 * med('changed'):.2f}% | "
              f"{100 * statistics.median(r['wire_bytes'] / r['dense_bytes'] for r in steps):.1f}% | "
              f"{med('delta_s') * 1e3:.1f} ms | {med('dense_s') * 1e3:.1f} ms | "
              f"{statistics.median(r['dense_s'] / r['delta_s'] for r in steps):.1f}x |")
    print(f"\n{len(rows)} syncs of each kind, every destination byte checked, {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
