// kvwrite: cp_gather_cache (docs/ops/gather.md): gather cache entries of any dtype and shape
// ([num_blocks, block_size, *entry], any strides) into rows dst[t], bit for bit.
//
// Compiled at run time with NVRTC (see cuda_impl.py): one module per instantiation and, by default,
// per call signature, with the fixed arguments compiled in (KVWRITE_FIXED_ARGS). The kernel is
// kvwrite's entry gather (kvw/gather_entry.cuh) over the shared row rule (kvw/gather.cuh): the
// entry's dims coalesced into an inner run contiguous in both tensors and up to 3 outer dims, each
// row moved as bytes in chunks of VB (16 at most: the widest that every run, entry and row start
// allows). Only cp_gather_cache_kernel<DT_COPY, 0, VB, NDIM> is instantiated (NDIM: the outer
// dims, 0 to 3).
#include "kvw/gather_entry.cuh"

#if !defined(KVWRITE_HOST_TEST) || defined(KVWRITE_EMU)
KVW_DEFINE_GATHER_ENTRY_KERNEL(cp_gather_cache_kernel)
#endif
