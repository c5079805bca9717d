"""Block-scaled fp8 as the daemons make it (v1::BlockScale, docs/delta.md): a reference in torch,
for checking what a sync delivered and for dequantising it.

    q, scale = block_quantize(w, (128, 128))        # float8_e4m3fn values, float32 scales
    w_approx = block_dequantize(q, scale, (128, 128))
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple


def _expand(scale: Any, block: Sequence[int], shape: Sequence[int]) -> Any:
    out = scale
    for d, b in enumerate(block):
        out = out.repeat_interleave(int(b), dim=d).narrow(d, 0, int(shape[d]))
    return out


def block_quantize(x: Any, block: Sequence[int] = (128, 128), pow2: bool = False) -> Tuple[Any, Any]:
    """torch's recipe, per block of `block` elements (edge blocks cut at the tensor's edge):
    scale = amax / 448 (1 for an all-zero block), rounded up to a power of two with `pow2`;
    q = (x / scale).clamp(-448, 448) as float8_e4m3fn. Returns (q, scale)."""
    import torch

    xf = x.float()
    block = [int(b) for b in block]
    if len(block) != xf.dim():
        block = [1] * (xf.dim() - len(block)) + block
    blocks = [-(-s // b) for s, b in zip(xf.shape, block)]
    pad = torch.zeros([n * b for n, b in zip(blocks, block)])
    pad[tuple(slice(0, s) for s in xf.shape)] = xf.abs()
    view = []
    for n, b in zip(blocks, block):
        view += [n, b]
    amax = pad.view(view).amax(dim=tuple(range(1, 2 * len(block), 2)))
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    if pow2:
        m, e = torch.frexp(scale)
        one = torch.ones_like(scale)
        pow2_scale = torch.where(m == 0.5, torch.ldexp(one, e - 1), torch.ldexp(one, e))
        scale = torch.where(torch.isfinite(scale), pow2_scale, scale)  # inf and NaN stay
    q = (xf / _expand(scale, block, xf.shape)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def block_dequantize(q: Any, scale: Any, block: Sequence[int] = (128, 128)) -> Any:
    """float32 values of fp8 `q` with per-block `scale` (what an fp8 engine computes with)."""
    block = [int(b) for b in block]
    if len(block) != q.dim():
        block = [1] * (q.dim() - len(block)) + block
    return q.float() * _expand(scale, block, q.shape)


def scale_shape(offsets: Sequence[int], sizes: Sequence[int], block: Sequence[int]) -> Tuple[int, ...]:
    """The shape of the scale buffer a rank holding the part [offsets, offsets + sizes) of a
    block-scaled tensor registers: per dim, blocks `start // block` to `ceil(end / block) - 1`
    (the blocks its part touches; a block its part shares with another rank's is in both).
    `block` is one size per dim, or the last dims' sizes (1 before them)."""
    block = [int(b) for b in block]
    if len(block) < len(sizes):
        block = [1] * (len(sizes) - len(block)) + block
    if len(block) != len(sizes) or len(offsets) != len(sizes):
        raise ValueError(f"a part of {len(sizes)} dims, {len(offsets)} offsets and a block of {len(block)} sizes")
    return tuple(-(-(int(o) + int(s)) // b) - int(o) // b for o, s, b in zip(offsets, sizes, block))
