"""LoRA adapters as versions (docs/vllm.md, "LoRA adapters"): what the trainer and the workers
agree on for each adapter, and the worker's in-memory adapters.

Each adapter is its own pair of groups: the trainer registers its adapter parameters (and nothing
else: the base weights never leave the engines) as source group `<group>.lora.<name>`, every vLLM
worker registers `<destination>.lora.<name>` (in a replica set, `<destination>.lora.<name>.r<k>`),
and each is synced, versioned and caught up on its own.

The names are PEFT's checkpoint names, which vLLM's LoRA loader takes
(`base_model.model.<module>.lora_A.weight`): a PEFT model's parameter
`...q_proj.lora_A.<adapter>.weight` without its adapter component, as `get_peft_model_state_dict`
saves it. The trainer announces the adapter's PEFT configuration (rank, alpha, target modules, ...)
with its tensors and the vLLM id requests name it by (`LoRARequest(name, id, ...)`).

Worker side (`WorkerAdapter`): bytes land in host buffers of the worker's own, never in what
vLLM serves. When an update finishes, a new adapter is built from them by vLLM's own
`LoRAModel.from_lora_tensors` (what its load from disk runs on the file's tensors) and replaces
the old one between two engine steps: serving never sees half an adapter, a failed update leaves
the previous one serving. vLLM removes every adapter after each weight update
(`reset_lora_state`, for adapters computed against replaced base weights); the worker puts its
adapters back right after (shardcast.vllm.session), and vLLM's load of a `shardcast://` path
(an adapter it dropped or evicted since) is answered from the version in service, never from
disk (`Installer`).

Every TP rank lands each adapter whole and vLLM's LoRA layers cut it (`set_lora`), as they cut an
adapter loaded from disk: the network carries each byte once per node, and the node's daemon fans
it out to the node's ranks. No vLLM import at module level: the trainer's half is usable without
vLLM."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

# PEFT's LoRA parameter components; the adapter's name follows one of them in a parameter's name.
LORA_COMPONENTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
# Where requests name a Shardcast adapter: vLLM's LoRARequest needs a path, which it loads when it
# does not hold the adapter; the worker answers that load from the version in service.
PATH_SCHEME = "shardcast://"
# The vLLM ids lora=True and lists give (ID_BASE + 1, + 2, ...): away from the small ids `vllm
# serve` hands out to adapters loaded by name (vLLM keys adapters by id alone).
ID_BASE = 100000

_log = logging.getLogger("shardcast")


def adapter_group(group: str, adapter: str) -> str:
    """The group adapter `adapter` of `group` is synced through ("vllm.lora.policy")."""
    return f"{group}.lora.{adapter}"


def adapter_path(destination: str, adapter: str) -> str:
    """The `lora_path` a request gives for a Shardcast adapter (vLLM needs one; it is never read)."""
    return f"{PATH_SCHEME}{adapter_group(destination, adapter)}"


def check_adapter_name(name: Any) -> str:
    """`name` when it can name an adapter's groups (letters, digits, '-', '_'), else ValueError."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"shardcast: LoRA adapter name {name!r}: use letters, digits, '-' and '_' (it names the "
                         "adapter's groups)")
    return name


def checkpoint_name(parameter: str, adapter: str) -> Optional[str]:
    """The checkpoint name of PEFT parameter `parameter` when it belongs to adapter `adapter`
    (`...q_proj.lora_A.policy.weight` -> `...q_proj.lora_A.weight`), None when it does not."""
    parts = parameter.split(".")
    for i in range(len(parts) - 1):
        if parts[i] in LORA_COMPONENTS and parts[i + 1] == adapter:
            return ".".join(parts[:i + 1] + parts[i + 2:])
    return None


def json_config(config: Mapping[str, Any]) -> Dict[str, Any]:
    """A PEFT configuration's dict as JSON takes it (what `save_pretrained` writes to
    adapter_config.json): sets as sorted lists, enums as their values."""

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(plain(v) for v in value)
        if isinstance(value, Enum):
            return value.value
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return json.loads(json.dumps(plain(dict(config)), default=str))


