// kvwrite: gather_cache_flash (docs/ops/gather.md): gather the key and value rows of a batch of
// sequences out of paged caches (logical [num_blocks, block_size, H, D], any strides with a unit
// last one: NHD, HND, interleaved, packed) into key_out[t] and value_out[t] ([T_out, H, D]), as
// bits or dequantized by the fp8 read rule with per-tensor or per-head scales.
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by default,
// per call signature, with the fixed arguments compiled in (KVWRITE_FIXED_ARGS). The kernel is
// kvwrite's entry gather (kvw/gather_entry.cuh: two tensors, outer dim 0 = the heads, the run = a
// head) over the shared row rule (kvw/gather.cuh) and fp8 read rule (kvw/fp8_read.cuh).
//
// gather_cache_flash_kernel<CONV, OUT, VB, 1>: CONV DT_COPY (VB bytes per chunk, 16 at most, the
// widest that every head and row start allows) or DT_E4M3 (fp8: VB codes per chunk, 8 at most,
// into VB elements of OUT; e4m3 or e5m2 codes as the fixed argument fp8_e5m2 says).
#include "kvw/gather_entry.cuh"

#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)
KVW_DEFINE_GATHER_ENTRY_KERNEL(gather_cache_flash_kernel)
#endif
