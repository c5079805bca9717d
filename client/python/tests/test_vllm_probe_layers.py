"""shardcast.vllm.probe without vLLM: a model whose `load_weights` writes each checkpoint tensor
into its parameter as vLLM's loaders do (a fused parameter taking two tensors, a vocab shard with
padding), probed one decoder layer at a time. The probe must find every landing as one pass over
the whole model would, hold float64 probes of one layer (and the parameters in no layer) at a
time, and probe the whole model at once where a loader crosses layers, finding what one pass
finds. Against a real vLLM: vllm_tests/test_probe.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")

from shardcast.vllm import probe as probing  # noqa: E402
from shardcast.vllm.layout import check_landings  # noqa: E402
from shardcast.vllm.probe import Landing, ProbeError, layer_of, unreached  # noqa: E402

H, LAYERS = 4, 3


class Model(torch.nn.Module):
    """layers.{i}.gate_up [2H, H] (gate rows, then up) and layers.{i}.down [H, H]; embed [6, H], of a
    vocabulary of 5 (row 5 is padding the loader zero-fills). `routes`: checkpoint name -> the
    down parameters (layer numbers) its loader writes it into, for loaders that cross layers."""

    def __init__(self, routes=None, peek: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(6, H), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            layer = torch.nn.Module()
            layer.gate_up = torch.nn.Parameter(torch.zeros(2 * H, H), requires_grad=False)
            layer.down = torch.nn.Parameter(torch.zeros(H, H), requires_grad=False)
            self.layers.append(layer)
        self.routes = routes or {}
        self.peek = peek  # layer 0's loader reads a value of layer 1's parameter first
        self.seen = []  # per load_weights call: the layers whose parameters held memory

    def load_weights(self, weights):
        self.seen.append(sorted(i for i, layer in enumerate(self.layers) if layer.down.device.type != "meta"))
        for name, t in weights:
            if name == "embed":
                self.embed.data[:5].copy_(t)
                self.embed.data[5:].zero_()
                continue
            if self.peek and name == "layers.0.down":
                float(self.layers[1].down.sum())  # on the meta device: raises
            if name in self.routes:
                for i in self.routes[name]:
                    self.layers[i].down.data.copy_(t)
                continue
            i, kind = int(name.split(".")[1]), name.split(".")[2]
            layer = self.layers[i]
            if kind == "down":
                layer.down.data.copy_(t)
            else:
                layer.gate_up.data[(0 if kind == "gate" else H):][:H].copy_(t)


def checkpoint():
    shapes = {"embed": (5, H)}
    for i in range(LAYERS):
        shapes.update({f"layers.{i}.gate": (H, H), f"layers.{i}.up": (H, H), f"layers.{i}.down": (H, H)})
    return shapes


@pytest.fixture
def without_vllm(monkeypatch):
    """The loader layout vLLM would give: each parameter as it is (no processed layers)."""
    def layout(model):
        return {full: (model.get_submodule(full.rpartition(".")[0]), full.rpartition(".")[2], p)
                for full, p in model.named_parameters()}

    monkeypatch.setattr(probing, "_loader_layout", layout)


def test_layers_are_named_by_their_decoder_layer_and_the_rest_by_none():
    assert layer_of("model.layers.12.mlp.experts.w13_weight") == 12
    assert layer_of("layers.0.gate") == 0 and layer_of("transformer.h.3.attn.c_attn.weight") == 3
    assert layer_of("model.embed_tokens.weight") is None and layer_of("lm_head.weight") is None
    assert layer_of("model.norm.weight") is None and layer_of("model.layers_norm.1.weight") is None


def test_one_layer_at_a_time_finds_every_landing(without_vllm):
    model = Model()
    maps = probing.probe(model, checkpoint())
    # One pass for the tensors in no layer, then one per layer, each with only its layer in memory.
    assert model.seen == [[], [0], [1], [2]]
    assert list(maps) == ["embed"] + [f"layers.{i}.{p}" for i in range(LAYERS) for p in ("gate_up", "down")]
    assert maps["layers.2.gate_up"].landings == [Landing("layers.2.gate", (0, 0), (H, H), 0),
                                                 Landing("layers.2.up", (0, 0), (H, H), H * H)]
    assert maps["layers.1.down"].landings == [Landing("layers.1.down", (0, 0), (H, H), 0)]
    assert maps["embed"].landings == [Landing("embed", (0, 0), (5, H), 0)] and maps["embed"].padding == H
    assert all(written == total for total, written, _ in
               [v for k, v in check_landings(maps).items() if k != "embed"])
    # The live parameters are back, with their values.
    assert all(p.device.type == "cpu" and not bool(p.any()) for p in model.parameters())


def test_loaders_that_cross_layers_are_probed_whole_as_one_pass_finds_them(without_vllm, caplog):
    # Layer 0's down written into layer 1's parameter (a broken loader): layer 1 is on the meta
    # device in layer 0's pass, so the probe starts again with the whole model, and reports what
    # vLLM's load would do: layers.1.down ends up holding its own tensor (written last), and
    # layer 0's parameter is reached by nothing (the engine refuses it, naming it).
    model = Model(routes={"layers.0.down": [1]})
    maps = probing.probe(model, checkpoint())
    assert model.seen == [[], [0], [0, 1, 2]]  # the pass of layer 0 touched layer 1: one pass, whole
    assert "touched parameter 'layers.1.down' while loading another layer's" in caplog.text
    assert unreached(model, maps) == ["layers.0.down"]
    assert maps["layers.1.down"].landings == [Landing("layers.1.down", (0, 0), (H, H), 0)]
    # Layer 1's down also written into layer 0's (over layer 0's own): reported as vLLM does it.
    model = Model(routes={"layers.1.down": [0, 1]})
    maps = probing.probe(model, checkpoint())
    assert maps["layers.0.down"].landings == [Landing("layers.1.down", (0, 0), (H, H), 0)]
    assert "layers.0.down" not in {l.tensor for pm in maps.values() for l in pm.landings}
    # A loader that reads another layer's parameter fails on its meta probe: probed whole as well.
    model = Model(peek=True)
    maps = probing.probe(model, checkpoint())
    assert model.seen == [[], [0], [0, 1, 2]] and unreached(model, maps) == []
    # A checkpoint name in no layer that a loader maps into a layer (vLLM's EAGLE heads load
    # `midlayer.` into `layers.0.`): found, as one pass finds it.
    model = Model(routes={"mid.down": [0]})
    shapes = checkpoint()
    del shapes["layers.0.down"]
    shapes["mid.down"] = (H, H)
    maps = probing.probe(model, shapes)
    assert model.seen == [[], [0, 1, 2]]
    assert maps["layers.0.down"].landings == [Landing("mid.down", (0, 0), (H, H), 0)]
    assert unreached(model, maps) == []


def test_a_loader_refusing_a_tensor_names_it_and_leaves_the_live_parameters(without_vllm):
    model = Model()
    shapes = checkpoint()
    shapes["layers.1.down"] = (H, H + 1)
    with pytest.raises(ProbeError, match=r"'layers.1.down' \(shape \[4, 5\]\) does not fit vLLM's parameter "
                                         r"'layers.1.down'"):
        probing.probe(model, shapes)
    assert all(p.device.type == "cpu" for p in model.parameters())
