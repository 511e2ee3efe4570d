"""Model presets (KV heads × head size, context window), the serving shape a preset's sweep
takes, and tensor-parallel division of the KV heads.

Each preset is taken from the model's public ``config.json`` on the Hugging Face Hub:
``num_key_value_heads``, ``head_dim`` where the config has it, else
``hidden_size / num_attention_heads``, and ``max_position_embeddings`` (the context window).
MLA models (DeepSeek-V2/V3) cache a latent vector instead of per-head K and V, so they have no
preset here.

A preset's batch shapes come from the serving engine's scheduler limits, the same for every model
(:class:`ServingShape`), and from the model only through its context window.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["ModelPreset", "MODELS", "doublings", "get_model", "heads_per_rank", "ServingShape", "SERVING",
           "serving_flags", "apply_serving_flags", "apply_model", "model_cache_blocks"]


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str
    hf_id: str
    num_kv_heads: int
    head_dim: int
    max_position: int  # the context window: max_position_embeddings
    num_q_heads: int = 0  # num_attention_heads
    # The QK norm's weight convention, as an offset added to the weight: 0.0 (x * r * w, Qwen3),
    # 1.0 (x * r * (1 + w), Gemma 3); None: the model has no QK norm.
    qk_norm: float | None = None
    # Where the config has no head_dim: its hidden_size (head_dim = hidden_size / num_q_heads).
    hidden_size: int | None = None

    @property
    def source(self) -> str:
        """The config.json fields the numbers come from."""
        derived = f" ({self.hidden_size} / {self.num_q_heads} heads)" if self.hidden_size else ""
        return (f"num_key_value_heads={self.num_kv_heads}, head_dim={self.head_dim}{derived}, "
                f"max_position_embeddings={self.max_position}")


# name, Hugging Face id, num_key_value_heads, head_dim, max_position_embeddings, num_attention_heads
# (and the QK norm's convention, or the hidden_size head_dim is derived from where the config has
# no head_dim).
MODELS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 8, 128, 131072, 32, hidden_size=4096),
    ModelPreset("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 8, 128, 131072, 64, hidden_size=8192),
    ModelPreset("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 8, 128, 131072, 128,
                hidden_size=16384),
    ModelPreset("mistral-7b", "mistralai/Mistral-7B-v0.1", 8, 128, 32768, 32, hidden_size=4096),
    ModelPreset("qwen2.5-7b", "Qwen/Qwen2.5-7B", 4, 128, 131072, 28, hidden_size=3584),
    # Qwen3: QK norm x * r * w.
    ModelPreset("qwen3-8b", "Qwen/Qwen3-8B", 8, 128, 40960, 32, qk_norm=0.0),
    ModelPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 4, 128, 40960, 32, qk_norm=0.0),
    # Gemma 3 (text_config): QK norm x * r * (1 + w).
    ModelPreset("gemma-3-12b", "google/gemma-3-12b-pt", 8, 256, 131072, 16, qk_norm=1.0),
    ModelPreset("gemma-3-27b", "google/gemma-3-27b-pt", 16, 128, 131072, 32, qk_norm=1.0),
    # head_dim 256 (explicit; not hidden_size / heads = 224).
    ModelPreset("gemma-2-9b", "google/gemma-2-9b", 8, 256, 8192, 16),
    # Both gpt-oss sizes.
    ModelPreset("gpt-oss-20b", "openai/gpt-oss-20b", 8, 64, 131072, 64),
    ModelPreset("gpt-oss-120b", "openai/gpt-oss-120b", 8, 64, 131072, 64),
)}


@dataclasses.dataclass(frozen=True)
class ServingShape:
    """What one step of a serving engine's scheduler writes into the cache, from its limits, the
    same for every model (a model enters only through its context window).

    - decode: one new token per running sequence: T = 1, 2, 4, ..., ``max_num_seqs``;
    - prefill: whole prompts of ``prefill_len`` tokens (at most the window):
      T = ``min_step_tokens``, 2x, ... ``max_num_batched_tokens``;
    - mixed (chunked prefill): the running decode batch, ``max_num_seqs`` tokens, then one prefill
      chunk filling the rest of the step's budget; T as for prefill;
    - random: no sequences; the sweep stays the user's (vLLM's by default).

    Contexts already cached reach the window: ``context_len = window - 1`` (the new token then
    takes the last position the window holds), and every position stays below the window.
    """

    # vLLM's long-standing default for --max-num-seqs.
    max_num_seqs: int = 256
    # The chunked-prefill token budget per step (--max-num-batched-tokens).
    max_num_batched_tokens: int = 8192
    prefill_len: int = 2048
    # The smallest prefill or mixed step of the sweep.
    min_step_tokens: int = 512

    def num_tokens(self, kind: str) -> list[int] | None:
        """The sweep's T for slot pattern ``kind`` (None for random: the user's sweep)."""
        lo, hi = {"decode": (1, self.max_num_seqs),
                  "prefill": (self.min_step_tokens, self.max_num_batched_tokens),
                  "mixed": (self.min_step_tokens, self.max_num_batched_tokens)}.get(kind, (0, 0))
        return doublings(lo, hi) if lo else None

    def flags(self, preset: ModelPreset, kind: str) -> dict:
        """The values this shape gives the flags (by argparse dest) for slot pattern ``kind``;
        empty for random."""
        if self.num_tokens(kind) is None:
            return {}
        out = {"num_tokens": self.num_tokens(kind), "context_len": preset.max_position - 1,
               "max_position": preset.max_position,
               "prefill_len": min(self.prefill_len, preset.max_position)}
        if kind == "mixed":
            out["decode_tokens"] = self.max_num_seqs
        return out


SERVING = ServingShape()


def serving_flags(model: str, kind: str, given: set[str], shape: ServingShape = SERVING) -> dict:
    """The flag values (by argparse dest) that ``--model`` sets for slot pattern ``kind``, leaving
    out the flags in ``given`` (given on the command line: they win). ``--decode-fraction`` given
    keeps mixed on its fraction (no decode_tokens)."""
    out = {k: v for k, v in shape.flags(get_model(model), kind).items() if k not in given}
    if "decode_fraction" in given:
        out.pop("decode_tokens", None)
    return out


def apply_serving_flags(args) -> dict:
    """Set :func:`serving_flags` of ``args.model`` and ``args.slots`` on ``args``, each that the
    subcommand has (``num_tokens`` as a comma list); return them all."""
    flags = serving_flags(args.model, args.slots, args.explicit)
    for dest, value in flags.items():
        if hasattr(args, dest):
            setattr(args, dest, ",".join(map(str, value)) if dest == "num_tokens" else value)
    return flags


def apply_model(args) -> None:
    """``--model`` of a subcommand with ``--num-heads`` and ``--head-size``: refuse those given
    too, set the serving flags (:func:`apply_serving_flags`) and the preset's KV heads and head
    size."""
    given = [f"--{f.replace('_', '-')}" for f in ("num_heads", "head_size") if f in args.explicit]
    if given:
        raise ValueError(f"--model: sets --num-heads and --head-size; got {' and '.join(given)} "
                         f"too")
    apply_serving_flags(args)
    preset = get_model(args.model)
    args.num_heads, args.head_size = preset.num_kv_heads, preset.head_dim


def model_cache_blocks(args) -> int:
    """``--num-blocks`` where ``--model`` sets the sweep and the flag is not given: the
    subcommand's default, raised so that every point's slot pattern fits
    (:meth:`SlotPattern.cache_blocks` at the largest T: a decode or mixed batch needs a block per
    sequence, which the default CPU cache does not hold). Reads ``args.pattern``,
    ``args.num_tokens``, ``args.block_size`` and ``args.num_blocks``."""

    counts = parse_num_tokens(str(args.num_tokens))
    return max(args.pattern.cache_blocks(t, args.block_size, args.num_blocks) for t in counts)


def doublings(lo: int, hi: int) -> list[int]:
    """lo, 2*lo, 4*lo, ... up to hi (a --num-tokens range LO:HI)."""
    out = []
    while lo <= hi:
        out.append(lo)
        lo *= 2
    return out


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


def parse_num_tokens(text: str, flag: str = "--num-tokens") -> list[int]:
    """``"1,2,64"`` (or ``"1 2 64"``) -> [1, 2, 64]; ``"LO:HI"`` -> LO, 2*LO, 4*LO, ... up to HI."""
    bad = ValueError(f"{flag}: expected a list like 1,2,64 or a range LO:HI of doublings like "
                     f"2:65536 (positive integers), got {text!r}")
    text = re.sub(r"\s*,\s*|\s+", ",", text.strip())
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":"))
            if lo < 1 or hi < lo:
                raise bad
            out = []
            while lo <= hi:
                out.append(lo)
                lo *= 2
            return out
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise bad from None
    if not values or min(values) < 1:
        raise bad
    return list(dict.fromkeys(values))