def peft_adapters(module: torch.nn.Module) -> Dict[str, Any]:
    """The LoRA adapters of a PEFT model (`peft_config`: adapter name -> its LoraConfig), through
    torch.compile and DDP wrappers; ValueError when `module` is not one."""
    inner = module
    for _ in range(4):
        config = getattr(inner, "peft_config", None)
        if isinstance(config, dict) and config:
            return dict(config)
        inner = getattr(inner, "_orig_mod", None) or getattr(inner, "module", None)
        if inner is None:
            break
    raise ValueError("shardcast: lora= syncs the adapters of a PEFT model (peft.get_peft_model), and this "
                     "module has no peft_config")


def resolve_adapters(lora: Any, available: Sequence[str]) -> Dict[str, int]:
    """Adapter name -> vLLM id from the trainer's `lora=`: True (every adapter of the model, ids
    ID_BASE + 1.. in the model's order), a name or a list of names (ids in that order), or a dict
    name -> id (ids >= 1, distinct). ValueError naming what is wrong."""
    if lora is True:
        names = list(available)
        return {check_adapter_name(n): ID_BASE + i for i, n in enumerate(names, start=1)}
    if isinstance(lora, str):
        lora = [lora]
    if isinstance(lora, Mapping):
        ids = {check_adapter_name(n): i for n, i in lora.items()}
    elif isinstance(lora, (list, tuple)):
        ids = {check_adapter_name(n): ID_BASE + i for i, n in enumerate(lora, start=1)}
    else:
        raise ValueError(f"shardcast: lora={lora!r}: give True, an adapter name, a list of names or a dict of "
                         "name -> vLLM id")
    if not ids:
        raise ValueError("shardcast: lora= names no adapter")
    missing = [n for n in ids if n not in available]
    if missing:
        raise ValueError(f"shardcast: lora= names adapter(s) {missing} the model does not have (it has "
                         f"{list(available)})")
    bad = [i for i in ids.values() if not isinstance(i, int) or isinstance(i, bool) or i < 1]
    if bad or len(set(ids.values())) != len(ids):
        raise ValueError(f"shardcast: lora= ids {ids}: each adapter needs its own integer id >= 1 (vLLM's "
                         "lora_int_id)")
    return ids


def check_config(adapter: str, config: Mapping[str, Any]) -> None:
    """Refuses, naming the adapter, what the trainer cannot sync as a LoRA adapter for vLLM: a
    configuration that is not LoRA, or one with trained modules besides the adapter's matrices
    (`modules_to_save`: full copies of layers, which vLLM does not load as part of an adapter)."""
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"shardcast: adapter {adapter!r} is a {kind} adapter; lora= syncs LoRA adapters")
    if config.get("modules_to_save"):
        raise ValueError(f"shardcast: adapter {adapter!r} trains modules_to_save {config['modules_to_save']}: full "
                         "layers, which vLLM does not take as part of a LoRA adapter; train them without them")
    if config.get("trainable_token_indices"):
        raise ValueError(f"shardcast: adapter {adapter!r} trains token embeddings (trainable_token_indices), which "
                         "vLLM does not take as part of a LoRA adapter")


@dataclass
class AdapterSpec:
    """One adapter as the trainer announces it: its vLLM id, its PEFT configuration (JSON), and its
    tensors (checkpoint name -> [shape, dtype name])."""

    name: str
    id: int
    config: Dict[str, Any]
    tensors: Dict[str, List[Any]]

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "config": self.config, "tensors": self.tensors}

    @classmethod
    def from_json(cls, name: str, value: Mapping[str, Any]) -> "AdapterSpec":
        check_adapter_name(name)
        try:
            spec = cls(name, int(value["id"]), dict(value["config"]),
                       {str(k): [list(v[0]), str(v[1])] for k, v in dict(value["tensors"]).items()})
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"shardcast: LoRA adapter {name!r}: its announcement needs id, config and tensors "
                             f"(name -> [shape, dtype]): {type(e).__name__}: {e}") from e
        if spec.id < 1:
            raise ValueError(f"shardcast: LoRA adapter {name!r}: id {spec.id} (vLLM's lora_int_id is >= 1)")
        if not spec.tensors:
            raise ValueError(f"shardcast: LoRA adapter {name!r} announces no tensors")
        check_config(name, spec.config)
        return spec


