"""Model presets (KV heads × head size) and tensor-parallel division of the KV heads.

Each preset is taken from the model's public ``config.json`` on the Hugging Face Hub:
``num_key_value_heads``, and ``head_dim`` where the config has it, else
``hidden_size / num_attention_heads``. MLA models (DeepSeek-V2/V3) cache a latent vector instead
of per-head K and V, so they have no preset here.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ModelPreset", "MODELS", "get_model", "heads_per_rank"]


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str
    hf_id: str
    num_kv_heads: int
    head_dim: int
    source: str  # the config.json fields the numbers come from


MODELS: dict[str, ModelPreset] = {p.name: p for p in (
    # hidden_size 4096 / num_attention_heads 32 = head_dim 128; num_key_value_heads 8.
    ModelPreset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 8, 128,
                "num_key_value_heads=8, head_dim=128 (4096 / 32 heads)"),
    # hidden_size 8192 / 64 heads = 128; num_key_value_heads 8.
    ModelPreset("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 8, 128,
                "num_key_value_heads=8, head_dim=128 (8192 / 64 heads)"),
    # hidden_size 16384 / 128 heads = 128; num_key_value_heads 8.
    ModelPreset("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 8, 128,
                "num_key_value_heads=8, head_dim=128 (16384 / 128 heads)"),
    # hidden_size 4096 / 32 heads = 128; num_key_value_heads 8.
    ModelPreset("mistral-7b", "mistralai/Mistral-7B-v0.1", 8, 128,
                "num_key_value_heads=8, head_dim=128 (4096 / 32 heads)"),
    # hidden_size 3584 / 28 heads = 128; num_key_value_heads 4.
    ModelPreset("qwen2.5-7b", "Qwen/Qwen2.5-7B", 4, 128,
                "num_key_value_heads=4, head_dim=128 (3584 / 28 heads)"),
    # head_dim 128 (explicit in the config); num_key_value_heads 8 (32 query heads).
    ModelPreset("qwen3-8b", "Qwen/Qwen3-8B", 8, 128, "num_key_value_heads=8, head_dim=128"),
    # head_dim 256 (explicit; not hidden_size / heads = 224); num_key_value_heads 8.
    ModelPreset("gemma-2-9b", "google/gemma-2-9b", 8, 256, "num_key_value_heads=8, head_dim=256"),
    # head_dim 64 (explicit); num_key_value_heads 8 (64 query heads); both gpt-oss sizes.
    ModelPreset("gpt-oss-20b", "openai/gpt-oss-20b", 8, 64, "num_key_value_heads=8, head_dim=64"),
    ModelPreset("gpt-oss-120b", "openai/gpt-oss-120b", 8, 64, "num_key_value_heads=8, head_dim=64"),
)}


def get_model(name: str) -> ModelPreset:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"--model: expected one of {', '.join(MODELS)}, got {name!r}") from None


def heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds under tensor parallelism of degree ``tp``.

    The heads are split evenly when ``tp <= num_kv_heads`` (``num_kv_heads % tp == 0``); with more
    ranks than heads each rank holds one replicated head (``tp % num_kv_heads == 0``), as serving
    engines do for grouped-query attention.
    """
    if tp < 1:
        raise ValueError(f"--tp: expected a positive integer, got {tp}")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(
                f"--tp: expected a divisor of the {num_kv_heads} KV heads (or a multiple of it), "
                f"got {tp}"
            )
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(
            f"--tp: expected a divisor of the {num_kv_heads} KV heads (or a multiple of it), got {tp}"
        )
    return 1
