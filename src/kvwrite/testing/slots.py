"""Slot patterns: which cache slots a batch of T new tokens writes, as a server would pick them.

Every pattern draws its blocks from :class:`BlockAllocator`, a simulated paged allocator whose
free list is a seeded random permutation of all block ids: a long-running server has freed and
reused blocks in arbitrary order, so the blocks of one sequence are scattered over the cache.

How the T tokens of a point are laid out (P = round(pad_fraction * T) padding slots come last,
as in a CUDA-graph batch padded up to its captured size; N = T - P tokens are real):

- ``random``: N unique slots drawn uniformly (vLLM's benchmark; the default). With P = 0, input
  set 0 is exactly vLLM's (``random.sample`` after seeding every RNG with 42).
- ``decode``: B = N sequences, each appending ONE token. Sequence i has a context of c_i tokens
  already cached, c_i uniform in [0, C] with C = min(context_len, max_position - 1,
  blocks_per_seq * block_size - 1) and blocks_per_seq = num_blocks // B (so that every sequence's
  blocks fit); it owns
  ceil((c_i + 1) / block_size) blocks, and its new token goes to position c_i: offset
  c_i % block_size of its last block, which is a freshly allocated block when c_i is a multiple
  of block_size (the previous last block was full).
- ``prefill``: B = ceil(N / L) sequences (L = prefill_len; the last one holds the remainder), each
  writing its L new tokens at positions 0..L-1: consecutive offsets over whole fresh blocks.
- ``mixed``: chunked prefill as schedulers batch it: D decode tokens first (as ``decode`` with
  B = D), D = min(decode_tokens, N) when ``decode_tokens`` is set (the running batch), else
  round(decode_fraction * N); then one prefill chunk of N - D tokens continuing a sequence that
  already holds p cached tokens, p uniform in [0, min(context_len, max_position - (N - D))] (so
  the chunk may start in the middle of a block, and ends below max_position).

``max_position`` (optional; a model's context window, or the rows of a RoPE cos/sin table) bounds
every token's position in its sequence: positions are < max_position, and prefill_len may not
exceed it. :meth:`SlotBatch.positions` gives the positions.

Every real token gets a distinct slot; padding slots are -1. Patterns other than ``random`` use
their own numpy generator seeded from (seed, input-set index), so they never disturb the random
streams that draw key and value.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

__all__ = ["PATTERNS", "SlotPattern", "Sequence", "SlotBatch", "BlockAllocator", "make_slots"]

PATTERNS = ("random", "decode", "prefill", "mixed")


@dataclasses.dataclass(frozen=True)
class SlotPattern:
    """A slot pattern and its parameters (see the module doc for how T maps to sequences)."""

    kind: str = "random"
    pad_fraction: float = 0.0
    # decode and mixed: the longest context already cached before this step.
    context_len: int = 4096
    # prefill: new tokens per sequence.
    prefill_len: int = 512
    # mixed: the fraction of the real tokens that are decode tokens ...
    decode_fraction: float = 0.5
    # ... or, when set, this many (at most N): the running sequences of a serving step.
    decode_tokens: int | None = None
    # Every position in a sequence stays below this (None: no bound).
    max_position: int | None = None
    seed: int = 42

    def __post_init__(self):
        if self.kind not in PATTERNS:
            raise ValueError(f"--slots: expected one of {', '.join(PATTERNS)}, got {self.kind!r}")
        if not 0.0 <= self.pad_fraction < 1.0:
            raise ValueError(f"--pad-fraction: expected a number in [0, 1), got {self.pad_fraction}")
        if self.context_len < 0:
            raise ValueError(f"--context-len: expected a non-negative integer, got {self.context_len}")
        if self.prefill_len < 1:
            raise ValueError(f"--prefill-len: expected a positive integer, got {self.prefill_len}")
        if not 0.0 <= self.decode_fraction <= 1.0:
            raise ValueError(f"--decode-fraction: expected a number in [0, 1], got {self.decode_fraction}")
        if self.decode_tokens is not None and self.decode_tokens < 0:
            raise ValueError(f"--decode-tokens: expected a non-negative integer, got {self.decode_tokens}")
        if self.max_position is not None:
            if self.max_position < 1:
                raise ValueError(f"max_position: expected a positive integer, got {self.max_position}")
            if self.kind == "prefill" and self.prefill_len > self.max_position:
                raise ValueError(f"--prefill-len: expected at most max_position = {self.max_position} "
                                 f"(positions 0..L-1 stay below it), got {self.prefill_len}")

    @property
    def max_context(self) -> int:
        """The longest context already cached a decode token may follow (before the cap that
        makes every sequence's blocks fit)."""
        if self.max_position is None:
            return self.context_len
        return min(self.context_len, self.max_position - 1)

    def num_decode(self, num_real: int) -> int:
        """mixed: the decode tokens among ``num_real`` real tokens."""
        if self.decode_tokens is not None:
            return min(self.decode_tokens, num_real)
        return round(self.decode_fraction * num_real)

    @property
    def is_default(self) -> bool:
        return self == SlotPattern()

    def num_padding(self, num_tokens: int) -> int:
        return round(self.pad_fraction * num_tokens)

    def describe(self) -> str:
        """The pattern and the parameters that shape it, e.g. ``decode(context_len=4096)``."""
        params = {"random": [], "decode": ["context_len"], "prefill": ["prefill_len"],
                  "mixed": ["decode_tokens" if self.decode_tokens is not None else
                            "decode_fraction", "context_len"]}[self.kind]
        if self.max_position is not None and self.kind != "random":
            params.append("max_position")
        parts = [f"{p}={getattr(self, p):g}" for p in params]
        if self.pad_fraction:
            parts.append(f"pad_fraction={self.pad_fraction:g}")
        return f"{self.kind}({', '.join(parts)})" if parts else self.kind

    def explain(self, num_tokens: int | None = None, num_blocks: int | None = None,
                block_size: int | None = None) -> str:
        """:meth:`describe` and what it means, for a header line. Given the sweep's largest
        ``num_tokens`` and the cache, a decode pattern also says where the blocks cap contexts."""
        words = {
            "random": "T unique random slots (vLLM's benchmark)",
            "decode": (f"B = T sequences with contexts uniform in [0, {self.max_context}] (capped "
                       f"so that every sequence's blocks fit), each appending one token at the "
                       f"next offset of its last block; blocks from a shuffled free list"),
            "prefill": (f"B = ceil(T / {self.prefill_len}) sequences, each writing "
                        f"{self.prefill_len} tokens at consecutive offsets over whole blocks from "
                        f"a shuffled free list"),
            "mixed": ((f"min({self.decode_tokens}, T)" if self.decode_tokens is not None else
                       f"round({self.decode_fraction:g} * T)")
                      + f" decode tokens (as decode), then one prefill chunk of the rest "
                        f"continuing a sequence with up to {self.context_len} cached tokens"),
        }[self.kind]
        if self.kind == "decode" and None not in (num_tokens, num_blocks, block_size):
            n = num_tokens - self.num_padding(num_tokens)
            if n:
                cap = decode_context_cap(self.max_context, num_blocks, n, block_size)
                if cap < self.max_context:
                    words += (f"; at T={num_tokens} the {num_blocks} blocks cap contexts at "
                              f"{max(cap, 0)}")
        if self.max_position is not None and self.kind != "random":
            words += f"; every position in a sequence < {self.max_position}"
        if self.pad_fraction:
            words += (f"; the last {self.pad_fraction:g} of the T slots are -1 padding (not "
                      f"counted in bytes)")
        return f"{self.describe()}: {words}"

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """The fewest cache blocks :func:`make_slots` needs for a ``num_tokens`` point: random
        ceil(N / block_size); decode one block per sequence (contexts are capped to the rest);
        prefill each sequence's whole blocks; mixed one block per decode token plus the chunk's
        blocks (the chunk's cached prefix is capped to the rest)."""
        n = num_tokens - self.num_padding(num_tokens)
        if self.kind == "random":
            return -(-n // block_size)
        if self.kind == "decode":
            return n
        if self.kind == "prefill":
            full, rest = divmod(n, self.prefill_len)
            return full * -(-self.prefill_len // block_size) + -(-rest // block_size)
        decode = self.num_decode(n)
        return decode + -(-(n - decode) // block_size)

    def fit_reason(self, num_tokens: int, num_blocks: int, block_size: int) -> str | None:
        """Why a ``num_tokens`` point of this pattern cannot be built in a cache of
        ``num_blocks`` blocks (naming the flags to change), or None: the one check every op's
        benchmark makes before its sweep (so that no point is skipped for it)."""
        need = self.blocks_needed(num_tokens, block_size)
        if need > num_blocks:
            return (f"num_tokens {num_tokens} with --slots {self.kind} needs {need} cache blocks "
                    f"of {block_size} slots and the cache has {num_blocks} "
                    f"(num_blocks * block_size = {num_blocks * block_size} slots): raise "
                    f"--num-blocks or lower --num-tokens")
        if self.kind == "mixed" and self.max_position is not None:
            n = num_tokens - self.num_padding(num_tokens)
            chunk = n - self.num_decode(n)
            if chunk > self.max_position:
                return (f"num_tokens {num_tokens} with --slots mixed makes a prefill chunk of "
                        f"{chunk} tokens, more than the {self.max_position} positions "
                        f"(--max-position or the model's window): lower --num-tokens or raise "
                        f"--decode-tokens")
        return None

    def cache_blocks(self, num_tokens: int, block_size: int, at_least: int) -> int:
        """Blocks of a cache sized to fit a ``num_tokens`` point: ``at_least``, raised to twice
        :meth:`blocks_needed` (room for decode contexts and for the random slots to scatter)."""
        return max(at_least, 2 * self.blocks_needed(num_tokens, block_size))

    @property
    def id(self) -> str:
        """A short tag for case ids and file names."""
        return self.describe().replace("(", "-").replace(")", "").replace(", ", "-").replace("=", "")


@dataclasses.dataclass
class Sequence:
    """One sequence of a batch: its block table and the positions its new tokens take."""

    block_table: list[int]   # its blocks, in position order
    start: int               # tokens already cached = position of its first new token
    num_new: int

    def slot(self, position: int, block_size: int) -> int:
        return self.block_table[position // block_size] * block_size + position % block_size


@dataclasses.dataclass
class SlotBatch:
    """The slots of one batch (``-1`` = padding) and the sequences the real tokens belong to,
    in token order (empty for ``random``, which has no sequences)."""

    slots: np.ndarray        # [T] int64
    sequences: list[Sequence]
    num_padding: int

    def positions(self) -> np.ndarray | None:
        """[T] int64: each real token's position in its sequence, 0 for padding (as a padded
        CUDA-graph batch carries); None for ``random`` (no sequences)."""
        if not self.sequences:
            return None
        pos = [p for s in self.sequences for p in range(s.start, s.start + s.num_new)]
        return np.array(pos + [0] * self.num_padding, dtype=np.int64)


class BlockAllocator:
    """Hands out block ids from a free list shuffled as a long-running server's is."""

    def __init__(self, num_blocks: int, rng: np.random.Generator):
        self.num_blocks = num_blocks
        self._free = rng.permutation(num_blocks)
        self._next = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._next

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise ValueError(f"the slot pattern needs {n} more blocks and {self.num_free} of the "
                             f"{self.num_blocks} are free: raise --num-blocks or lower --num-tokens")
        out = self._free[self._next:self._next + n].tolist()
        self._next += n
        return out


def decode_context_cap(context_len: int, num_free_blocks: int, num_seqs: int,
                       block_size: int) -> int:
    """The longest context a decode batch of ``num_seqs`` sequences draws: at most
    ``context_len``, and small enough that every sequence's blocks fit the free ones (negative
    when not even one block each fits)."""
    return min(context_len, num_free_blocks // num_seqs * block_size - 1)


def _decode(alloc: BlockAllocator, num_seqs: int, context_len: int, block_size: int,
            rng: np.random.Generator) -> list[Sequence]:
    if num_seqs == 0:
        return []
    cap = decode_context_cap(context_len, alloc.num_free, num_seqs, block_size)
    if cap < 0:
        raise ValueError(f"a decode batch of {num_seqs} sequences needs at least one block each, "
                         f"and {alloc.num_free} blocks are free: raise --num-blocks")
    contexts = rng.integers(0, cap, size=num_seqs, endpoint=True)
    seqs = []
    for c in contexts.tolist():
        seqs.append(Sequence(alloc.allocate(c // block_size + 1), c, 1))
    return seqs


def _prefill(alloc: BlockAllocator, length: int, block_size: int, start: int = 0) -> Sequence:
    return Sequence(alloc.allocate(math.ceil((start + length) / block_size)), start, length)


def make_slots(pattern: SlotPattern, num_tokens: int, num_blocks: int, block_size: int,
               set_index: int = 0) -> SlotBatch:
    """The slots of input set ``set_index`` of a ``num_tokens`` point (see the module doc).

    ``random`` draws from Python's ``random`` module (vLLM's stream; the caller seeds it); the
    other patterns are reproducible from ``pattern.seed`` and ``set_index`` alone.
    """
    num_slots = num_blocks * block_size
    pad = pattern.num_padding(num_tokens)
    n = num_tokens - pad
    if pattern.kind == "random":
        if n > num_slots:
            raise ValueError(f"num_tokens: expected at most num_blocks * block_size = {num_slots} "
                             f"real tokens, got {n}")
        slots = np.array(random.sample(range(num_slots), n) + [-1] * pad, dtype=np.int64)
        return SlotBatch(slots, [], pad)
    rng = np.random.default_rng([pattern.seed, set_index])
    alloc = BlockAllocator(num_blocks, rng)
    if pattern.kind == "decode":
        seqs = _decode(alloc, n, pattern.max_context, block_size, rng)
    elif pattern.kind == "prefill":
        full, rest = divmod(n, pattern.prefill_len)
        lengths = [pattern.prefill_len] * full + ([rest] if rest else [])
        seqs = [_prefill(alloc, length, block_size) for length in lengths]
    else:  # mixed
        num_decode = pattern.num_decode(n)
        chunk = n - num_decode
        seqs = []
        if chunk:
            # Leave one block per decode sequence.
            room = (alloc.num_free - num_decode) * block_size - chunk
            if room < 0:
                raise ValueError(f"a prefill chunk of {chunk} tokens and {num_decode} decode "
                                 f"tokens need more than the {num_blocks} blocks: raise --num-blocks")
            last = min(pattern.context_len, room)
            if pattern.max_position is not None:
                last = min(last, pattern.max_position - chunk)
                if last < 0:
                    raise ValueError(f"a prefill chunk of {chunk} tokens does not fit below "
                                     f"max_position = {pattern.max_position}")
            start = int(rng.integers(0, last, endpoint=True))
            seqs.append(_prefill(alloc, chunk, block_size, start))
        # Decode tokens come first in the batch, then the chunk.
        seqs = _decode(alloc, num_decode, pattern.max_context, block_size, rng) + seqs
    slots = [s.slot(p, block_size) for s in seqs for p in range(s.start, s.start + s.num_new)]
    return SlotBatch(np.array(slots + [-1] * pad, dtype=np.int64), seqs, pad)
