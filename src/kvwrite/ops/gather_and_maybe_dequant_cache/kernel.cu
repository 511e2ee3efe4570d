// kvwrite: gather_and_maybe_dequant_cache (docs/ops/gather.md): gather MLA cache entries
// [num_blocks, block_size, E] into contiguous rows dst[t] of a batch of sequences, as bits
// ("auto") or dequantized by the fp8 read rule (e4m3/e5m2 codes -> float16/bfloat16/float32 with
// the one per-tensor scale).
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by default,
// per call signature, with the fixed arguments compiled in (KVWRITE_FIXED_ARGS). The kernel is
// kvwrite's entry gather (kvw/gather_entry.cuh: no outer dims, one tensor, the run = the entry)
// over the shared row rule (kvw/gather.cuh) and fp8 read rule (kvw/fp8_read.cuh).
//
// gather_and_maybe_dequant_cache_kernel<CONV, OUT, VB, 0>: CONV DT_COPY (VB bytes per chunk, 16 at
// most, the widest that every entry and row start allows) or DT_E4M3 (fp8: VB codes per chunk, 8
// at most, into VB elements of OUT; e4m3 or e5m2 codes as the fixed argument fp8_e5m2 says).
#include "kvw/gather_entry.cuh"

#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)
KVW_DEFINE_GATHER_ENTRY_KERNEL(gather_and_maybe_dequant_cache_kernel)
#endif
