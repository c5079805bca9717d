"""The GPU path from Python (skipped without a CUDA device: runs in scripts/device-check.sh): a
real torch DTensor on a CUDA device mesh, each rank's shard a CUDA tensor registered in place
through CUDA IPC, synced through real daemons into destination ranks whose tensors are CUDA
tensors too (TP over columns: strided slices of the source rows), every element checked; torch's
own shareable handles decoded (shardcast/cuda_ipc.py) for views inside cudaMalloc blocks; FSDP2-style
shards of a few GiB (views at offsets inside one allocation per rank, uneven, padded) synced into
CUDA destination views inside one allocation on another daemon, every byte and every guard byte
between them checked; and under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True tensors registered
by their cuMem allocations' descriptors and synced between two daemons, every byte checked, with
torch's 'e' handle checked against the layout the client reads."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")
if not torch.cuda.is_available():
    if os.environ.get("SHARDCAST_REQUIRE_GPU", "0") not in ("", "0"):  # scripts/device-check.sh
        pytest.fail("no CUDA device visible to torch and SHARDCAST_REQUIRE_GPU is set", pytrace=False)
    pytest.skip("no CUDA device (scripts/device-check.sh runs this where one is)", allow_module_level=True)

import gpu_worker  # noqa: E402
import shardcast  # noqa: E402
from rank_worker import recv  # noqa: E402
from shardcast import cuda_ipc  # noqa: E402
from shardcast.local import LocalCluster, TorchRendezvous  # noqa: E402

# FSDP2-style shards: this many GiB of source tensors in all (scripts/device-check.sh may lower it).
SHARD_GIB = float(os.environ.get("SHARDCAST_GPU_SHARD_GIB", "2"))


def destination_layout(group: str):
    return {"group": group, "mesh": {"shape": [2]}, "nodes": ["i0", "i0"],
            "tensors": [{"name": "w", "shape": [gpu_worker.ROWS, gpu_worker.COLS], "dtype": "float32",
                         "placements": [{"shard": {"dim": 1}}]},
                        {"name": "b", "shape": [gpu_worker.COLS], "dtype": "bfloat16",
                         "placements": [{"replicate": {}}]}]}


def test_cuda_dtensor_syncs_into_cuda_destination_ranks():
    with LocalCluster(["t0", "i0"]) as cluster:
        ctx = mp.get_context("spawn")
        rendezvous, procs, conns = TorchRendezvous(), [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=gpu_worker.main, args=(rank, 2, rendezvous.port, cluster.target("t0"), "gpu-trainer", child))
            p.start()
            procs.append(p)
            conns.append(parent)
        regs = []
        try:
            for c in conns:
                recv(c, "registered", timeout=180)
            full = gpu_worker.full_weights()
            cols = gpu_worker.COLS // 2
            dests = []
            for r in range(2):
                tensors = {"w": torch.zeros(gpu_worker.ROWS, cols, device="cuda"),
                           "b": torch.zeros(gpu_worker.COLS, dtype=torch.bfloat16, device="cuda")}
                client = shardcast.Client(cluster.target("i0"))
                regs.append((client.register("gpu-vllm", r, 2, tensors, destination_layout("gpu-vllm")), client))
                dests.append(tensors)
            coordinator = shardcast.Client(cluster.target("t0"))
            result = coordinator.sync("gpu-trainer", "gpu-vllm", 1, verify=True, wait_for_ranks=True, timeout=120)
            assert result.version == 1
            assert regs[0][1].wait_version("gpu-vllm", 1, timeout=30) >= 1
            for r, tensors in enumerate(dests):
                torch.cuda.synchronize()
                expect_w = full["w"][:, r * cols:(r + 1) * cols]
                assert torch.equal(tensors["w"].cpu(), expect_w), f"rank {r}: w differs"
                assert torch.equal(tensors["b"].cpu(), full["b"]), f"rank {r}: b differs"
            coordinator.close()
        finally:
            for reg, client in regs:
                reg.close()
                client.close()
            for c, p in zip(conns, procs):
                if p.is_alive():
                    c.send("exit")
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()


def test_a_cuda_tensor_names_its_gpu_by_the_uuid_torch_reports():
    # The daemon finds the GPU by it (a container's device numbers are its own): 16 bytes, one per
    # GPU, the ones nvidia-smi -L prints.
    from shardcast import memory

    uuids = [memory.gpu_uuid(d) for d in range(torch.cuda.device_count())]
    assert all(len(u) == 16 for u in uuids), uuids
    assert len(set(uuids)) == len(uuids), uuids
    handle = memory._cuda_handle("w", torch.zeros(16, device="cuda:0"))
    assert handle.cuda.device_uuid == uuids[0]


def test_torch_shares_views_inside_cuda_malloc_blocks_as_the_client_reads_them():
    # Small tensors are carved out of the caching allocator's cudaMalloc blocks: for each, the
    # decoded handle is the 64-byte IPC handle of its block, and the storage's address less torch's
    # offset is that block's base (as torch's own snapshot has it). Storages in one block have one
    # handle (what the daemon opens) and one base; at least one of them lies inside its block.
    keep = [torch.empty(1000 + 17 * k, device="cuda") for k in range(8)]
    views = [t[k:] for k, t in enumerate(keep)]
    segments = {s["address"]: s["total_size"] for s in torch.cuda.memory_snapshot()}
    seen = {}
    offsets = []
    for v in views:
        shared = v.untyped_storage()._share_cuda_()
        block = cuda_ipc.decode(shared[1], int(shared[3]))
        assert isinstance(block, cuda_ipc.CudaMallocBlock), f"torch {torch.__version__} shared {block}"
        assert len(block.ipc_handle) == 64
        base = v.untyped_storage().data_ptr() - block.offset
        assert base in segments, f"storage at {v.untyped_storage().data_ptr():#x} less offset {block.offset} " \
                                 "is not the base of a cudaMalloc block"
        assert block.offset + v.untyped_storage().nbytes() <= segments[base]
        assert seen.setdefault(base, block.ipc_handle) == block.ipc_handle
        offsets.append(block.offset)
    assert any(o > 0 for o in offsets), offsets
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    print(f"torch {torch.__version__}: shareable handle version {block.version}")
    if version >= (2, 13):
        assert block.version == 3
    elif version >= (2, 11):
        assert block.version == 2


def fsdp_destination_layout(group: str, specs):
    tensors = [{"name": "embed" if i == 0 else name, "shape": [rows, cols], "dtype": dtype,
                "placements": [{"shard": {"dim": 1 if i == 0 else 0}}]}
               for i, (name, rows, cols, dtype, _) in enumerate(specs)]
    name, n, dtype, _ = gpu_worker.NORM
    tensors.append({"name": name, "shape": [n], "dtype": dtype, "placements": [{"replicate": {}}]})
    return {"group": group, "mesh": {"shape": [2]}, "nodes": ["i0", "i0"], "tensors": tensors}


def destination_views(specs, rank: int):
    """The rank's destination tensors, views 4 KiB + 36 bytes apart inside one allocation whose
    other bytes (the guards) hold 0xA5: embed column-sharded (TP), proj row-sharded, norm replicated."""
    gap = 4096 + 36
    shapes = []
    for i, (name, rows, cols, dtype, _) in enumerate(specs):
        if i == 0:
            shapes.append((name, (rows, cols // 2), dtype))
        else:
            shapes.append((name, (gpu_worker.shard_rows(rows, 2, rank)[1], cols), dtype))
    name, n, dtype, _ = gpu_worker.NORM
    shapes.append((name, (n,), dtype))
    spans, end = [], gap
    for name, shape, dtype in shapes:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        spans.append((name, shape, dtype, end, nbytes))
        end += nbytes + gap
    flat = torch.full((end,), 0xA5, dtype=torch.uint8, device="cuda")
    views = {name: flat[at:at + nbytes].view(getattr(torch, dtype)).view(shape)
             for name, shape, dtype, at, nbytes in spans}
    return flat, views, [(at, nbytes) for _, _, _, at, nbytes in spans]


def check_destination(specs, rank: int, flat, views, spans) -> None:
    """Every byte of every view against the source pattern, every guard byte still 0xA5."""
    for i, (name, rows, cols, dtype, salt) in enumerate(specs):
        got = views[name].view(torch.uint8)
        row_bytes = cols * 2
        if i == 0:  # columns [rank * cols / 2, (rank + 1) * cols / 2) of every row
            step = max(1, gpu_worker.PATTERN_CHUNK // row_bytes)
            lo, hi = rank * row_bytes // 2, (rank + 1) * row_bytes // 2
            for r in range(0, rows, step):
                n = min(step, rows - r)
                want = gpu_worker.pattern(salt, r * row_bytes, n * row_bytes).view(n, row_bytes)[:, lo:hi]
                assert torch.equal(got[r:r + n], want), f"rank {rank}: {name} rows {r}..{r + n} differ"
        else:
            first, count = gpu_worker.shard_rows(rows, 2, rank)
            flat_got = got.reshape(-1)
            for off in range(0, count * row_bytes, gpu_worker.PATTERN_CHUNK):
                n = min(gpu_worker.PATTERN_CHUNK, count * row_bytes - off)
                want = gpu_worker.pattern(salt, first * row_bytes + off, n)
                assert torch.equal(flat_got[off:off + n], want), f"rank {rank}: {name} bytes {off}.. differ"
    name, n, dtype, salt = gpu_worker.NORM
    assert torch.equal(views[name].view(torch.uint8), gpu_worker.pattern(salt, 0, n * 4)), f"rank {rank}: {name}"
    edges = [0] + [x for at, nbytes in spans for x in (at, at + nbytes)] + [flat.numel()]
    for lo, hi in zip(edges[0::2], edges[1::2]):
        assert bool((flat[lo:hi] == 0xA5).all()), f"rank {rank}: guard bytes {lo}..{hi} were written"


def test_fsdp2_shards_of_gibs_sync_into_cuda_views_on_another_daemon_every_byte_checked():
    specs = gpu_worker.big_tensors(SHARD_GIB)
    with LocalCluster(["t0", "i0"]) as cluster:
        ctx = mp.get_context("spawn")
        rendezvous, procs, conns = TorchRendezvous(), [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=gpu_worker.fsdp_main,
                            args=(rank, 2, rendezvous.port, cluster.target("t0"), "gpu-fsdp", SHARD_GIB, child))
            p.start()
            procs.append(p)
            conns.append(parent)
        regs = []
        try:
            for c in conns:
                recv(c, "registered", timeout=240)
            dests = []
            for r in range(2):
                flat, views, spans = destination_views(specs, r)
                client = shardcast.Client(cluster.target("i0"))
                layout = fsdp_destination_layout("gpu-fsdp-dst", specs)
                regs.append((client.register("gpu-fsdp-dst", r, 2, views, layout), client))
                dests.append((flat, views, spans))
            coordinator = shardcast.Client(cluster.target("t0"))
            t0 = time.monotonic()
            result = coordinator.sync("gpu-fsdp", "gpu-fsdp-dst", 1, verify=True, wait_for_ranks=True, timeout=240)
            seconds = time.monotonic() - t0
            assert result.version == 1
            assert regs[0][1].wait_version("gpu-fsdp-dst", 1, timeout=60) >= 1
            moved = sum(rows * cols * 2 for _, rows, cols, _, _ in specs)
            print(f"synced {moved / (1 << 30):.2f} GiB of CUDA shards into CUDA views on another daemon in "
                  f"{seconds:.2f} s ({moved / seconds / 1e9:.2f} GB/s)")
            torch.cuda.synchronize()
            for r, (flat, views, spans) in enumerate(dests):
                check_destination(specs, r, flat, views, spans)
            coordinator.close()
        finally:
            for reg, client in regs:
                reg.close()
                client.close()
            for c, p in zip(conns, procs):
                if p.is_alive():
                    c.send("exit")
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()


def test_expandable_segments_register_by_descriptor_and_sync_every_byte_checked():
    # torch's expandable segments: the client hands the tensors' cuMem allocations to each daemon
    # on its socket's side channel; the daemons map them (cuMemImportFromShareableHandle, cuMemMap)
    # and a sync between them lands every byte, the guards around the destination untouched.
    # torch's 'e' handle is checked against the layout cuda_ipc reads: this process's pid, its
    # open fds, segments covering the storage.
    with LocalCluster(["t0", "i0"]) as cluster:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # the child's, read by its torch
        try:
            p = ctx.Process(target=gpu_worker.expandable_main,
                            args=(cluster.target("t0"), cluster.target("i0"), child))
            p.start()
        finally:
            if before is None:
                del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
            else:
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = before
        try:
            out = recv(parent, "done", timeout=240)
        finally:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    print(out)
    assert out["conf"] == "expandable_segments:True"
    assert out["decoded"] == "ExpandableSegment" and out["dst_decoded"] == "ExpandableSegment", out
    assert out["handle_type"] == "posix_fd", out
    assert out["pid_is_ours"] and out["fds_open"] and out["covers"] and out["segments"] >= 2, out
    version = tuple(int(x) for x in out["torch"].split("+")[0].split(".")[:2])
    assert out["version"] == (3 if version >= (2, 13) else 2), out
    assert out["synced_version"] == 1, out
    assert out["wrong_bytes"] == 0 and out["guards_intact"], out
    assert out["plain_decoded"] == "CudaMallocBlock" and out["plain_registered"] == 1, out
