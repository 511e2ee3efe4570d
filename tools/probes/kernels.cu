// Minimal kernels of the probes (compiled with NVRTC by tools.probes.common): what a
// launch, the access pattern, or the unavoidable work of reshape_and_cache_flash costs alone.
// Input rows are bfloat16, block size 16, head size a multiple of 16 elements. Scalar arguments
// are 64-bit (cuda.core passes a Python int as 8 bytes).
#include "kvw/common.cuh"
#include "kvw/fp8.cuh"
#include "kvw/warp.cuh"

// Nothing: the floor of a launch (one thread). Built with KVWRITE_PDL (kvw/common.cuh), this and
// the two chain kernels below start as every kernel of the ops does: trigger, then wait.
extern "C" __global__ void kvw_empty() { KVW_PDL_ENTRY(); }

// The bytes and addresses of one call, without the op's work: each thread reads one 32-byte
// (fp8) or 16-byte (copy) chunk of K and of V and writes 16 bytes of each (fp8: the high byte of
// each bfloat16, no quotient) at the cache address of its token's slot. Grid (T, chunk groups).
// EVICT_LAST: the loads carry the L2 evict-last hint.
template <bool EVICT_LAST>
__device__ __forceinline__ uint4 pattern_load(const u8* p) {
  if (EVICT_LAST) {
    uint4 v;
    u64 pol;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    return v;
  }
  return *reinterpret_cast<const uint4*>(p);
}

template <bool EVICT_LAST>
__global__ void kvw_pattern(const u8* __restrict__ key, const u8* __restrict__ value, u8* kc,
                            u8* vc, const i64* __restrict__ slots, i64 row_in_bytes,
                            i64 num_chunks, i64 chunks_per_head, i64 sb, i64 ss, i64 sh, i64 fp8) {
  const i64 t = blockIdx.x;
  const u32 c = blockIdx.y * blockDim.x + threadIdx.x;
  const u32 chunks = (u32)num_chunks, cph = (u32)chunks_per_head;
  if (c >= chunks) return;
  const i64 s = slots[t];
  const u32 in_chunk = fp8 ? 32 : 16;
  const u8* kp = key + t * row_in_bytes + (i64)c * in_chunk;
  const u8* vp = value + t * row_in_bytes + (i64)c * in_chunk;
  const u32 h = c / cph, d = (c - h * cph) * 16;
  const i64 off = (s >> 4) * sb + (s & 15) * ss + (i64)h * sh + d;
  uint4 k = pattern_load<EVICT_LAST>(kp), v = pattern_load<EVICT_LAST>(vp);
  if (fp8) {
    const uint4 k1 = pattern_load<EVICT_LAST>(kp + 16), v1 = pattern_load<EVICT_LAST>(vp + 16);
    k = make_uint4(__byte_perm(k.x, k.y, 0x7531), __byte_perm(k.z, k.w, 0x7531),
                   __byte_perm(k1.x, k1.y, 0x7531), __byte_perm(k1.z, k1.w, 0x7531));
    v = make_uint4(__byte_perm(v.x, v.y, 0x7531), __byte_perm(v.z, v.w, 0x7531),
                   __byte_perm(v1.x, v1.y, 0x7531), __byte_perm(v1.z, v1.w, 0x7531));
  }
  *reinterpret_cast<uint4*>(kc + off) = k;
  *reinterpret_cast<uint4*>(vc + off) = v;
}

// The unavoidable work of a small call (head size 128): one thread per 16-byte chunk of a token's
// K row (and the same chunk of V): slot load, data loads, store through (block, page, head)
// strides in elements; fp8 (e4m3) also the scales' loads and the exact division-free quotient.
// H and the strides are template constants, so the kernel reads nothing but its pointers and T
// from the parameter bank. Writes what reshape_and_cache_flash writes (the probe checks it).
template <int H, int FP8, i64 PAGE, i64 HEAD, i64 BLOCK>
__global__ void __launch_bounds__(128) kvw_small(
    const u8* __restrict__ key, const u8* __restrict__ value, u8* __restrict__ kc,
    u8* __restrict__ vc, const i64* __restrict__ slots, const float* __restrict__ ks,
    const float* __restrict__ vs, i64 T) {
  const u32 g = blockIdx.x * blockDim.x + threadIdx.x;
  constexpr u32 C = H * 16;  // 16-byte chunks per token row
  const u32 t = g / C;
  if (t >= T) return;
  const u32 c = g % C;
  const i64 s = slots[t];
  float k_s = 0.f, v_s = 0.f;
  if (FP8) { k_s = ks[0]; v_s = vs[0]; }
  const uint4 kk = reinterpret_cast<const uint4*>(key)[g];
  const uint4 vv = reinterpret_cast<const uint4*>(value)[g];
  const u32 h = c >> 4, d = (c & 15) * 8;
  const i64 off = (s >> 4) * BLOCK + (s & 15) * PAGE + h * HEAD + d;  // elements
  if (!FP8) {
    reinterpret_cast<uint4*>(kc + off * 2)[0] = kk;
    reinterpret_cast<uint4*>(vc + off * 2)[0] = vv;
  } else {
    const Fp8Scale ksc = make_fp8_scale(k_s), vsc = make_fp8_scale(v_s);
    float xk[8], xv[8];
    const u32 wk[4] = {kk.x, kk.y, kk.z, kk.w}, wv[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xk[i] = bits_f32((wk[i >> 1] >> ((i & 1) * 16)) << 16);
      xv[i] = bits_f32((wv[i >> 1] >> ((i & 1) * 16)) << 16);
    }
    u32 ok[2], ov[2];
    fp8_quantize<DT_E4M3, 8, 1>(xk, ok, ksc);
    fp8_quantize<DT_E4M3, 8, 1>(xv, ov, vsc);
    reinterpret_cast<uint2*>(kc + off)[0] = make_uint2(ok[0], ok[1]);
    reinterpret_cast<uint2*>(vc + off)[0] = make_uint2(ov[0], ov[1]);
  }
}