@dataclass
class WorkerAdapter:
    """One adapter on one vLLM worker: the buffers its versions land in (checkpoint name -> tensor,
    the whole tensor on every TP rank), its registration, the version it serves, and the tensors of
    that version (cloned from the buffers when it was put into service: what the worker puts back
    after vLLM removes its adapters)."""

    spec: AdapterSpec
    group: str
    buffers: Dict[str, torch.Tensor]
    path: str = ""  # the `shardcast://` path requests name it by
    registration: Any = None
    serving: int = 0  # the version in service, 0: none yet
    committed: Dict[str, torch.Tensor] = field(default_factory=dict)
    received: int = 0  # the version this update session received, 0: none

    def take(self) -> None:
        """Puts the received version into service: its bytes are copied out of the buffers (the
        next sync writes them while this version serves)."""
        self.committed = {name: t.detach().clone() for name, t in self.buffers.items()}
        self.serving, self.received = self.received, 0


def worker_buffers(spec: AdapterSpec) -> Dict[str, torch.Tensor]:
    """Zeroed buffers for every tensor of the adapter, in host memory (vLLM builds an adapter on
    the host and copies it into its GPU slots when a request activates it)."""
    out = {}
    for name, (shape, dtype) in spec.tensors.items():
        dt = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"shardcast: LoRA adapter {spec.name!r}, tensor {name!r}: dtype {dtype!r} is not a "
                             "floating-point torch dtype")
        out[name] = torch.zeros([int(s) for s in shape], dtype=dt)
    return out


def replicated_pieces(spec: AdapterSpec) -> Dict[str, Tuple[List[int], List[int]]]:
    """What one rank holds of the adapter: every tensor whole."""
    return {name: ([0] * len(shape), [int(s) for s in shape]) for name, (shape, _) in spec.tensors.items()}


