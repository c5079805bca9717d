"""shardcast.vllm.lora without vLLM or PEFT: which parameters make up an adapter and under which
names, how `lora=` picks adapters and ids, and what is refused; how the trainer names adapters at
`vllm serve` (ServerNames, against a stand-in for its routes); which ids a worker puts an adapter
back under (Installer, on a stand-in for vLLM's adapter manager). The real vLLM runs them in
vllm_tests/test_lora.py."""

from __future__ import annotations

import json
import threading
from enum import Enum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from shardcast.vllm.lora import (AdapterSpec, Installer, ServerNames, adapter_group, adapter_path, check_config,
                                 checkpoint_name, json_config, peft_adapters, replicated_pieces, resolve_adapters)

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


class FakeServe:
    """vllm serve's model routes as vLLM 0.32 answers them: /v1/models lists the base model and
    each adapter loaded (its path as `root`); without runtime LoRA updating, the load and unload
    routes do not exist (FastAPI's 404 {"detail": "Not Found"})."""

    def __init__(self, runtime_lora: bool = True, refuse_load: bool = False, api_key: str = "") -> None:
        self.adapters = {}  # name -> path
        self.calls = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def refused(self) -> bool:
                if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                    self.reply(401, {"error": "Unauthorized"})
                    return True
                return False

            def do_GET(self):
                fake.calls.append(("GET", self.path, None))
                if self.refused():
                    return
                cards = [{"id": "base", "root": "/models/base"}] + [
                    {"id": name, "root": path} for name, path in fake.adapters.items()]
                self.reply(200, {"object": "list", "data": cards})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append(("POST", self.path, body))
                if self.refused():
                    return
                if not runtime_lora:
                    return self.reply(404, {"detail": "Not Found"})
                name = body.get("lora_name")
                if self.path == "/v1/unload_lora_adapter":
                    if fake.adapters.pop(name, None) is None:
                        return self.reply(404, {"error": {"message": f"The lora adapter '{name}' cannot be found.",
                                                          "code": 404}})
                    return self.reply(200, "Success")
                if refuse_load:
                    return self.reply(500, {"error": {"message": "no Shardcast LoRA adapter is in service",
                                                      "code": 500}})
                fake.adapters[name] = body["lora_path"]
                return self.reply(200, "Success")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(**kwargs) -> FakeServe:
        servers.append(FakeServe(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_the_trainer_names_each_adapter_at_vllm_serve_once_and_takes_the_names_back(serve):
    server = serve()
    server.adapters["policy"] = "shardcast://vllm.lora.policy"  # an earlier trainer's, no version yet
    names = ServerNames("vllm", ["policy", "critic"])
    names.prepare(server.url)
    assert server.adapters == {}  # unnamed until a version serves
    names.name(server.url, ["policy"])
    assert server.adapters == {"policy": "shardcast://vllm.lora.policy"}
    calls = len(server.calls)
    names.name(server.url, ["policy"])  # named already: nothing asked
    assert len(server.calls) == calls
    names.name(server.url, ["policy", "critic"])
    assert server.adapters == {"policy": "shardcast://vllm.lora.policy", "critic": "shardcast://vllm.lora.critic"}
    names.forget()
    assert server.adapters == {} and names.named == {}
    # A server restarted at the same URL (or re-added) is named again after its prepare.
    names.name(server.url, ["policy"])
    server.adapters.clear()  # restarted
    names.prepare(server.url)
    names.name(server.url, ["policy"])
    assert server.adapters == {"policy": "shardcast://vllm.lora.policy"}


def test_a_server_that_cannot_name_adapters_is_refused_naming_the_setting(serve):
    # (vLLM lists its models either way; without runtime LoRA updating the two routes do not exist.)
    with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        ServerNames("vllm", ["policy"]).prepare(serve(runtime_lora=False).url)


def test_a_server_with_an_api_key_is_given_vllms_own_variable(serve, monkeypatch):
    server = serve(api_key="sekrit")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="HTTP 401.*give the trainer's process the server's key as VLLM_API_KEY"):
        ServerNames("vllm", ["policy"]).prepare(server.url)
    monkeypatch.setenv("VLLM_API_KEY", "sekrit")
    names = ServerNames("vllm", ["policy"])
    names.prepare(server.url)
    names.name(server.url, ["policy"])
    assert server.adapters == {"policy": "shardcast://vllm.lora.policy"}


def test_a_name_taken_or_refused_at_the_server_raises_naming_server_and_adapter(serve):
    server = serve()
    server.adapters["policy"] = "/checkpoints/policy"  # the user's own adapter of that name
    for call in (lambda names: names.prepare(server.url), lambda names: names.name(server.url, ["policy"])):
        with pytest.raises(RuntimeError, match="serves a model named 'policy' already .*/checkpoints/policy"):
            call(ServerNames("vllm", ["policy"]))
    assert server.adapters == {"policy": "/checkpoints/policy"}  # the user's adapter keeps its name
    refusing = serve(refuse_load=True)
    with pytest.raises(RuntimeError, match=f"{refusing.url} refused to name LoRA adapter 'policy' .HTTP 500.: "
                                           ".*no Shardcast LoRA adapter is in service"):
        ServerNames("vllm", ["policy"]).name(refusing.url, ["policy"])
    gone = FakeServe()
    gone.close()
    names = ServerNames("vllm", ["policy"], timeout_s=5)
    with pytest.raises(RuntimeError, match=f"vllm serve at {gone.url} did not answer /v1/models"):
        names.name(gone.url, ["policy"])
    names.named = {gone.url: ["policy"]}
    names.forget()  # logged, not raised: the trainer is shutting down
    assert names.named == {}


def test_only_servers_over_http_get_names_and_of_replica_sets_those_updated():
    http = [SimpleNamespace(base_url=f"http://h{k}:8000") for k in range(3)]
    offline = SimpleNamespace(llm=object())
    assert ServerNames.servers(http[0]) == ["http://h0:8000"]
    assert ServerNames.servers(offline) == []
    replicas = SimpleNamespace(clients=[http[0], offline, http[1], http[2]])
    assert ServerNames.servers(replicas) == ["http://h0:8000", "http://h1:8000", "http://h2:8000"]
    assert ServerNames.servers(replicas, [1, 2]) == ["http://h1:8000"]


class FakeAdapterManager:
    """vLLM's LRU adapter cache, as far as the Installer uses it: adapters by id."""

    def __init__(self) -> None:
        self.held = {}

    def add_adapter(self, lora) -> None:
        self.held[lora.id] = lora

    def remove_adapter(self, adapter_id: int) -> None:
        self.held.pop(adapter_id, None)

    def list_adapters(self):
        return dict(self.held)


def test_a_worker_puts_an_adapter_back_under_the_ids_vllm_loaded_its_path_under():
    adapters = FakeAdapterManager()
    from_disk = []
    manager = SimpleNamespace(_adapter_manager=adapters, _load_adapter=lambda request: from_disk.append(request))
    runner = SimpleNamespace(lora_manager=manager, lora_config=object())
    spec = AdapterSpec("policy", 100001, {"r": 8}, {"a": [[8, 4], "float32"]})
    path = adapter_path("vllm", "policy")
    serving = {}
    installer = Installer(runner, lambda p: serving.get(p))
    installer.model = lambda spec, tensors, adapter_id=None: SimpleNamespace(
        id=spec.id if adapter_id is None else adapter_id, tensors=tensors)
    tensors = {"a": torch.ones(8, 4)}
    # vLLM's own loads of other paths are vLLM's; a Shardcast path before a version serves raises.
    manager._load_adapter(SimpleNamespace(lora_path="/disk/adapter", lora_int_id=7))
    assert [r.lora_path for r in from_disk] == ["/disk/adapter"]
    with pytest.raises(ValueError, match="no Shardcast LoRA adapter at 'shardcast://vllm.lora.policy' is in service"):
        manager._load_adapter(SimpleNamespace(lora_path=path, lora_int_id=2))
    # Before vLLM loaded the path under an id of its own: put back under the trainer's id.
    installer.install(spec, tensors, path)
    assert set(adapters.held) == {100001}
    # vllm serve loads it under id 2 (its route), from the version in service, never from disk.
    serving[path] = (spec, tensors)
    lora = manager._load_adapter(SimpleNamespace(lora_path=path, lora_int_id=2))
    assert lora.id == 2 and lora.tensors is tensors and len(from_disk) == 1
    adapters.held.clear()  # vLLM's reset after an update
    installer.install(spec, tensors, path)
    assert set(adapters.held) == {2}  # the id requests name it by, and no copy nobody asks for
    installer.remove(spec, path)  # the engine shut down
    assert adapters.held == {}
    # A request naming the path after its engine shut down (one already accepted, or a name vllm
    # serve still gives) gets the last version served, not an error inside vLLM's engine step;
    # so does one before the next engine's first update.
    serving.clear()
    assert manager._load_adapter(SimpleNamespace(lora_path=path, lora_int_id=2)).tensors is tensors
    later = Installer(runner, lambda p: None)
    later.model = installer.model
    assert later.ids == {path: {2}} and {2, 100001} <= later.ours
    assert manager._load_adapter(SimpleNamespace(lora_path=path, lora_int_id=2)).tensors is tensors
    with pytest.raises(ValueError, match="no Shardcast LoRA adapter at 'shardcast://vllm.lora.critic'"):
        manager._load_adapter(SimpleNamespace(lora_path=adapter_path("vllm", "critic"), lora_int_id=3))