// The dependent loads a small call cannot avoid, and nothing else (one CTA; `probe chain`):
// kvw_slot_store: the slot, then one float32 store per thread at that slot's row (a cache
// write's chain); kvw_rope_chain: the position, then the thread's table entry of that row, then
// stores of it to an output row and to the slot's row (a RoPE write's chain: the table row is
// known only once the position has arrived).
extern "C" __global__ void kvw_slot_store(const i64* __restrict__ slots, float* __restrict__ cache,
                                          i64 row) {
  KVW_PDL_ENTRY();
  const i64 s = slots[0];
  cache[s * row + threadIdx.x] = 1.0f;
}

// The chain of both RoPE floor kernels: the position, then the thread's piece of that table row,
// then stores of it to an output row and to the slot's row.
template <typename T>
__device__ __forceinline__ void rope_chain(const i64* positions, const T* table, const i64* slots,
                                           T* out, T* cache, i64 row) {
  KVW_PDL_ENTRY();
  const i64 p = positions[0];
  const i64 s = slots[0];
  const T c = table[p * row + threadIdx.x];
  out[threadIdx.x] = c;
  cache[s * row + threadIdx.x] = c;
}

extern "C" __global__ void kvw_rope_chain(const i64* __restrict__ positions,
                                          const float* __restrict__ table,
                                          const i64* __restrict__ slots, float* __restrict__ out,
                                          float* __restrict__ cache, i64 row) {
  rope_chain(positions, table, slots, out, cache, row);
}

// kvw_rope_row_chain: the same chain with the table row read as the RoPE kernels read it, in
// 16-byte pieces (one per thread of a 32-thread CTA: a whole float32 row of 128 entries, 512
// bytes, what a rotation of head size 128 needs), then 16-byte stores.
// Its position and slot pointers are not __restrict__: loads through the read-only path
// (LDG.CONSTANT) may be hoisted by ptxas above the PDL build's wait (ACQBULK), and here were.
extern "C" __global__ void kvw_rope_row_chain(const i64* positions,
                                              const uint4* __restrict__ table, const i64* slots,
                                              uint4* __restrict__ out, uint4* __restrict__ cache,
                                              i64 row_vectors) {
  rope_chain(positions, table, slots, out, cache, row_vectors);
}

// The access pattern of reshape_and_cache_turboquant and none of its work (`probe tq-pattern`):
// a warp takes 32 U / (row_bytes / 16) (token, head) rows at a time (rows striding over the
// grid): U 16-byte pieces of their key rows and of their value rows a lane, all loads in flight
// before any store, then each row's slot_bytes written by consecutive lanes as 4-byte words
// where every slot is 4-byte aligned (else 2-byte halves). Unit i of row n's slot is
// n * 0x9E3779B1 ^ i ^ (the lane's XOR of its loaded words & zero): `zero` is 0, an argument so
// that no load is dead. Slot s lands at (s / bs) * c_blk + (s % bs) * c_page + head * c_head
// bytes (bs = 2^block_shift); s < 0 or >= num_slots writes nothing. row_bytes / 16 a power of
// two <= 32 U. No __restrict__ on the inputs: see kvw_rope_row_chain.
#define KVW_TQ_PATTERN_PARAMS                                                                \
  const u8 *key, const u8 *value, u8 *cache, const i64 *slots, i64 num_rows, i64 num_heads,    \
      i64 row_bytes, i64 k_tok, i64 k_head, i64 v_tok, i64 v_head, i64 c_blk, i64 c_page,      \
      i64 c_head, i64 block_shift, i64 slot_bytes, i64 num_slots, i64 zero
