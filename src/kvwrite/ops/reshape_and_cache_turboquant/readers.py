"""turboquant_gather_cache: read TurboQuant slots back to float32 keys and values (SPEC §10.2
"Reader"), every step one IEEE float32 operation in §7.1's trees, as the writer's reference."""

from __future__ import annotations

import torch

from ...formats import turboquant_preset
from ...validation import check_in_range, check_token_indices, require_same_device, require_tensor
from ...validation import shape_str as _shape
from .op import check_slot_cache, check_tables
from .reference import correctly_rounded_sqrt, tree_sum, unpack_codes

__all__ = ["turboquant_gather_cache", "NORM_EPS"]

# The renormalization's ε: float32(1e-16), bits 0x24E69595.
NORM_EPS = 1e-16


def _f16(field: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes ``[..., 2]`` as the float32 value of their fp16."""
    return field.contiguous().view(torch.float16)[..., 0].float()


def turboquant_gather_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype,
                            head_size: int, centroids: torch.Tensor | None = None,
                            PiT: torch.Tensor | None = None, *, unrotate: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)``, float32 ``[N, H, D]`` each, of the ``N = slot_mapping.numel()`` slots
    (every one in range, else ValueError naming ``slot_mapping``; checking syncs).

    k8v4 keys are the e4m3fn codes decoded; MSE keys ``RN(norm · c_i)`` of the centroids
    ``c_i = centroids[idx_i]`` (renormalized for the ``_nc`` presets), then with ``unrotate``
    multiplied back by ``PiT``'s transpose in §7.1's tree (``unrotate=False``: the rotated key).
    Values ``RN(q_i · scale + zero)``. ``centroids`` float32 ``[2^b]`` (MSE presets) and ``PiT``
    float32 ``[D, D]`` (MSE presets with ``unrotate``) on the cache's device.
    """
    require_tensor("kv_cache", kv_cache)
    require_tensor("slot_mapping", slot_mapping)
    preset = turboquant_preset(kv_cache_dtype)
    if isinstance(head_size, bool) or not isinstance(head_size, int):
        raise TypeError(f"head_size: expected an int, got {type(head_size).__name__}")
    slot = preset.at(head_size)
    check_slot_cache(kv_cache)
    if kv_cache.shape[3] < slot.slot_size:
        raise ValueError(f"kv_cache: expected a last dim S >= slot_size = {slot.slot_size} "
                         f"(kv_cache_dtype={slot.name!r}, head_size {head_size}), got shape "
                         f"{_shape(kv_cache)}")
    check_token_indices("slot_mapping", slot_mapping)
    device = kv_cache.device
    require_same_device(device, "kv_cache", (("slot_mapping", slot_mapping),))
    if slot.mse:
        tables = {"centroids": centroids}
        if unrotate:
            tables["PiT"] = PiT
        check_tables(slot, device, **tables)
    nb, bs, h = kv_cache.shape[:3]
    slots = slot_mapping.long()
    check_in_range("slot_mapping", slots, (slots < 0) | (slots >= nb * bs),
                   f"expected slots in [0, num_blocks * block_size = {nb * bs})")
    rows = kv_cache[..., :slot.slot_size][slots // bs, slots % bs]  # [N, H, slot_size]
    d = head_size

    if slot.mse:
        idx = unpack_codes(rows[..., :slot.key_index_bytes], slot.key_bits, d)
        c = centroids[idx]
        if slot.norm_correction:
            w = tree_sum(c * c)
            root = correctly_rounded_sqrt(w + torch.full_like(w, NORM_EPS))
            r = torch.ones_like(root) / root
            c = c * r[..., None]
        norm = _f16(rows[..., slot.norm_offset:slot.norm_offset + 2])
        key = norm[..., None] * c
        if unrotate:
            key = tree_sum(key[..., None, :] * PiT.float()[None, None])
    else:
        key = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()

    q = unpack_codes(rows[..., slot.value_offset:slot.scale_offset], slot.value_bits, d).float()
    scale = _f16(rows[..., slot.scale_offset:slot.scale_offset + 2])
    zero = _f16(rows[..., slot.zero_offset:slot.zero_offset + 2])
    value = q * scale[..., None] + zero[..., None]
    return key.reshape(-1, h, d), value.reshape(-1, h, d)
