"""The names a trainer's parameters are registered and announced under: the checkpoint's, which
vLLM's `load_weights` takes (and maps to its own fused parameters through the model's own
stacked/packed mappings: shardcast.vllm.probe asks it). Wrappers that training adds to a module
put components in the names that no checkpoint has; they are taken out here:

- `_orig_mod` (torch.compile), `_fsdp_wrapped_module` (FSDP1), `_checkpoint_wrapped_module`
  (activation checkpointing), anywhere in a name;
- a leading `module.` of DistributedDataParallel, when the module given is one.

A `name_map` (a dict, or a function of the cleaned name) then renames what remains, for trainers
whose own names are not the checkpoint's. Two parameters ending up under one name is an error
naming both. No vLLM import: usable and testable without it."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Union

WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

NameMap = Union[Mapping[str, str], Callable[[str], str], None]


def strip_wrappers(name: str, data_parallel: bool = False) -> str:
    """`name` without the components training wrappers add (see the module's docstring)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    if data_parallel and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def checkpoint_names(names: Iterable[str], name_map: NameMap = None, data_parallel: bool = False) -> Dict[str, str]:
    """Each parameter name -> the checkpoint name it is registered under. Raises ValueError when
    two parameters map to one name, or a name maps to an empty one."""
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
    return type(module).__name__ in ("DistributedDataParallel", "DataParallel")


__all__ = ["WRAPPER_COMPONENTS", "NameMap", "checkpoint_names", "is_data_parallel", "strip_wrappers"]
