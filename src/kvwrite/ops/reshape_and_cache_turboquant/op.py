"""reshape_and_cache_turboquant: the public op, vLLM's drop-in ``turboquant_store``, their
validation and the torch.compile custom op (the contract: SPEC §10.1-10.2, §10.4)."""

from __future__ import annotations

import torch

from ... import registry
from ...dtypes import INPUT_DTYPES
from ...formats import TurboQuantLayout, TurboQuantPreset, TurboQuantSlot, turboquant_preset
from ...validation import (
    check_like,
    check_mutation_safe,
    check_token_indices,
    require_same_device,
    require_tensor,
)
from ...validation import shape_str as _shape

__all__ = ["OP", "validate", "select_implementation", "reshape_and_cache_turboquant",
           "turboquant_store", "store_preset", "check_tables", "turboquant_layout"]

OP = "reshape_and_cache_turboquant"


def turboquant_layout(head_size: int, kv_cache_dtype) -> TurboQuantLayout:
    """The slot of preset ``kv_cache_dtype`` at ``head_size`` (SPEC §10.1): ``(key_bits,
    value_bits, norm_correction, key_packed_size, value_data_bytes, slot_size,
    slot_size_aligned)``; ValueError naming the argument the preset cannot take."""
    return turboquant_preset(kv_cache_dtype).at(head_size).layout


def _check_input(name: str, t: torch.Tensor, preset: TurboQuantPreset) -> None:
    if t.dim() != 3:
        raise ValueError(f"{name}: expected 3 dims [num_tokens, num_heads, head_size], got shape "
                         f"{_shape(t)}")
    if t.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
    if t.shape[1] < 1 or t.shape[2] < 1:
        raise ValueError(f"{name}: expected num_heads >= 1 and head_size >= 1, got shape "
                         f"{_shape(t)}")
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise ValueError(f"{name}: expected a unit-stride last dim, got strides "
                         f"{tuple(t.stride())}")
    why = preset.head_size_error(t.shape[2])
    if why is not None:
        raise ValueError(f"{name}: {why} (shape {_shape(t)})")


def check_slot_cache(kv_cache: torch.Tensor) -> None:
    """The slot cache of the write and the reader: uint8, 4 dims
    ``[num_blocks, block_size, num_heads, S]``."""
    if kv_cache.dim() != 4:
        raise ValueError(f"kv_cache: expected 4 dims [num_blocks, block_size, num_heads, S], got "
                         f"shape {_shape(kv_cache)}")
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache: expected dtype torch.uint8, got {kv_cache.dtype}")


def check_tables(slot: TurboQuantSlot, device: torch.device, **tables) -> None:
    """The MSE presets' tables, each given by its name (``PiT``: float32 ``[D, D]``;
    ``midpoints``: float32 ``[2^b - 1]``; ``centroids``: float32 ``[2^b]``; any strides), on
    ``device``; TypeError/ValueError naming the table otherwise (None: missing)."""
    d, b = slot.head_size, slot.key_bits
    want = {"PiT": ((d, d), f"[D, D] = [{d}, {d}]"),
            "midpoints": ((2 ** b - 1,), f"[2^b - 1] = [{2 ** b - 1}] (b = {b})"),
            "centroids": ((2 ** b,), f"[2^b] = [{2 ** b}] (b = {b})")}
    for name, t in tables.items():
        shape, text = want[name]
        if t is None:
            raise ValueError(f"{name}: kv_cache_dtype={slot.name!r} rotates and quantizes keys "
                             f"to a codebook and needs a float32 {text} tensor, got None")
        require_tensor(name, t)
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {text} for kv_cache_dtype={slot.name!r} "
                             f"and head_size {d}, got {_shape(t)}")
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (that of kv_cache), got "
                             f"{t.device}")


def validate(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT=None, midpoints=None
             ) -> TurboQuantSlot:
    """Check every argument of :func:`reshape_and_cache_turboquant`; return the preset's slot
    at the head size. Raises TypeError/ValueError naming the argument, what was expected and
    what came, before anything is written."""
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache),
                    ("slot_mapping", slot_mapping)):
        require_tensor(name, t)
    preset = turboquant_preset(kv_cache_dtype)
    _check_input("key", key, preset)
    _check_input("value", value, preset)
    check_like("value", value, "key", key, "dtype", "shape")
    num_heads, head_size = key.shape[1], key.shape[2]
    slot = preset.at(head_size)

    check_slot_cache(kv_cache)
    if kv_cache.shape[2] != num_heads:
        raise ValueError(f"kv_cache: expected {num_heads} heads (those of key) in dim 2, got "
                         f"shape {_shape(kv_cache)}")
    if kv_cache.shape[3] < slot.slot_size:
        raise ValueError(f"kv_cache: expected a last dim S >= slot_size = {slot.slot_size} "
                         f"(kv_cache_dtype={slot.name!r}, head_size {head_size}), got shape "
                         f"{_shape(kv_cache)}")
    if kv_cache.shape[3] > 1 and kv_cache.stride(3) != 1:
        raise ValueError(f"kv_cache: expected a unit-stride last dim, got strides "
                         f"{tuple(kv_cache.stride())}")

    check_token_indices("slot_mapping", slot_mapping, key.shape[0], "key.shape[0]")
    device = kv_cache.device
    require_same_device(device, "kv_cache", (("key", key), ("value", value),
                                             ("slot_mapping", slot_mapping)))
    if slot.mse:
        check_tables(slot, device, PiT=PiT, midpoints=midpoints)
    # Only [..., :slot_size] is written: the pad byte (and any bytes after it) never.
    check_mutation_safe(
        outputs=(("kv_cache", kv_cache[..., :slot.slot_size]),),
        inputs=(("key", key), ("value", value), ("slot_mapping", slot_mapping),
                ("PiT", PiT if slot.mse else None), ("midpoints", midpoints if slot.mse else None)))
    return slot


