"""The names a trainer's parameters are registered and announced under: the checkpoint's, which
vLLM's `load_weights` takes (and maps to its own fused parameters through the model's own
stacked/packed mappings: shardcast.vllm.probe asks it). Wrappers that training adds to a module
put components in the names that no checkpoint has; they are taken out here:

- `_orig_mod` (torch.compile) and `_checkpoint_wrapped_module` (activation checkpointing),
  anywhere in a name;
- a leading `module.` of DistributedDataParallel, when the module given is one (compiled or not).

A `name_map` (a dict, or a function of the cleaned name) then renames what remains, for trainers
whose own names are not the checkpoint's; a name mapped to None is a trainer-only parameter (a
value head) and is not registered. Two parameters ending up under one name is an error naming
both. FSDP1 is refused (its parameters are flattened shards: their shapes are not the
checkpoint's); FSDP2 (`fully_shard`) is what the trainer engine registers. No vLLM import: usable
and testable without it."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Union

WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})

NameMap = Union[Mapping[str, str], Callable[[str], str], None]


def strip_wrappers(name: str, data_parallel: bool = False) -> str:
    """`name` without the components training wrappers add (see the module's docstring)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    if data_parallel and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def checkpoint_names(names: Iterable[str], name_map: NameMap = None, data_parallel: bool = False) -> Dict[str, str]:
    """Each parameter name -> the checkpoint name it is registered under (parameters `name_map`
    maps to None are left out). Raises ValueError when two parameters map to one name, or a name
    maps to an empty one."""
    out: Dict[str, str] = {}
    seen: Dict[str, str] = {}
    for name in names:
        clean = strip_wrappers(name, data_parallel)
        if callable(name_map):
            target = name_map(clean)
        elif name_map is not None:
            target = name_map.get(clean, clean)
        else:
            target = clean
        if target is None and name_map is not None:
            continue  # a trainer-only parameter
        if not isinstance(target, str) or not target:
            raise ValueError(f"shardcast: parameter {name!r} maps to no checkpoint name ({target!r})")
        if target in seen:
            raise ValueError(f"shardcast: parameters {seen[target]!r} and {name!r} both map to checkpoint name "
                             f"{target!r}; one tensor per name")
        seen[target] = name
        out[name] = target
    return out


def is_data_parallel(module: object) -> bool:
    """Whether `module` is torch's DistributedDataParallel (or DataParallel): names then start with
    `module.`."""
    inner = getattr(module, "_orig_mod", module)  # torch.compile(DDP(model))
    return type(inner).__name__ in ("DistributedDataParallel", "DataParallel")


def refuse_fsdp1(module: object) -> None:
    """ValueError when `module` is, or holds, an FSDP1 FullyShardedDataParallel: its parameters are
    flattened local shards whose names and shapes are not the checkpoint's."""
    modules = module.modules() if hasattr(module, "modules") else [module]
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in modules):
        raise ValueError("shardcast: FSDP1 (FullyShardedDataParallel) flattens parameters into shards whose "
                         "shapes are not the checkpoint's; shard the model with FSDP2 (torch.distributed.fsdp."
                         "fully_shard), whose DTensors are registered in place")


__all__ = ["WRAPPER_COMPONENTS", "NameMap", "checkpoint_names", "is_data_parallel", "refuse_fsdp1", "strip_wrappers"]