class ServerNames:
    """The names `vllm serve` serves the trainer's adapters under, so that OpenAI requests name them
    (`"model": "policy"`): the sender names each adapter at each server once the adapter's first
    version is in service there, through the server's /v1/load_lora_adapter route (its path the
    adapter's `shardcast://` path; vLLM keys it by an id of its own, which the workers put back
    after every update, see Installer), and takes the names back at shutdown. A name must not
    reach a server before a version does: vLLM would load it inside an engine step, and an engine
    step that raises ends vLLM's engine. Servers are vLLM's HTTPVLLMWeightSyncClients (`base_url`),
    alone or in a ReplicaClients; other clients (an offline LLM) have no names to give."""

    def __init__(self, destination: str, adapters: Sequence[str], timeout_s: float = 60) -> None:
        self.destination, self.adapters, self.timeout_s = destination, list(adapters), timeout_s
        self.named: Dict[str, List[str]] = {}  # server URL -> the adapters named there

    @staticmethod
    def servers(client: Any, replicas: Optional[Sequence[int]] = None) -> List[str]:
        """The URLs of `client`'s servers (of ReplicaClients: those of `replicas`, else every one)."""
        members = getattr(client, "clients", None)
        if isinstance(members, list):
            members = [members[k] for k in replicas] if replicas is not None else members
        else:
            members = [client]
        return [m.base_url for m in members if isinstance(getattr(m, "base_url", None), str)]

    def _call(self, url: str, route: str, body: Optional[Dict[str, Any]] = None) -> Tuple[int, str]:
        """POSTs `body` (GETs without one) to the server's /v1/`route`: (HTTP status, body text)."""
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        key = os.environ.get("VLLM_API_KEY")
        if key:  # a server started with --api-key (or VLLM_API_KEY) checks it on its /v1 routes
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(f"{url}/v1/{route}", data=data, method="POST" if body is not None else "GET",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise RuntimeError(f"shardcast: vllm serve at {url} refused /v1/{route} (HTTP 401): it checks an API "
                                   "key; give the trainer's process the server's key as VLLM_API_KEY") from e
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"shardcast: vllm serve at {url} did not answer /v1/{route}: "
                               f"{getattr(e, 'reason', e)}") from e

    def _roots(self, url: str) -> Dict[str, Any]:
        """The server's models: name -> where it was loaded from (`root`)."""
        status, text = self._call(url, "models")
        if status != 200:
            raise RuntimeError(f"shardcast: vllm serve at {url}: listing its models failed (HTTP {status}): "
                               f"{text[:400]}")
        return {card.get("id"): card.get("root") for card in _json(text).get("data", []) if isinstance(card, dict)}

    def _check_free(self, url: str, roots: Dict[str, Any], adapter: str) -> None:
        root = roots.get(adapter)
        if root is not None and root != adapter_path(self.destination, adapter):
            raise RuntimeError(f"shardcast: vllm serve at {url} serves a model named {adapter!r} already (from "
                               f"{root!r}): LoRA adapter {adapter!r} cannot be named there; give the adapter "
                               "another name (lora= as a list or dict)")

    def prepare(self, url: str) -> None:
        """Before the server's workers take the adapters: the server can name adapters, no other
        model has one of their names, and it holds none of them from an earlier trainer (a name
        given before its first version would end vLLM's engine at the next request naming it: it is
        taken back). Raises naming the setting, or the name, when not."""
        self.named.pop(url, None)  # a server restarted at the URL, or re-added: named again
        roots = self._roots(url)
        for adapter in self.adapters:
            self._check_free(url, roots, adapter)
            status, text = self._call(url, "unload_lora_adapter", {"lora_name": adapter})
            if status == 200:
                _log.info("shardcast: %s: took back the name of LoRA adapter %r given by an earlier engine, until its "
                          "first version is in service", url, adapter)
            elif status == 404 and "error" not in _json(text):  # the route itself is missing
                raise ValueError(f"shardcast: vllm serve at {url} cannot name LoRA adapters (no "
                                 "/v1/unload_lora_adapter route): start it with --enable-lora and the environment "
                                 "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, so that requests can name the "
                                 f"adapters {self.adapters}")
            elif status != 404:
                raise RuntimeError(f"shardcast: vllm serve at {url}: unloading LoRA adapter {adapter!r} failed "
                                   f"(HTTP {status}): {text[:400]}")

    def name(self, url: str, adapters: Sequence[str]) -> None:
        """Names each of `adapters` (a version of each now in service on the server) at the server,
        unless it is already; raises naming the server and the adapter when the server refuses."""
        todo = [a for a in adapters if a not in self.named.get(url, [])]
        if not todo:
            return
        roots = self._roots(url)
        for adapter in todo:
            self._check_free(url, roots, adapter)
            if adapter not in roots:
                status, text = self._call(url, "load_lora_adapter",
                                          {"lora_name": adapter, "lora_path": adapter_path(self.destination, adapter)})
                if status != 200:
                    raise RuntimeError(f"shardcast: vllm serve at {url} refused to name LoRA adapter {adapter!r} "
                                       f"(HTTP {status}): {text[:400]}")
            self.named.setdefault(url, []).append(adapter)

    def forget(self) -> None:
        """Takes back every name given (the server's workers are about to drop the adapters); a
        server that does not answer is logged, not raised."""
        for url, adapters in self.named.items():
            for adapter in adapters:
                try:
                    status, text = self._call(url, "unload_lora_adapter", {"lora_name": adapter})
                    if status not in (200, 404):
                        raise RuntimeError(f"HTTP {status}: {text[:200]}")
                except Exception as e:
                    _log.warning("shardcast: vllm serve at %s: taking back the name of LoRA adapter %r failed: %s",
                                 url, adapter, e)
        self.named = {}