def select_implementation(key, kv_cache, slot: TurboQuantSlot,
                          implementation: str | None = None) -> registry.ImplInfo:
    """The named implementation, or the preferred one that can run this case; raises if none can."""
    return registry.select(OP, (key, kv_cache, slot), implementation)


@registry.custom_op(OP, mutates=("kv_cache",))
def reshape_and_cache_turboquant(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, kv_cache_dtype: str,
                                 PiT: torch.Tensor | None = None,
                                 midpoints: torch.Tensor | None = None, *,
                                 implementation: str | None = None) -> None:
    """Write each (token, head) of ``key`` and ``value`` into one TurboQuant slot of
    ``kv_cache``; mutates ``kv_cache[..., :slot_size]`` of the written slots only.

    ``kv_cache_dtype``: "turboquant_k8v4" (e4m3fn key codes, 4-bit values),
    "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc" (keys rotated by ``PiT``,
    quantized to the codebook whose ``midpoints`` are given, with their fp16 norm; 4- or 3-bit
    values with an fp16 scale and zero). ``key``/``value`` ``[T_pad, H, D]`` float16, bfloat16
    or float32, same dtype and shape, unit last stride; ``kv_cache`` uint8 logical
    ``[num_blocks, block_size, H, S]``, ``S >= slot_size``, unit last stride, other strides free
    (vLLM's ``(num_blocks, H, block_size, slot_size_aligned)`` allocation ``.transpose(1, 2)``);
    ``slot_mapping`` ``[T]`` int64 or int32, negative and out-of-range slots skipped; ``PiT``
    float32 ``[D, D]`` and ``midpoints`` float32 ``[2^b - 1]`` on the device (MSE presets; k8v4
    ignores them). Every arithmetic step is fixed (SPEC §10.2), so the torch, Triton and CUDA
    implementations write the same bytes. ``T == 0`` is a no-op.
    """
    slot = validate(key, value, kv_cache, slot_mapping, kv_cache_dtype, PiT, midpoints)
    info = select_implementation(key, kv_cache, slot, implementation)
    if slot_mapping.numel() == 0:
        return
    if not slot.mse:
        PiT = midpoints = None
    info.run(key, value, kv_cache, slot_mapping, slot, PiT, midpoints)


# vLLM's launcher arguments (key_fp8, mse_bits, value_quant_bits) -> the preset; mse_bits is
# not read with fp8 keys.
_STORE_PRESETS = {(False, 4, 4): "turboquant_4bit_nc", (False, 3, 4): "turboquant_k3v4_nc",
                  (False, 3, 3): "turboquant_3bit_nc"}


def store_preset(mse_bits, value_quant_bits, key_fp8=False) -> str:
    """The preset of vLLM's ``triton_turboquant_store`` arguments; ValueError naming them where
    none is."""
    if bool(key_fp8) and value_quant_bits == 4:
        return "turboquant_k8v4"
    name = _STORE_PRESETS.get((bool(key_fp8), mse_bits, value_quant_bits))
    if name is None:
        raise ValueError(f"mse_bits, value_quant_bits: expected (key_fp8, mse_bits, "
                         f"value_quant_bits) of a preset: (True, any, 4), (False, 4, 4), "
                         f"(False, 3, 4) or (False, 3, 3), got ({bool(key_fp8)}, {mse_bits!r}, "
                         f"{value_quant_bits!r})")
    return name


def turboquant_store(key, value, kv_cache, slot_mapping, PiT, midpoints, mse_bits,
                     key_packed_size, value_quant_bits, key_fp8=False, kv_group_size=None, *,
                     implementation: str | None = None) -> None:
    """vLLM's ``triton_turboquant_store`` arguments: the preset of ``(key_fp8, mse_bits,
    value_quant_bits)`` (``(True, any, 4)``: k8v4; ``(False, 4, 4)``, ``(False, 3, 4)``,
    ``(False, 3, 3)``: 4bit_nc, k3v4_nc, 3bit_nc), then :func:`reshape_and_cache_turboquant`.
    ``key_packed_size`` must be the preset's KPS at the key's head size; ``kv_group_size`` 4 with
    MSE keys and 4-bit values (a page-plane layout not written here) is refused."""
    name = store_preset(mse_bits, value_quant_bits, key_fp8)
    preset = turboquant_preset(name)
    require_tensor("key", key)
    if key.dim() != 3:
        raise ValueError(f"key: expected 3 dims [num_tokens, num_heads, head_size], got shape "
                         f"{_shape(key)}")
    why = preset.head_size_error(key.shape[2])
    if why is not None:
        raise ValueError(f"key: {why} (shape {_shape(key)})")
    kps = preset.at(key.shape[2]).key_packed_size
    if key_packed_size != kps:
        raise ValueError(f"key_packed_size: expected {kps}, the key bytes of {name!r} at "
                         f"head_size {key.shape[2]}, got {key_packed_size!r}")
    if preset.mse and preset.value_bits == 4 and kv_group_size == 4:
        raise ValueError(f"kv_group_size: expected None or a size other than 4 for {name!r}: "
                         f"vLLM's kv_group_size=4 page-plane (qgroup4) layout is not written "
                         f"here, got 4")
    reshape_and_cache_turboquant(key, value, kv_cache, slot_mapping, name, PiT, midpoints,
                                 implementation=implementation)
