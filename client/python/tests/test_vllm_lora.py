"""shardcast.vllm.lora, the trainer's half (no vLLM, no PEFT needed): which parameters make up an
adapter and under which names, how `lora=` picks adapters and ids, and what is refused."""

from __future__ import annotations

import json
from enum import Enum

import pytest
import torch

from shardcast.vllm.lora import (AdapterSpec, adapter_group, adapter_path, check_config, checkpoint_name, json_config,
                                 peft_adapters, replicated_pieces, resolve_adapters)

PEFT_NAMES = {
    # PEFT's parameter name -> what get_peft_model_state_dict saves (vLLM's loader reads)
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.policy.weight":
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.policy.weight":
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    "base_model.model.model.embed_tokens.lora_embedding_A.policy":
        "base_model.model.model.embed_tokens.lora_embedding_A",
}


def test_an_adapters_parameters_take_the_names_peft_saves_them_under():
    for parameter, saved in PEFT_NAMES.items():
        assert checkpoint_name(parameter, "policy") == saved
        assert checkpoint_name(parameter, "critic") is None  # another adapter's
    # Base weights, and a module whose name merely contains the adapter's, are no adapter's.
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "policy") is None
    assert checkpoint_name("base_model.model.policy.lora_A.weight", "policy") is None


def test_lora_picks_adapters_and_ids():
    available = ["policy", "critic"]
    # Default ids keep away from the small ones `vllm serve` gives adapters it loads by name.
    assert resolve_adapters(True, available) == {"policy": 100001, "critic": 100002}
    assert resolve_adapters("critic", available) == {"critic": 100001}
    assert resolve_adapters(["critic", "policy"], available) == {"critic": 100001, "policy": 100002}
    assert resolve_adapters({"policy": 7}, available) == {"policy": 7}


@pytest.mark.parametrize("lora, message", [
    ("actor", "does not have"),
    ({"policy": 0}, "integer id >= 1"),
    ({"policy": 3, "critic": 3}, "its own integer id"),
    ({"policy": True}, "integer id"),
    ([], "names no adapter"),
    (3, "give True"),
    ({"pol icy": 1}, "letters, digits"),
])
def test_lora_refuses_what_names_no_adapter_or_no_id(lora, message):
    with pytest.raises(ValueError, match=message):
        resolve_adapters(lora, ["policy", "critic", "pol icy"])


def test_only_lora_adapters_without_trained_full_modules_are_synced():
    check_config("policy", {"peft_type": "LORA", "r": 8})
    with pytest.raises(ValueError, match="PREFIX_TUNING adapter"):
        check_config("p", {"peft_type": "PREFIX_TUNING"})
    with pytest.raises(ValueError, match=r"modules_to_save \['score'\]"):
        check_config("policy", {"peft_type": "LORA", "modules_to_save": ["score"]})
    with pytest.raises(ValueError, match="trainable_token_indices"):
        check_config("policy", {"peft_type": "LORA", "trainable_token_indices": [5, 7]})


def test_a_peft_configuration_travels_as_json():
    class Kind(Enum):
        LORA = "LORA"

    config = json_config({"peft_type": Kind.LORA, "target_modules": {"v_proj", "q_proj"}, "r": 8,
                          "layers_pattern": ("layers",), "rank_pattern": {"q_proj": 4}})
    assert config == {"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"], "r": 8,
                      "layers_pattern": ["layers"], "rank_pattern": {"q_proj": 4}}
    json.dumps(config)


def test_the_announcement_round_trips_and_bad_ones_are_named():
    spec = AdapterSpec("policy", 1, {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},
                       {"base_model.model.x.lora_A.weight": [[8, 32], "float32"]})
    back = AdapterSpec.from_json("policy", json.loads(json.dumps(spec.to_json())))
    assert back == spec
    assert replicated_pieces(back) == {"base_model.model.x.lora_A.weight": ([0, 0], [8, 32])}
    with pytest.raises(ValueError, match="'policy': its announcement needs id, config and tensors"):
        AdapterSpec.from_json("policy", {"id": 1})
    with pytest.raises(ValueError, match="id 0"):
        AdapterSpec.from_json("policy", dict(spec.to_json(), id=0))
    with pytest.raises(ValueError, match="announces no tensors"):
        AdapterSpec.from_json("policy", dict(spec.to_json(), tensors={}))


def test_groups_and_paths_of_an_adapter():
    assert adapter_group("vllm", "policy") == "vllm.lora.policy"
    assert adapter_path("vllm", "policy") == "shardcast://vllm.lora.policy"


def test_a_module_without_peft_adapters_is_refused_by_name():
    with pytest.raises(ValueError, match="no peft_config"):
        peft_adapters(torch.nn.Linear(2, 2))

    class Peft(torch.nn.Module):
        peft_config = {"policy": object()}

    assert list(peft_adapters(Peft())) == ["policy"]
    assert list(peft_adapters(torch.compile(Peft()))) == ["policy"]
