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

// Calls body(u, next) once for every unit u in [0, units): one contiguous range per
// worker (the caller and one helper per other pool thread), which it runs front to back,
// passing the unit it will run after u (or -1 at its range's end) so that body can
// prefetch that unit's data. A worker whose range is used up takes the last unit of
// another's range, one at a time, until none is left; returns when all have run.
//
// Why not ParallelRanges: on 2 cores the host's Python thread (scheduling, packing the
// next batch) runs beside the kernels and takes a core from one worker for a while. With
// fixed ranges the other worker then waits at the end of every call for the one that
// lost its core; here it takes over that worker's remaining units. It also evens out
// matrices whose unit count does not divide between the workers (9 or 15 panels).
template <typename Body>
void ParallelStealing(xla::ffi::ThreadPool& pool, int64_t units, Body body) {
  if (units <= 0) return;
  const int64_t workers = std::clamp<int64_t>(pool.num_threads(), 1, std::min<int64_t>(units, 64));
  // Range w as (front, back) packed in one word, so the owner's claim at the front and
  // a thief's at the back can never both take the last unit.
  struct State {
    std::atomic<uint64_t> range[64];
    std::atomic<int64_t> done{0};  // units finished
  };
  auto state = std::make_shared<State>();
  for (int64_t w = 0; w < workers; ++w)
    state->range[w].store(static_cast<uint64_t>(w * units / workers) |
                          static_cast<uint64_t>((w + 1) * units / workers) << 32);
  const auto front = [](uint64_t r) { return static_cast<int64_t>(r & 0xFFFFFFFFu); };
  const auto back = [](uint64_t r) { return static_cast<int64_t>(r >> 32); };
  auto run = [=](int64_t w) {
    std::atomic<uint64_t>& own = state->range[w];
    for (uint64_t r = own.load();;) {
      const int64_t f = front(r), b = back(r);
      if (f >= b) break;
      if (!own.compare_exchange_weak(r, r + 1)) continue;
      body(f, f + 1 < b ? f + 1 : -1);
      state->done.fetch_add(1, std::memory_order_release);
      r = own.load();
    }
    for (int64_t i = 1; i < workers; ++i) {
      std::atomic<uint64_t>& other = state->range[(w + i) % workers];
      for (uint64_t r = other.load();;) {
        const int64_t f = front(r), b = back(r);
        if (f >= b) break;
        if (!other.compare_exchange_weak(r, r - (uint64_t{1} << 32))) continue;
        body(b - 1, -1);
        state->done.fetch_add(1, std::memory_order_release);
        r = other.load();
      }
    }
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([run, w]() { run(w); });
  run(0);
  for (int spins = 0; state->done.load(std::memory_order_acquire) < units; ++spins) {
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
