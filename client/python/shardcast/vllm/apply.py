"""Puts synced bytes into service: a processed parameter's bytes land in a staging tensor in its
loader's layout (shardcast.vllm.layout), and this re-runs vLLM's own processing for its layer
from there, as vLLM's layerwise reload does after `load_weights`: the layer is restored to its
loader-layout parameters, those are filled from the staging set, the layer's quantisation method
processes them (`process_weights_after_loading`: repacking, prepacking, quantising), and the
results are copied into the tensors the kernels hold, so their storage (and any CUDA graph
captured over it) stays the same."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Mapping

import torch

from shardcast.vllm.probe import ProbeError


def _machinery():
    try:
        from vllm.model_executor.model_loader.reload import layerwise, meta, utils
        return (layerwise.get_layerwise_info, meta.restore_layer_on_meta, meta.materialize_layer,
                utils.get_layer_params_buffers, layerwise._copy_and_restore_kernel_tensors)
    except (ImportError, AttributeError) as e:
        raise ProbeError(f"this vLLM's layerwise reload machinery differs from 0.32's ({e}): processed "
                         "parameters cannot be put into service") from None


@torch.no_grad()
def run_processing(layer: torch.nn.Module) -> None:
    """vLLM's processing of `layer` once its loader-layout parameters hold new values: its
    quantisation method's `process_weights_after_loading`, as a load runs it.

    One difference from vLLM's own weight-update path: a FusedMoE layer whose experts set
    themselves up from the layer (vLLM 0.32's CPU experts prepack `w13_weight` and `w2_weight`
    into their grouped-GEMM layout there) gets that setup again. vLLM runs it only on the first
    load (`UnquantizedFusedMoEMethod._setup_kernel`), so after its own `reload_weights` the CPU
    kernels compute with unpacked weights; the tests saw a reload of unchanged weights change the
    served tokens."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    quant_method = getattr(layer, "quant_method", None)
    if not isinstance(quant_method, QuantizeMethodBase):
        return
    # Only where vLLM skips it: the unquantized method on an update (a kernel set up already).
    # Quantized methods run the experts' setup themselves every time; a second run would
    # transform their weights twice.
    skipped = _is_unquantized_moe(quant_method) and getattr(quant_method, "moe_kernel", None) is not None
    quant_method.process_weights_after_loading(layer)
    experts = getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)
    if skipped and experts is not None and _sets_up_from_layer(experts):
        experts.process_weights_after_loading(layer)
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()


def _is_unquantized_moe(quant_method) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    return isinstance(quant_method, UnquantizedFusedMoEMethod)


def _sets_up_from_layer(experts) -> bool:
    """Whether a FusedMoE experts implementation overrides the (no-op) setup from the layer."""
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:
        return False
    base = getattr(FusedMoEExperts, "process_weights_after_loading", None)
    return base is not None and getattr(type(experts), "process_weights_after_loading", base) is not base


@torch.no_grad()
def process_staged(model: torch.nn.Module, staging: Mapping[str, torch.Tensor]) -> List[str]:
    """Re-runs vLLM's processing for every layer with a parameter in `staging` (full parameter
    name -> its loader-layout tensor: a staging tensor, or the live parameter itself where it is in
    that layout; RankMemory.reprocess). Every loader-layout parameter of such a layer must be given
    (a parameter nothing lands in would be processed from garbage): otherwise ProbeError naming it.
    Returns the layers processed."""
    (get_info, restore_on_meta, materialize, params_buffers, copy_back) = _machinery()
    modules = dict(model.named_modules())
    by_layer: Dict[str, Dict[str, torch.Tensor]] = defaultdict(dict)
    for full, tensor in staging.items():
        prefix, _, local = full.rpartition(".")
        by_layer[prefix][local] = tensor
    done = []
    for prefix, staged in by_layer.items():
        layer = modules[prefix]
        info = get_info(layer)
        recorded = info.restore_metadata[0]
        unstaged = sorted(set(recorded) - set(staged))
        if unstaged:
            raise ProbeError(f"layer {prefix!r}: parameter(s) {unstaged} are processed with it but nothing "
                             "lands in them; the layer cannot be re-processed from synced bytes alone")
        info.kernel_tensors = params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_on_meta(layer, info)
        materialize(layer, info)
        for local, tensor in staged.items():
            getattr(layer, local).data.copy_(tensor)
        run_processing(layer)
        copy_back(layer, info)
        info.reset()
        done.append(prefix)
    return done
