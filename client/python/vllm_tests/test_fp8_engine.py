"""The vLLM worker's block-quantised fp8 path as the engine runs it (ShardcastWeightTransferEngine:
init_transfer_engine, receive_weights), on a stand-in model made of vLLM's own layers under its
Fp8 quantisation (weight_block_size [128, 128]): a fused qkv_proj (QKVParallelLinear, GQA) and a
row-parallel o_proj (RowParallelLinear), whose float8_e4m3fn `weight` and float32
`weight_scale_inv` vLLM's loaders fill, and a float32 norm. The engine finds the fp8 layers
(fp8_blocks), probes again with the scales as vLLM's fp8 checkpoint names them, registers the
rank with a block_scale per weight, and a bf16 trainer on another node syncs into it, dense and
then by deltas: every fp8 byte and scale the daemon lands equals shardcast.fp8.block_quantize of
the trainer's weights.

vLLM's CPU kernels for these layers need AMX (Sapphire Rapids or newer); where the CPU has none,
the layers are built without one (vLLM chooses it after creating the parameters, and nothing here
runs a forward pass). Not run here: finish_weight_update (vLLM's fp8 processing needs that kernel
and a model vLLM loaded). Run as a script by the test: vLLM's distributed state is per process."""

from __future__ import annotations

import json
import socket
import types


def test_the_engine_registers_and_receives_block_fp8_from_a_bf16_trainer():
    from conftest import IN_PROCESS, run_script

    out = run_script("test_fp8_engine.py", env_extra=IN_PROCESS, timeout=600)
    assert out.get("error") is None, out.get("error")
    # The engine found the fp8 layers and their blocks, and registered each weight in fp8 with its
    # scale (derived by the daemon: the trainer announces none).
    layout = out["layout"]
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
        scale = name.replace(".weight", ".weight_scale_inv")
        assert layout[name] == {"dtype": "float8_e4m3fn", "block_scale": {"block": [128, 128], "scale": scale}}
    assert layout["norm.weight"] == {"dtype": "float32"} and not any(n.endswith("_scale_inv") for n in layout)
    # The second probe found each scale's blocks where vLLM's block-scale loader puts them: q's two
    # rows of blocks, k's and v's one each (of qkv_proj.weight_scale_inv [4, 2]), o's [2, 2].
    pieces = out["pieces"]
    assert pieces["q_proj.weight_scale_inv"] == pieces["o_proj.weight_scale_inv"] == [[0, 0], [2, 2]]
    assert pieces["k_proj.weight_scale_inv"] == pieces["v_proj.weight_scale_inv"] == [[0, 0], [1, 2]]
    # vLLM's fp8 layers process their weights: the bytes land in staging tensors in the loader's layout.
    assert out["processed"] == ["o_proj.weight", "o_proj.weight_scale_inv", "qkv_proj.weight",
                                "qkv_proj.weight_scale_inv"] and out["direct"] == ["norm.weight"]
    # Every fp8 byte and scale the daemon landed is the reference quantisation, after a dense sync
    # and after two delta syncs.
    syncs = out["syncs"]
    assert [s["version"] for s in syncs] == [1, 2, 3]
    assert syncs[0]["delta_chunks"] == 0 and all(s["delta_chunks"] > 0 for s in syncs[1:]), syncs
    for s in syncs:
        assert s["wrong"] == [] and s["checked"] == 9, s