template <int U>
__global__ void kvw_tq_pattern(KVW_TQ_PATTERN_PARAMS) {
  KVW_PDL_ENTRY();
  const u32 lane = threadIdx.x & 31u;
  const u32 cpr = static_cast<u32>(row_bytes) >> 4, rpi = 32u * U / cpr;
  const i64 step = static_cast<i64>(gridDim.x) * (blockDim.x >> 5) * rpi;
  const bool words = ((slot_bytes | c_blk | c_page | c_head |
                       static_cast<i64>(reinterpret_cast<u64>(cache))) & 3) == 0;
  const u32 units = static_cast<u32>(slot_bytes) >> (words ? 2 : 1);
  for (i64 base = (static_cast<i64>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpi;
       base < num_rows; base += step) {
    uint4 k[U], v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u32 c = lane + 32u * u;
      const i64 row = base + c / cpr;
      k[u] = v[u] = make_uint4(0, 0, 0, 0);
      if (row < num_rows) {
        const i64 t = row / num_heads, h = row - t * num_heads, off = (c % cpr) * 16;
        k[u] = *reinterpret_cast<const uint4*>(key + t * k_tok + h * k_head + off);
        v[u] = *reinterpret_cast<const uint4*>(value + t * v_tok + h * v_head + off);
      }
    }
    const i64 mine = base + lane;
    const i64 my_slot = lane < rpi && mine < num_rows ? slots[mine / num_heads] : -1;
    u32 w = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) w ^= k[u].x ^ k[u].y ^ k[u].z ^ k[u].w ^ v[u].x ^ v[u].y ^
                                     v[u].z ^ v[u].w;
    w &= static_cast<u32>(zero);
    for (u32 j = 0; j < rpi; ++j) {
      const i64 s = shfl_i64(my_slot, static_cast<int>(j));
      const i64 row = base + j;
      if (row >= num_rows || s < 0 || s >= num_slots) continue;
      const i64 h = row % num_heads;
      u8* dst = cache + (s >> block_shift) * c_blk + (s & ((1ll << block_shift) - 1)) * c_page +
                h * c_head;
      const u32 tag = static_cast<u32>(row) * 0x9E3779B1u ^ w;
      for (u32 i = lane; i < units; i += 32u) {
        if (words) {
          reinterpret_cast<u32*>(dst)[i] = tag ^ i;
        } else {
          reinterpret_cast<u16*>(dst)[i] = static_cast<u16>(tag ^ i);
        }
      }
    }
  }
}

// The same pattern for a call of a few rows, as tight as it can be written: a warp a (token,
// head) row, 32-bit indices (num_rows < 2^31; the grid has a warp for every row, no loop), the
// row's key and value rows as 4-byte words (lane l words l, l + 32, ...; row_bytes a multiple
// of 4 and the rows 4-byte aligned), its slot in one load, then the slot's bytes as
// kvw_tq_pattern writes them (unit i = row * 0x9E3779B1 ^ i ^ (the lane's XOR & zero)).
__global__ void kvw_tq_row_pattern(KVW_TQ_PATTERN_PARAMS) {
  KVW_PDL_ENTRY();
  const u32 lane = threadIdx.x & 31u;
  const u32 row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= static_cast<u32>(num_rows)) return;
  const u32 h = static_cast<u32>(num_heads), t = row / h, hh = row - t * h;
  const i64 s = slots[t];
  const u32* kp = reinterpret_cast<const u32*>(key + t * k_tok + hh * k_head);
  const u32* vp = reinterpret_cast<const u32*>(value + t * v_tok + hh * v_head);
  const u32 words = static_cast<u32>(row_bytes) >> 2;
  u32 w = 0;
#pragma unroll 4
  for (u32 i = lane; i < words; i += 32u) w ^= kp[i] ^ vp[i];
  w &= static_cast<u32>(zero);
  if (s < 0 || s >= num_slots) return;
  u8* dst = cache + (s >> block_shift) * c_blk + (s & ((1ll << block_shift) - 1)) * c_page +
            hh * c_head;
  const bool as_words = ((slot_bytes | c_blk | c_page | c_head |
                          static_cast<i64>(reinterpret_cast<u64>(cache))) & 3) == 0;
  const u32 units = static_cast<u32>(slot_bytes) >> (as_words ? 2 : 1);
  const u32 tag = row * 0x9E3779B1u ^ w;
  for (u32 i = lane; i < units; i += 32u) {
    if (as_words) {
      reinterpret_cast<u32*>(dst)[i] = tag ^ i;
    } else {
      reinterpret_cast<u16*>(dst)[i] = static_cast<u16>(tag ^ i);
    }
  }
}
