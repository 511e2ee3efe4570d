// A launch of a transfer kernel variant under the SIMT emulation of tests/gather_emu.h (which
// also gives blockDim, gridDim and __umul64hi) from a flat array of 64-bit arguments, each
// converted to its parameter's type (pointers from their addresses), so that
// tests/test_transfer_pages_emu.py passes exactly what transfer_cuda.page_launch_args computes.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "gather_emu.h"

template <typename T>
T emu_arg(long long v) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<std::uintptr_t>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <typename... P, std::size_t... I>
void emu_call(void (*f)(P...), const long long* a, std::index_sequence<I...>) {
  f(emu_arg<P>(a[I])...);
}

// Runs kernel f over `grid` CTAs of kEmuThreads threads with the n arguments a[0..n).
template <typename... P>
void emu_run(void (*f)(P...), unsigned grid, const long long* a, int n) {
  if (n != static_cast<int>(sizeof...(P))) {
    std::fprintf(stderr, "emu_run: %d arguments for %zu parameters\n", n, sizeof...(P));
    std::abort();
  }
  emu_launch(grid, [&] { emu_call(f, a, std::index_sequence_for<P...>{}); });
}
