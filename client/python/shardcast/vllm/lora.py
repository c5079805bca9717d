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

Worker side (`WorkerAdapter`): bytes land in buffers of the worker's own, never in what vLLM
serves. When an update finishes, a new adapter is built from them by vLLM's own
`LoRAModel.from_lora_tensors` (what its load from disk runs on the file's tensors) and replaces
the old one between two engine steps: serving never sees half an adapter, a failed update leaves
the previous one serving. vLLM removes every adapter after each weight update
(`reset_lora_state`, for adapters computed against replaced base weights); the worker puts its
adapters back right after (shardcast.vllm.session), pinned, so they are never evicted and never
looked for on disk.

Every TP rank lands each adapter whole and vLLM's LoRA layers cut it (`set_lora`), as they cut an
adapter loaded from disk: the network carries each byte once per node, and the node's daemon fans
it out to the node's ranks. No vLLM import at module level: the trainer's half is usable without
vLLM."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

# PEFT's LoRA parameter components; the adapter's name follows one of them in a parameter's name.
LORA_COMPONENTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
# Where requests name a Shardcast adapter: vLLM's LoRARequest needs a path, which it reads only for
# an adapter it does not hold (never for a pinned one).
PATH_SCHEME = "shardcast://"


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
    """Adapter name -> vLLM id from the trainer's `lora=`: True (every adapter of the model, ids 1..n
    in the model's order), a name or a list of names (ids in that order), or a dict name -> id (ids
    >= 1, distinct). ValueError naming what is wrong."""
    if lora is True:
        names = list(available)
        return {check_adapter_name(n): i for i, n in enumerate(names, start=1)}
    if isinstance(lora, str):
        lora = [lora]
    if isinstance(lora, Mapping):
        ids = {check_adapter_name(n): i for n, i in lora.items()}
    elif isinstance(lora, (list, tuple)):
        ids = {check_adapter_name(n): i for i, n in enumerate(lora, start=1)}
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
    registration: Any = None
    serving: int = 0  # the version in service, 0: none yet
    committed: Dict[str, torch.Tensor] = field(default_factory=dict)
    received: int = 0  # the version this update session received, 0: none

    def take(self) -> None:
        """Puts the received version into service: its bytes are copied out of the buffers (the
        next sync writes them while this version serves)."""
        self.committed = {name: t.detach().clone() for name, t in self.buffers.items()}
        self.serving, self.received = self.received, 0


def worker_buffers(spec: AdapterSpec, device: Any) -> Dict[str, torch.Tensor]:
    """Zeroed buffers for every tensor of the adapter, on the worker's device."""
    out = {}
    for name, (shape, dtype) in spec.tensors.items():
        dt = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"shardcast: LoRA adapter {spec.name!r}, tensor {name!r}: dtype {dtype!r} is not a "
                             "floating-point torch dtype")
        out[name] = torch.zeros([int(s) for s in shape], dtype=dt, device=device)
    return out


def replicated_pieces(spec: AdapterSpec) -> Dict[str, Tuple[List[int], List[int]]]:
    """What one rank holds of the adapter: every tensor whole."""
    return {name: ([0] * len(shape), [int(s) for s in shape]) for name, (shape, _) in spec.tensors.items()}


class Installer:
    """vLLM's LoRA manager on one worker, driven with in-memory adapters (vLLM 0.32's
    `LRUCacheWorkerLoRAManager` and its `LRUCacheLoRAModelManager`). `check` refuses an adapter the
    engine would not take as vLLM's own load from disk refuses it, and more: every tensor must
    reach one of the model's LoRA layers (vLLM's disk load checks module names only) and fit it."""

    def __init__(self, runner: Any) -> None:
        manager = getattr(runner, "lora_manager", None)
        if manager is None or getattr(runner, "lora_config", None) is None:
            raise ValueError("shardcast: LoRA adapters need vLLM started with enable_lora=True (--enable-lora), "
                             "with max_lora_rank at least each adapter's rank")
        self.worker_manager = manager
        self.manager = manager._adapter_manager
        self.lora_config = runner.lora_config

    def helper(self, spec: AdapterSpec):
        from vllm.lora.peft_helper import PEFTHelper

        config = dict(spec.config, vllm_max_position_embeddings=self.worker_manager.max_position_embeddings)
        try:
            helper = PEFTHelper.from_dict(config)
            helper.validate_legal(self.lora_config)
        except ValueError as e:
            raise ValueError(f"shardcast: vLLM refuses LoRA adapter {spec.name!r}: {e}") from e
        return helper

    def model(self, spec: AdapterSpec, tensors: Mapping[str, torch.Tensor]):
        """A vLLM LoRAModel of `tensors` (cloned: vLLM scales lora_B in place), as vLLM's load from
        disk builds one."""
        from vllm.lora.lora_model import LoRAModel

        model = self.manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        return LoRAModel.from_lora_tensors(
            spec.id, {n: t.detach().clone() for n, t in tensors.items()}, self.helper(spec), device="cpu",
            dtype=self.lora_config.lora_dtype, model_vocab_size=self.worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))

    def check(self, specs: Sequence[AdapterSpec]) -> None:
        """Every adapter acceptable here (ValueError naming it and why), by a dry run: each is built
        of zeros, installed and removed again, before any request can name it."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        slots, capacity = self.manager.lora_slots, self.manager.capacity
        if len(specs) > min(slots, capacity):
            raise ValueError(f"shardcast: {len(specs)} LoRA adapters, each pinned in vLLM for good, but vLLM holds "
                             f"{slots} at once (max_loras) and {capacity} in all (max_cpu_loras); raise them")
        ids = [s.id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"shardcast: LoRA adapter ids {ids}: each adapter needs its own")
        packed = {sub: parent for parent, subs in self.manager.packed_modules_mapping.items() for sub in subs}
        for spec in specs:
            self.helper(spec)  # its configuration first: what vLLM says of it is the clearest reason
            held = set(self.manager.list_adapters())
            if spec.id in held:
                raise ValueError(f"shardcast: LoRA adapter {spec.name!r}: vLLM holds an adapter of id {spec.id} "
                                 "already; give each Shardcast adapter an id of its own")
            mapper = getattr(self.manager.model, "hf_to_vllm_mapper", None)
            for name in spec.tensors:
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
            zeros = worker_buffers(spec, "cpu")
            try:
                self.manager.add_adapter(self.model(spec, zeros))
                self.manager.activate_adapter(spec.id)
            except Exception as e:  # a shape that does not fit the layer, a rank over max_lora_rank
                raise ValueError(f"shardcast: vLLM cannot install LoRA adapter {spec.name!r}: "
                                 f"{type(e).__name__}: {e}") from e
            finally:
                self.manager.remove_adapter(spec.id)

    def install(self, spec: AdapterSpec, tensors: Mapping[str, torch.Tensor]) -> None:
        """Puts `tensors` into service as adapter `spec.id`, replacing what vLLM held under that id,
        pinned (never evicted, never loaded from its path). Runs between two engine steps."""
        lora = self.model(spec, tensors)
        self.manager.remove_adapter(spec.id)
        self.manager.add_adapter(lora)
        self.manager.pin_adapter(spec.id)

    def holds(self, adapter_id: int) -> bool:
        return adapter_id in set(self.manager.list_adapters())


__all__ = ["AdapterSpec", "Installer", "LORA_COMPONENTS", "PATH_SCHEME", "WorkerAdapter", "adapter_group",
           "adapter_path", "check_adapter_name", "check_config", "checkpoint_name", "json_config", "peft_adapters",
           "replicated_pieces", "resolve_adapters", "worker_buffers"]