def main() -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    import shardcast
    from shardcast.fp8 import block_quantize
    from shardcast.local import LocalCluster
    from shardcast.vllm.engine import ShardcastInitInfo, ShardcastUpdateInfo, ShardcastWeightTransferEngine

    result: dict = {}
    # vLLM's layers read the current config: only the model's dtype and whether it is a MoE here.
    config = VllmConfig()
    config.model_config = types.SimpleNamespace(dtype=torch.float32, is_moe=False)
    with set_current_vllm_config(config):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = stand_in_model()

    H, B = 256, 128
    shapes = {"q_proj.weight": (H, H), "k_proj.weight": (H // 2, H), "v_proj.weight": (H // 2, H),
              "o_proj.weight": (H, H), "norm.weight": (H,)}
    g = torch.Generator().manual_seed(5)
    weights = {n: (torch.randn(*s, generator=g) * 0.03).to(torch.bfloat16 if n != "norm.weight" else torch.float32)
               for n, s in shapes.items()}
    weights["o_proj.weight"][:B, B:] = 0  # an all-zero block: scale 1
    vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(enable_expert_parallel=False,
                                                                              data_parallel_index=0),
                                        model_config=config.model_config)
    engine = ShardcastWeightTransferEngine(None, vllm_config, torch.device("cpu"), model)
    # The layout the engine registers (its registration does not keep it).
    real_register, layouts = shardcast.Client.register, {}

    def register(self, group, rank, world_size, tensors, layout, *args, **kwargs):
        layouts[group] = layout
        return real_register(self, group, rank, world_size, tensors, layout, *args, **kwargs)

    shardcast.Client.register = register
    with LocalCluster(["t0", "i0"]) as cluster:
        try:
            engine.init_transfer_engine(ShardcastInitInfo(
                checkpoint={n: [list(s), str(weights[n].dtype).replace("torch.", "")] for n, s in shapes.items()},
                group="vllm", daemon=cluster.target("i0")))
            result["layout"] = {t["name"]: {k: t[k] for k in ("dtype", "block_scale") if k in t}
                                for t in json.loads(json.dumps(layouts["vllm"]))["tensors"]}
            result["pieces"] = {n: [list(map(int, o)), list(map(int, z))] for n, (o, z) in engine.memory.pieces.items()}
            result["direct"], result["processed"] = sorted(engine.memory.direct), sorted(engine.memory.processed)
            trainer = shardcast.Client(cluster.target("t0"))
            src_layout = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["t0"],
                          "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                                      for n, t in weights.items()]}
            src = trainer.register("trainer", 0, 1, {n: t.clone() for n, t in weights.items()}, src_layout,
                                   role="source", version=1)
            result["syncs"] = []
            for version in (1, 2, 3):
                if version > 1:
                    with src.writing(version):  # a step changes a few weights
                        for n in shapes:
                            if n != "norm.weight":
                                src.tensors[n][version, :4] += 0.01
                engine.start_weight_update()
                resp = trainer.sync("trainer", "vllm", version, delta="auto", verify=True, timeout=120)
                engine.receive_weights(ShardcastUpdateInfo(version=version, timeout_s=60))
                wrong, checked = compare(engine.memory.tensors, {n: t.clone() for n, t in src.tensors.items()},
                                         block_quantize, B)
                result["syncs"].append({"version": version, "delta_chunks": resp.delta_chunks,
                                        "dense_chunks": resp.dense_chunks, "wrong": wrong, "checked": checked})
            src.close()
            trainer.close()
        except Exception as e:
            import traceback

            result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        finally:
            engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def stand_in_model():
    """One attention block's linear layers as vLLM builds them for a block-fp8 checkpoint, with a
    `load_weights` that maps the checkpoint's names onto them as vLLM's Llama does (q/k/v into the
    fused qkv_proj, by shard id; the scales alike, as `<weight>_scale_inv`)."""
    import torch
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    quant = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    try:
        QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=quant, prefix="probe")
    except ValueError as e:  # no fp8 kernel for this CPU (AMX): build the layers without one
        if "Failed to find a kernel" not in str(e):
            raise
        fp8.init_fp8_linear_kernel = lambda *args, **kwargs: None

    class Block(torch.nn.Module):
        stacked = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))

        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=quant, prefix="qkv_proj")
            self.o_proj = RowParallelLinear(256, 256, bias=False, quant_config=quant, prefix="o_proj")
            self.norm = torch.nn.Module()
            self.norm.weight = torch.nn.Parameter(torch.ones(256), requires_grad=False)

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, tensor in weights:
                for fused, part, shard in self.stacked:
                    if name.startswith(part + "."):
                        param = params[name.replace(part, fused, 1)]
                        param.weight_loader(param, tensor, shard)
                        break
                else:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)

    return Block()


def compare(landed, source, block_quantize, block: int):
    """(names whose landed bytes differ from the reference, how many tensors were checked): fp8
    weights bit for bit against block_quantize of the trainer's bf16 weights, their scales as
    float32 bits, the norm as it is."""
    import torch

    wrong, checked = [], 0
    for name, t in source.items():
        if name == "norm.weight":
            checked += 1
            if not torch.equal(landed[name], t):
                wrong.append(name)
            continue
        q, scale = block_quantize(t, (block, block))
        checked += 2
        if not torch.equal(landed[name].contiguous().view(torch.uint8), q.contiguous().view(torch.uint8)):
            wrong.append(name)
        scale_name = name.replace(".weight", ".weight_scale_inv")
        if not torch.equal(landed[scale_name].contiguous().view(torch.int32), scale.contiguous().view(torch.int32)):
            wrong.append(scale_name)
    return wrong, checked


if __name__ == "__main__":
    main()
