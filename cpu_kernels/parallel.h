// Work sharing over XLA's intra-op thread pool for the FFI kernels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

// Calls body(begin, end) for `ranges` contiguous ranges covering [0, units), on the
// calling thread and one helper per other pool thread, each claiming the next unclaimed
// range until none is left; returns when all have run.
//
// The calling thread works too: XLA calls from its own thread, not the pool's (with one
// helper per pool thread, 2 cores ran 3 threads and a 1-row matmul was 35% slower). The
// caller claims every range no helper has started, so the ranges still running are in
// the hands of running threads and the wait ends even when the pool is busy.
template <typename Body>
void ParallelRanges(xla::ffi::ThreadPool& pool, int64_t units, int64_t ranges, Body body) {
  if (units <= 0) return;
  ranges = std::clamp<int64_t>(ranges, 1, units);
  struct Progress {
    std::atomic<int64_t> next{0};  // next unclaimed range
    std::atomic<int64_t> done{0};  // ranges finished
  };
  // Shared ownership: a helper that starts after every range is claimed still reads it.
  auto progress = std::make_shared<Progress>();
  auto run = [=]() {
    for (int64_t r; (r = progress->next.fetch_add(1)) < ranges;) {
      body(r * units / ranges, (r + 1) * units / ranges);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::clamp<int64_t>(pool.num_threads() - 1, 0, ranges - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([run]() { run(); });
  run();
  for (int spins = 0; progress->done.load(std::memory_order_acquire) < ranges; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// Threads that ParallelRanges will use: the caller and one helper per other pool thread.
inline int64_t Workers(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(pool.num_threads(), 1);
}

}  // namespace xlaserve
