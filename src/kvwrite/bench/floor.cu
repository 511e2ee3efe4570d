// The benchmark's launch floor (kvwrite.bench.timing.empty_kernel_floor): an empty kernel of one
// thread. Built with KVWRITE_PDL (kvw/common.cuh) it starts as every kernel of the ops does:
// trigger, then wait.
#include "kvw/common.cuh"

extern "C" __global__ void kvw_empty() { KVW_PDL_ENTRY(); }
