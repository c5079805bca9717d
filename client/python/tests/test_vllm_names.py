"""shardcast.vllm.names: the checkpoint names a trainer's parameters are registered under (no vLLM
needed: the module does not import it)."""

from __future__ import annotations

import pytest
import torch

from shardcast.vllm.names import checkpoint_names, is_data_parallel, refuse_fsdp1, strip_wrappers


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4, bias=False)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Block(), Block()])
        self.lm_head = torch.nn.Linear(4, 8, bias=False)


PLAIN = ["model.layers.0.q_proj.weight", "model.layers.1.q_proj.weight", "lm_head.weight"]


def test_plain_names_are_the_checkpoints():
    names = [n for n, _ in Tiny().named_parameters()]
    assert names == PLAIN
    assert checkpoint_names(names) == {n: n for n in PLAIN}


def test_torch_compile_and_activation_checkpointing_components_are_taken_out():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Tiny()
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    compiled = torch.compile(model)  # not run: only its names matter
    names = [n for n, _ in compiled.named_parameters()]
    assert names[0] == "_orig_mod.model.layers.0._checkpoint_wrapped_module.q_proj.weight"
    assert sorted(checkpoint_names(names).values()) == sorted(PLAIN)


def test_a_leading_module_is_ddps_only():
    assert strip_wrappers("module.lm_head.weight", data_parallel=True) == "lm_head.weight"
    # A model's own submodule called "module" stays.
    assert strip_wrappers("module.lm_head.weight") == "module.lm_head.weight"
    assert strip_wrappers("a.module.b", data_parallel=True) == "a.module.b"
    assert is_data_parallel(torch.nn.DataParallel(Tiny()))
    assert is_data_parallel(torch.compile(torch.nn.DataParallel(Tiny())))  # compiled DDP too
    assert not is_data_parallel(Tiny())


def test_a_name_map_renames_what_the_trainer_calls_otherwise():
    names = ["layers.0.attn.q.weight", "head.weight"]
    by_dict = checkpoint_names(names, {"head.weight": "lm_head.weight"})
    assert by_dict == {"layers.0.attn.q.weight": "layers.0.attn.q.weight", "head.weight": "lm_head.weight"}
    by_function = checkpoint_names(names, lambda n: "model." + n.replace(".attn.q.", ".self_attn.q_proj."))
    assert by_function["layers.0.attn.q.weight"] == "model.layers.0.self_attn.q_proj.weight"


def test_two_parameters_under_one_name_are_refused_naming_both():
    with pytest.raises(ValueError, match="'_orig_mod.w' and 'w' both map to checkpoint name 'w'"):
        checkpoint_names(["_orig_mod.w", "w"])
    with pytest.raises(ValueError, match="maps to no checkpoint name"):
        checkpoint_names(["w"], lambda n: "")


def test_a_name_mapped_to_none_is_a_trainer_only_parameter():
    names = ["model.layers.0.q_proj.weight", "value_head.weight"]
    out = checkpoint_names(names, {"value_head.weight": None})
    assert out == {"model.layers.0.q_proj.weight": "model.layers.0.q_proj.weight"}


def test_fsdp1_is_refused_with_what_to_use_instead():
    class FullyShardedDataParallel(torch.nn.Module):  # stands for FSDP1's wrapper (same class name)
        pass

    model = Tiny()
    model.model.layers[0] = FullyShardedDataParallel()
    with pytest.raises(ValueError, match="FSDP1.*fully_shard"):
        refuse_fsdp1(model)
    refuse_fsdp1(Tiny())  # no FSDP1: nothing to refuse
