#!/usr/bin/env python3
"""Delta syncs under real optimizer steps: a small transformer trained with AdamW at RL-like
learning rates, fp32 master weights on the trainer node, synced after every step into three
inference groups on the inference node (tensor parallel over 2 ranks), from the same version, in
the same run: bf16 dense (delta off), bf16 with deltas (delta always), and fp8 e4m3 with 128 x 128
block scales for the matrices (bf16 vectors), with deltas. Per step it prints the fraction of
bf16 elements that changed, the bytes each sync put on the wire, the sync times and their ratio,
and fp8's error against the fp32 weights; every destination byte is checked (bf16: the trainer's
weights rounded; fp8: shardcast.fp8's reference quantisation, bit for bit).

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
from shardcast.fp8 import block_dequantize, block_quantize  # noqa: E402
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
    tensors_fp8 = [dict(t, dtype="float8_e4m3fn", block_scale={"scale": f"{t['name']}_scale"})
                   if len(t["shape"]) == 2 else t for t in tensors_dst]
    src = {"group": f"trainer-{group}", "mesh": {"shape": [1]}, "nodes": [trainer], "tensors": tensors_src}
    dst = lambda kind, tensors: {"group": f"{kind}-{group}", "mesh": {"shape": [2]}, "nodes": [inference, inference],
                                 "tensors": tensors}
    return src, dst("dense", tensors_dst), dst("delta", tensors_dst), dst("fp8", tensors_fp8)


def local_shard(p: torch.Tensor, rank: int, shard: bool) -> torch.Tensor:
    return p.chunk(2, dim=0)[rank] if shard else p


def fp8_tensors(params, shard, rank):
    """One rank's fp8 group: matrices as e4m3 with the scales of the 128 x 128 blocks its rows touch."""
    out = {}
    for n, p in params.items():
        if p.dim() != 2:
            out[n] = torch.zeros_like(local_shard(p.data, rank, shard[n]), dtype=torch.bfloat16)
            continue
        rows = p.shape[0] // 2 if shard[n] else p.shape[0]
        lo = rank * rows if shard[n] else 0
        out[n] = torch.zeros(rows, p.shape[1], dtype=torch.float8_e4m3fn)
        out[f"{n}_scale"] = torch.zeros(-(-(lo + rows) // 128) - lo // 128, -(-p.shape[1] // 128))
    return out


def check_fp8(params, shard, regs, lr, version):
    """Every fp8 byte and scale against the reference quantisation of the trainer's fp32 weights;
    the relative error of the dequantised weights: RMS over all matrices, and the largest for
    weights whose scaled value is in e4m3's normal range (smaller ones round to its subnormals)."""
    num = den = 0.0
    worst = 0.0
    for n, p in params.items():
        if p.dim() != 2:
            continue
        q, scale = block_quantize(p.detach(), (128, 128))
        rows = p.shape[0] // 2 if shard[n] else p.shape[0]
        for r, reg in enumerate(regs):
            lo = r * rows if shard[n] else 0
            b0, b1 = lo // 128, -(-(lo + rows) // 128)
            if not (torch.equal(reg.tensors[n].view(torch.uint8), q[lo:lo + rows].view(torch.uint8)) and
                    torch.equal(reg.tensors[f"{n}_scale"], scale[b0:b1])):
                raise SystemExit(f"lr {lr:g} version {version}: fp8 rank {r} tensor {n} differs from the reference")
        x = p.detach().float()
        deq = block_dequantize(q, scale, (128, 128))
        num += float(((deq - x) ** 2).sum())
        den += float((x ** 2).sum())
        scaled = (x / block_dequantize(torch.ones_like(q, dtype=torch.float32), scale, (128, 128))).abs()
        normal = scaled >= 2.0 ** -6
        if bool(normal.any()):
            worst = max(worst, float(((deq - x).abs() / x.abs())[normal].max()))
    return {"fp8_rms": (num / den) ** 0.5, "fp8_max": worst}


def run_lr(lr: float, args, c_train: shardcast.Client, c_inf: shardcast.Client, trainer: str, inference: str):
    model = model_of(args)
    params = {n.replace(".", "_"): p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    tag = f"{lr:g}".replace("-", "m").replace(".", "p")
    src_l, dense_l, delta_l, fp8_l = layouts(params, trainer, inference, tag)
    src = c_train.register(src_l["group"], 0, 1, {n: p.data for n, p in params.items()}, src_l, role="source",
                           version=1)
    shard = {n: t["placements"][0].get("shard") is not None for n, t in zip(params, dense_l["tensors"])}
    dests = {}
    for kind, lay in (("dense", dense_l), ("delta", delta_l)):
        dests[kind] = [c_inf.register(lay["group"], r, 2, {
            n: torch.zeros_like(local_shard(p.data, r, shard[n]), dtype=torch.bfloat16) for n, p in params.items()},
            lay) for r in range(2)]
    dests["fp8"] = [c_inf.register(fp8_l["group"], r, 2, fp8_tensors(params, shard, r), fp8_l) for r in range(2)]
    fp8_dense_l = dict(fp8_l, group=f"fp8dense-{tag}")  # every step dense: the quantiser's whole cost
    dests["fp8_dense"] = [c_inf.register(fp8_dense_l["group"], r, 2, fp8_tensors(params, shard, r), fp8_dense_l)
                          for r in range(2)]
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
        # "always": the figures are the deltas' own, also where "auto" would measure them slower
        # and run dense (docs/delta.md, "Which is faster").
        delta = c_train.sync(src_l["group"], delta_l["group"], version, delta="always")
        fp8 = c_train.sync(src_l["group"], fp8_l["group"], version, delta="always")
        fp8_dense = c_train.sync(src_l["group"], fp8_dense_l["group"], version)
        err = check_fp8(params, shard, dests["fp8"], lr, version)
        check_fp8(params, shard, dests["fp8_dense"], lr, version)
        for kind in ("dense", "delta"):
            for r, reg in enumerate(dests[kind]):
                for n in params:
                    want = local_shard(now[n], r, shard[n]).contiguous()
                    if not torch.equal(reg.tensors[n].view(torch.int16), want.view(torch.int16)):
                        raise SystemExit(f"lr {lr:g} version {version}: {kind} rank {r} tensor {n} differs")
        rows.append({"lr": lr, "version": version, "changed": changed / total if version > 1 else 1.0,
                     "dense_bytes": dense.network_bytes, "wire_bytes": delta.wire_bytes,
                     "dense_s": dense.seconds, "delta_s": delta.seconds, "delta_chunks": delta.delta_chunks,
                     "dense_chunks": delta.dense_chunks, "fp8_network": fp8.network_bytes,
                     "fp8_wire": fp8.wire_bytes, "fp8_s": fp8.seconds, "fp8_dense_s": fp8_dense.seconds, **err})
        r = rows[-1]
        print(f"lr {lr:g} v{version}: {100 * r['changed']:5.2f}% of bf16 elements changed, "
              f"wire {r['wire_bytes'] / 1e6:7.2f} MB of {r['dense_bytes'] / 1e6:.2f} "
              f"({100 * r['wire_bytes'] / r['dense_bytes']:5.1f}%), delta {r['delta_s'] * 1e3:7.1f} ms, "
              f"dense {r['dense_s'] * 1e3:7.1f} ms ({r['dense_s'] / r['delta_s']:.1f}x), "
              f"chunks {r['delta_chunks']} delta / {r['dense_chunks']} dense; fp8 {r['fp8_network'] / 1e6:.2f} MB dense, "
              f"wire {r['fp8_wire'] / 1e6:.2f} MB, {r['fp8_s'] * 1e3:.1f} ms (dense every step: "
              f"{r['fp8_dense_s'] * 1e3:.1f} ms, {r['fp8_dense_s'] / r['dense_s']:.2f}x bf16 dense), error vs fp32 rms "
              f"{r['fp8_rms']:.4f} max {r['fp8_max']:.4f}", flush=True)
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
    print("\n| lr | steps | changed (median) | wire / dense (median) | delta sync | dense sync | dense / delta |"
          " fp8 wire / bf16 dense | fp8 dense sync | fp8 dense / bf16 dense | fp8 delta wire / bf16 dense |"
          " fp8 delta sync | fp8 error rms / max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lr in sorted({r["lr"] for r in rows}):
        steps = [r for r in rows if r["lr"] == lr and r["version"] > 1]
        med = lambda k: statistics.median(r[k] for r in steps)
        print(f"| {lr:g} | {len(steps)} | {100 * med('changed'):.2f}% | "
              f"{100 * statistics.median(r['wire_bytes'] / r['dense_bytes'] for r in steps):.1f}% | "
              f"{med('delta_s') * 1e3:.1f} ms | {med('dense_s') * 1e3:.1f} ms | "
              f"{statistics.median(r['dense_s'] / r['delta_s'] for r in steps):.1f}x | "
              f"{100 * steps[0]['fp8_network'] / steps[0]['dense_bytes']:.1f}% | "
              f"{med('fp8_dense_s') * 1e3:.1f} ms | "
              f"{statistics.median(r['fp8_dense_s'] / r['dense_s'] for r in steps):.2f}x | "
              f"{100 * statistics.median(r['fp8_wire'] / r['dense_bytes'] for r in steps):.1f}% | "
              f"{med('fp8_s') * 1e3:.1f} ms | "
              f"{max(r['fp8_rms'] for r in steps):.4f} / {max(r['fp8_max'] for r in steps):.4f} |")
    print(f"\n{len(rows)} syncs of each kind, every destination byte checked, {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
