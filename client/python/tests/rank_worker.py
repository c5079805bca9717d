"""One rank of a group in its own process, as a trainer or an inference server would be: registers
its shard with its node's daemon, then follows commands from the test over a pipe."""

from __future__ import annotations



import numpy as np

# Both groups hold w [16, 8] float32 and b [9] int64; values are a function of the element's global
# index and the version, so every element can be checked.
SHAPES = {"w": (16, 8), "b": (9,)}
DTYPES = {"w": np.float32, "b": np.int64}

TRAINER = {  # FSDP-like: every tensor sharded over dim 0 across 2 ranks on node n0
    "group": "trainer", "mesh": {"shape": [2]}, "nodes": ["n0", "n0"],
    "tensors": [{"name": "w", "shape": [16, 8], "dtype": "float32", "placements": [{"shard": {"dim": 0}}]},
                {"name": "b", "shape": [9], "dtype": "int64", "placements": [{"shard": {"dim": 0}}]}],
}
INFERENCE = {  # TP-like: w split by columns, b replicated, 2 ranks on node n1
    "group": "infer", "mesh": {"shape": [2]}, "nodes": ["n1", "n1"],
    "tensors": [{"name": "w", "shape": [16, 8], "dtype": "float32", "placements": [{"shard": {"dim": 1}}]},
                {"name": "b", "shape": [9], "dtype": "int64", "placements": [{"replicate": {}}]}],
}


def full(name: str, version: int) -> np.ndarray:
    n = int(np.prod(SHAPES[name]))
    return (np.arange(n, dtype=np.int64) * 3 + version * 1000).astype(DTYPES[name]).reshape(SHAPES[name])


def chunk(x: np.ndarray, dim: int, k: int, i: int) -> np.ndarray:
    """torch.chunk(x, k, dim)[i] (empty when there are fewer chunks)."""
    size = -(-x.shape[dim] // k)
    return np.take(x, range(min(i * size, x.shape[dim]), min((i + 1) * size, x.shape[dim])), axis=dim)


def shard(role: str, name: str, rank: int, version: int) -> np.ndarray:
    x = full(name, version)
    if role == "trainer":
        return chunk(x, 0, 2, rank)
    return chunk(x, 1, 2, rank) if name == "w" else x


def main(role: str, rank: int, target: str, use_torch: bool, conn) -> None:
    import shardcast

    try:
        client = shardcast.Client(target)
        layout = TRAINER if role == "trainer" else INFERENCE
        start = 1 if role == "trainer" else 0  # inference ranks start empty (version 0 = zeros)
        arrays = {n: shard(role, n, rank, start) * (1 if role == "trainer" else 0) for n in SHAPES}
        if use_torch:
            import torch

            tensors = {n: torch.tensor(a) for n, a in arrays.items()}  # tensors owning their memory
        else:
            tensors = arrays
        # A source: nothing published until the first "write" (acquire, write, publish).
        reg = client.register(layout["group"], rank, 2, tensors, layout,
                              role="source" if role == "trainer" else "destination")
        if use_torch:  # torch tensors are moved into shared memory in place
            assert all(reg.tensors[n] is tensors[n] for n in tensors)
        conn.send(("registered", reg.node))
        while True:
            cmd, version = conn.recv()
            if cmd == "write":  # a training step: new weights, written in place, then published
                with reg.writing(version):
                    for n in SHAPES:
                        t = reg.tensors[n]
                        (t.numpy() if use_torch else t)[...] = shard(role, n, rank, version)
                conn.send(("written", version))
            elif cmd == "check":
                got = client.wait_version("infer", version, timeout=30)
                bad = 0
                for n in SHAPES:
                    t = reg.tensors[n]
                    a = t.numpy() if use_torch else t
                    bad += int(np.count_nonzero(a != shard(role, n, rank, version)))
                conn.send(("checked", (got, bad)))
            elif cmd == "exit":
                reg.close()
                client.close()
                conn.send(("closed", None))
                return
    except Exception as e:  # reported to the test, which fails with it
        conn.send(("error", repr(e)))


def recv(conn, what: str, timeout: float = 120):
    """The value of the next message from a rank, which must be tagged `what`."""
    assert conn.poll(timeout), f"no '{what}' from a rank within {timeout} s"
    tag, value = conn.recv()
    assert tag == what, f"rank answered {tag}: {value}"
    return value


class Ranks:
    """Rank processes (spawned, one per (role, rank, daemon target, use_torch)), registered on
    entry and told to unregister and exit on leaving."""

    def __init__(self, specs) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.workers = []
        for role, rank, target, use_torch in specs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=main, args=(role, rank, target, use_torch, child))
            p.start()
            self.workers.append((role, parent, p))

    def __enter__(self):
        try:
            self.nodes = [recv(conn, "registered") for _, conn, _ in self.workers]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for _, conn, p in self.workers:
            if p.is_alive():
                conn.send(("exit", None))
        for _, _, p in self.workers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def register_trainers(client, version: int = 1):
    """Both trainer ranks in this process, as sources holding `version` (published)."""
    return [client.register("trainer", r, 2, {n: shard("trainer", n, r, version) for n in SHAPES}, TRAINER,
                            role="source", version=version) for r in range(2)]


def zeros(rank: int):
    """An inference rank's tensors, all zero (nothing received yet)."""
    return {n: np.zeros_like(shard("infer", n, rank, 0)) for n in SHAPES}


def register_inference(client, **kwargs):
    """Both inference ranks in this process, zero-filled destinations (`kwargs` to register)."""
    return [client.register("infer", r, 2, zeros(r), INFERENCE, **kwargs) for r in range(2)]