def _json(text: str) -> Dict[str, Any]:
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class Installer:
    """vLLM's LoRA manager on one worker, driven with in-memory adapters (vLLM 0.32's
    `LRUCacheWorkerLoRAManager` and its `LRUCacheLoRAModelManager`).

    A Shardcast adapter is named by a `shardcast://` path (`adapter_path`). Whenever vLLM does not
    hold it (after vLLM removed its adapters, evicted it from its cache, or a data-parallel
    engine's idle step cleared them), vLLM's load of that path is answered from the version the
    worker serves (`serving`: path -> (spec, tensors)), never from disk. Once an engine put a
    version into service, the path keeps its last version on this worker after that engine shut
    down, until a later engine's first update replaces it (as full weights keep serving the last
    update): vLLM loads a path inside an engine step, which does not survive an error, and a
    request may name the path then (one already accepted, or a name `vllm serve` still gives). A
    path no engine ever served raises, naming the adapter. `check` refuses an adapter the engine
    would not take as vLLM's own load from disk refuses it, and more: every tensor must reach one
    of the model's LoRA layers (vLLM's disk load checks module names only) and fit it.

    vLLM may name one adapter by ids other than the trainer's (`vllm serve` gives the adapters its
    /v1/load_lora_adapter route loads ids of its own): `ids` keeps every id vLLM loaded each path
    under, and an adapter is put back under those (`install`). What outlives an engine (`last`,
    `ids`, and `ours`: every id Shardcast put an adapter under) is kept on vLLM's worker LoRA
    manager, one per worker."""

    def __init__(self, runner: Any, serving) -> None:
        manager = getattr(runner, "lora_manager", None)
        if manager is None or getattr(runner, "lora_config", None) is None:
            raise ValueError("shardcast: LoRA adapters need vLLM started with enable_lora=True (--enable-lora), "
                             "with max_lora_rank at least each adapter's rank")
        self.worker_manager = manager
        self.manager = manager._adapter_manager
        self.lora_config = runner.lora_config
        self.serving = serving
        kept = getattr(manager, "_shardcast_kept", None)
        if kept is None:
            kept = manager._shardcast_kept = {"last": {}, "ids": {}, "ours": set()}
        self.last: Dict[str, Tuple[AdapterSpec, Mapping[str, torch.Tensor]]] = kept["last"]  # path -> last version
        self.ids: Dict[str, set] = kept["ids"]  # shardcast:// path -> the vLLM ids it was loaded under
        self.ours: set = kept["ours"]  # every vLLM id a Shardcast adapter was put under on this worker
        load = manager._load_adapter
        if getattr(load, "_shardcast", None) is not None:
            load = load._shardcast  # a wrapper of an earlier engine: wrap vLLM's own again
        installer = self

        def load_adapter(lora_request):
            path = str(getattr(lora_request, "lora_path", ""))
            if not path.startswith(PATH_SCHEME):
                return load(lora_request)
            model = installer.model_for(path, lora_request.lora_int_id)
            installer.ids.setdefault(path, set()).add(lora_request.lora_int_id)
            installer.ours.add(lora_request.lora_int_id)
            return model

        load_adapter._shardcast = load  # type: ignore[attr-defined]
        manager._load_adapter = load_adapter

    def model_for(self, path: str, adapter_id: int):
        """The LoRAModel vLLM's load of `path` gets: the version in service (or, before this
        engine's first update, the last one an earlier engine served), under `adapter_id`."""
        found = self.serving(path) if self.serving is not None else None
        if found is None:
            found = self.last.get(path)
        if found is None:
            raise ValueError(f"shardcast: no Shardcast LoRA adapter at {path!r} is in service on this worker: a "
                             "request may name an adapter once its first update has finished")
        spec, tensors = found
        return self.model(spec, tensors, adapter_id)

    def helper(self, spec: AdapterSpec):
        from vllm.lora.peft_helper import PEFTHelper

        config = dict(spec.config, vllm_max_position_embeddings=self.worker_manager.max_position_embeddings)
        try:
            helper = PEFTHelper.from_dict(config)
            helper.validate_legal(self.lora_config)
        except ValueError as e:
            raise ValueError(f"shardcast: vLLM refuses LoRA adapter {spec.name!r}: {e}") from e
        return helper

    def model(self, spec: AdapterSpec, tensors: Mapping[str, torch.Tensor], adapter_id: Optional[int] = None):
        """A vLLM LoRAModel of `tensors` (cloned: vLLM scales lora_B in place), as vLLM's load from
        disk builds one."""
        from vllm.lora.lora_model import LoRAModel

        model = self.manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        return LoRAModel.from_lora_tensors(
            spec.id if adapter_id is None else adapter_id, {n: t.detach().clone() for n, t in tensors.items()},
            self.helper(spec), device="cpu", dtype=self.lora_config.lora_dtype,
            model_vocab_size=self.worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))

    def check(self, specs: Sequence[AdapterSpec]) -> None:
        """Every adapter acceptable here (ValueError naming it and why), by a dry run: each is built
        of zeros, installed and removed again, before any request can name it."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        ids = [s.id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"shardcast: LoRA adapter ids {ids}: each adapter needs its own")
        packed = {sub: parent for parent, subs in self.manager.packed_modules_mapping.items() for sub in subs}
        mapper = getattr(self.manager.model, "hf_to_vllm_mapper", None)
        for spec in specs:
            self.helper(spec)  # its configuration first: what vLLM says of it is the clearest reason
            if spec.id in set(self.manager.list_adapters()):
                if spec.id not in self.ours:
                    raise ValueError(f"shardcast: LoRA adapter {spec.name!r}: vLLM holds an adapter of id {spec.id} "
                                     "already; give each Shardcast adapter an id of its own")
                self.manager.remove_adapter(spec.id)  # an earlier engine's adapter: loaded again if named
            for name in spec.tensors:
                if ".experts." in name:
                    raise ValueError(f"shardcast: LoRA adapter {spec.name!r}, tensor {name!r}: adapters of MoE "
                                     "experts are not synced yet (vLLM loads them in a layout of their own)")
                try:
                    module, _ = parse_fine_tuned_lora_name(name, mapper.get_rename_mapper() if mapper else None)
                except ValueError as e:
                    raise ValueError(f"shardcast: LoRA adapter {spec.name!r}: {e}") from e
                head, _, last = module.rpartition(".")
                candidates = {module, f"{head}.{packed[last]}" if last in packed else module}
                if not any(c in self.manager.modules for c in candidates):
                    raise ValueError(f"shardcast: LoRA adapter {spec.name!r}, tensor {name!r}: module {module!r} is "
                                     "none of the model's LoRA layers here (check target_modules against "
                                     "vLLM's supported modules)")
            zeros = worker_buffers(spec)
            try:
                self.manager.add_adapter(self.model(spec, zeros))
                self.manager.activate_adapter(spec.id)
            except Exception as e:  # a shape that does not fit the layer
                raise ValueError(f"shardcast: vLLM cannot install LoRA adapter {spec.name!r}: "
                                 f"{type(e).__name__}: {e}") from e
            finally:
                self.manager.remove_adapter(spec.id)

    def install(self, spec: AdapterSpec, tensors: Mapping[str, torch.Tensor], path: str) -> None:
        """Puts `tensors` into service as the adapter requests name by `path`, replacing what vLLM
        held of it (in vLLM's adapter cache; a request naming it activates it): under the ids vLLM
        loaded `path` under, or `spec.id` before any (each a copy: one per id that requests use,
        as vLLM keeps adapters). Runs between two engine steps."""
        self.last[path] = (spec, tensors)
        for adapter_id in sorted(self.ids.get(path) or {spec.id}):
            lora = self.model(spec, tensors, adapter_id)
            self.manager.remove_adapter(adapter_id)
            self.manager.add_adapter(lora)
            self.ours.add(adapter_id)

    def remove(self, spec: AdapterSpec, path: str) -> None:
        """Takes the adapter out of vLLM's cache under every id it was served by (a later engine may
        take the ids; a request naming the path meanwhile gets its last version, see above)."""
        for adapter_id in {spec.id} | self.ids.get(path, set()):
            self.manager.remove_adapter(adapter_id)


__all__ = ["AdapterSpec", "ID_BASE", "Installer", "LORA_COMPONENTS", "PATH_SCHEME", "ServerNames", "WorkerAdapter", "adapter_group",
           "adapter_path", "check_adapter_name", "check_config", "checkpoint_name", "json_config", "peft_adapters",
           "replicated_pieces", "resolve_adapters", "worker_buffers"]
