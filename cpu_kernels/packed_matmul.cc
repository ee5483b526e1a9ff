// xlaserve CPU matmul: y[M, N] = x[M, K] @ W[K, N] with W packed once at load into
// column panels (P = ceil(N / 64), zero-padded), called from jit through the XLA FFI.
//   float32: wp[P, K, 64].
//   bfloat16: wp[P, K2, 64, 2], K2 = ceil(K / 2): rows k and k + 1 interleaved per column,
//     the operand layout of vdpbf16ps; x comes as f32 [M, K], is rounded to bf16 here
//     (RoundX), and products accumulate in f32. Three kernels over the same panels, the
//     same products summed in other orders: "widen" shifts the weights to f32 and FMAs
//     them (any CPU the kernels build on); "dot" runs vdpbf16ps, two k steps of 16
//     columns an instruction (built where the compiler targets avx512_bf16); "amx" runs
//     tdpbf16ps on AMX tiles, 16 rows x 16 columns x 32 k an instruction (built where it
//     targets AMX-BF16). Which one serves is measured per CPU (cpu_kernels.bf16_kernel):
//     widening won on an Intel Xeon without AMX in use, dot on an AMD EPYC, amx on an
//     Intel Xeon with it.
//   int8 (weight-only, --quantization=int8): wp[P, K4 * 4, 64] with K4 = ceil(K / 4)
//     and a scale per column, scale[P, 64]: the weights widened to f32 for the f32
//     kernel's FMAs, x kept in f32, each output times its column's scale.
//
// Why: XLA CPU's GEMM re-packs the weight operand on every call. A decode step multiplies
// a few rows by every weight, so the packing pass (a read and a write of all weights)
// costs more than the product itself. With panels packed at load, each panel streams
// from memory once per call and stays in L2 while every 6-row tile of x passes over it.
// A panel row (one k step: 64 f32, or a k pair: 128 bf16) is 256 bytes in both dtypes.
//
// Every output row is computed with the same instruction sequence over k whatever M is
// and wherever the row falls in a tile, so a row's result does not depend on its batch.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 64;       // panel width: 4 zmm registers of 16 floats
constexpr int64_t kMR = 6;        // rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast
constexpr int64_t kMChunk = 96;   // rows per work unit, so large M splits across threads
constexpr int64_t kRowBytes = 256;  // one panel step, both dtypes

inline float Bf16ToF32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}
// How far ahead of itself a one-row unit prefetches its own stream (a panel's rows, then
// the next panel's, which follows it in memory); int8 twice as far (Int8Step::kAhead).
// Without it a bf16 row read 9-19 GB/s at SmolLM2's shapes against f32's 13-27: per byte
// it issues about twice the uops (widening), so the out-of-order window holds half the
// bytes in flight. 4-8 KiB measured best of 1-16 KiB (interleaved A/B, 30 distinct
// weights per call: bf16 M=1 1.2-1.9x; docs/benchmarks.md).
constexpr int64_t kStreamAhead = 4096;
// The same for the first tile of a unit of several tiles (Unit), which streams its panel
// in for the tiles after it. A one-row tile issues few uops a byte, so the out-of-order
// window runs its loads far ahead of the prefetches; a 6-row tile issues 6x the FMAs a
// byte, and its prefetches are most of what is in flight. Interleaved A/B (AMD EPYC Zen
// 4; f32, SmolLM2 shapes, 30 distinct weights a chain) against 4 KiB: 8 rows 0.85-0.95x
// the time a call, 12 rows 0.87-0.98x, 16-32 rows 0.99-1.00x, 32-64 KiB no better; bf16
// (vdpbf16ps) 8 rows 0.90-0.99x. One row stays best at 4 KiB there too (8-16 KiB:
// 0.99-1.15x the time).
constexpr int64_t kStreamAheadTiles = 16384;

// The panel's 64 columns as native vectors (simd16.h, vn): 4 on AVX-512, 8 on AVX2.
constexpr int kVecs = kNR / vn::kLanes;

// One k step (f32) of a tile of J native vectors of columns (from the pointer w):
// acc[m] += x[m, k] * w[k, 0:J lanes].
struct F32Step {
  using T = float;
  using X = float;
  static constexpr int64_t kPerStep = 64;            // panel elements per step
  static constexpr int64_t kPerVec = vn::kLanes;     // of them per native vector
  static constexpr int64_t kStepBytes = kRowBytes;   // memory a step reads
  static constexpr int64_t kAhead = kStreamAhead;  // a one-row unit's stream-ahead
  template <int MR, int J>
  static inline void Run(vn::F (&acc)[MR][J], const float* x, int64_t ldx, const float* w,
                         int64_t k) {
    vn::F wv[J];
    for (int j = 0; j < J; ++j) wv[j] = vn::loadu(w + vn::kLanes * j);
    for (int m = 0; m < MR; ++m) {
      const vn::F b = vn::set1(x[m * ldx + k]);
      for (int j = 0; j < J; ++j) acc[m][j] = vn::fmadd(b, wv[j], acc[m][j]);
    }
  }
};

// One k-pair step (bf16, weights widened) of a tile:
// acc[m] += x[m, 2s:2s+2] . w[2s:2s+2, 0:J lanes].
struct Bf16WidenStep {
  using T = uint16_t;
  using X = float;  // x rounded once per call (RoundX), kept f32: its broadcasts are loads
  static constexpr int64_t kPerStep = 128;
  static constexpr int64_t kPerVec = 2 * vn::kLanes;
  static constexpr int64_t kStepBytes = kRowBytes;
  static constexpr int64_t kAhead = kStreamAhead;  // a one-row unit's stream-ahead
  template <int MR, int J>
  static inline void Run(vn::F (&acc)[MR][J], const X* x, int64_t ldx, const uint16_t* w,
                         int64_t s) {
    for (int half = 0; half < 2; ++half) {
      vn::F wv[J];
      for (int j = 0; j < J; ++j) {
        const vn::I raw = vn::loadu_si(w + 2 * vn::kLanes * j);
        wv[j] = half == 0 ? vn::widen_even(raw) : vn::widen_odd(raw);
      }
      // A broadcast from memory is a load-port uop; one from a bf16 scalar was a shift
      // and a vpbroadcastd on the FMA ports (M=32: 12 of every 68 port-0/5 uops).
      for (int m = 0; m < MR; ++m) {
        const vn::F b = vn::set1(x[m * ldx + 2 * s + half]);
        for (int j = 0; j < J; ++j) acc[m][j] = vn::fmadd(b, wv[j], acc[m][j]);
      }
    }
  }
};

// One step of 4 k rows (int8 weights, widened to f32) of a tile:
// acc[m] += x[m, 4s:4s+4] . q[4s:4s+4, 0:J lanes], the k rows in order (the f32 kernel's
// sequence over k). The panel's rows are 64 bytes, so a step is 256 bytes as in the other
// dtypes; the column scales multiply y after the tile (ScaleColumns).
struct Int8Step {
  using T = int8_t;
  using X = float;
  static constexpr int64_t kPerStep = 256;
  static constexpr int64_t kPerVec = vn::kLanes;
  static constexpr int64_t kStepBytes = kRowBytes;
  // A one-row unit's stream-ahead: each 256-byte step widens 64 bytes four times
  // (16 widen-and-convert pairs and 16 FMAs against f32's 4 FMAs), so the
  // out-of-order window holds fewer bytes in flight. One-row int8 decode step,
  // interleaved A/B against 4 KiB (AMD EPYC Zen 4): 8 KiB 0.88x / 0.94x / 0.95x
  // the time in three runs, 16 KiB 0.94x / 1.00x.
  static constexpr int64_t kAhead = 2 * kStreamAhead;
  template <int MR, int J>
  static inline void Run(vn::F (&acc)[MR][J], const X* x, int64_t ldx, const int8_t* w,
                         int64_t s) {
    for (int r = 0; r < 4; ++r) {
      vn::F wv[J];
      for (int j = 0; j < J; ++j) wv[j] = vn::widen_i8(w + kNR * r + vn::kLanes * j);
      for (int m = 0; m < MR; ++m) {
        const vn::F b = vn::set1(x[m * ldx + 4 * s + r]);
        for (int j = 0; j < J; ++j) acc[m][j] = vn::fmadd(b, wv[j], acc[m][j]);
      }
    }
  }
};

#ifdef __AVX512BF16__
// One k-pair step (bf16, vdpbf16ps) of a tile: the same sum as Bf16WidenStep, each pair
// of products added before the accumulator.
struct Bf16DotStep {
  using T = uint16_t;
  using X = uint16_t;  // vdpbf16ps takes the x pair as bf16
  static constexpr int64_t kPerStep = 128;
  static constexpr int64_t kPerVec = 32;
  static constexpr int64_t kStepBytes = kRowBytes;
  static constexpr int64_t kAhead = kStreamAhead;  // a one-row unit's stream-ahead
  template <int MR, int J>
  static inline void Run(vn::F (&acc)[MR][J], const X* x, int64_t ldx, const uint16_t* w,
                         int64_t s) {
    static_assert(J == 4, "AVX-512 only: whole panels");
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(w + 32 * j);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // x[m, 2s] and x[m, 2s + 1], broadcast to every lane
      std::memcpy(&pair, x + m * ldx + 2 * s, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b, (__m512bh)wv[j]);
    }
  }
};
#endif

#ifdef __AVX512BW__
// bf16 weights in 12 bits, losslessly (pack_x12 in cpu_kernels/__init__.py): a bf16
// is a high byte (sign and 7 exponent bits) and a low byte (the last exponent bit and 7
// mantissa bits). Across a matrix the high byte takes few values (SmolLM2: 11-23, ~2.7
// bits of entropy), so it is stored as a 4-bit code into a table of the matrix's 16
// (0x00 always among them); the rest, ~0.02% of SmolLM2's weights, are exceptions: they
// decode to +0 and a list adds them after the product (X12Exceptions). Decoding costs a
// few byte shuffles a step, and a one-row product, which waits on memory, reads 3/4 of
// bf16's bytes.
//
// A step (one k pair of 64 columns, the 128 bf16 of a plain bf16 panel row) is 192
// bytes: 128 low bytes, then 64 bytes of codes. Word t = 32 j + w of the plain row (the
// zmm j of Bf16DotStep's operands) has its low byte at 64 (j / 2) + b and its code in the
// low (j < 2) or high (j >= 2) nibble of code byte b, where b = 16 (w / 8) + 8 (j % 2) +
// w % 8: vpunpck{l,h}bw interleave bytes 0-7 / 8-15 of each 128-bit lane,
// so the low bytes and the looked-up high bytes come out as the plain row's words.
constexpr int64_t kX12StepBytes = 192;

// Step s of a compressed panel -> the plain bf16 row's 4 zmm (Bf16DotStep's wv).
inline void X12Decode(const uint8_t* step, __m512i table, __m512i (&wv)[4]) {
  const __m512i lo0 = _mm512_loadu_si512(step);
  const __m512i lo1 = _mm512_loadu_si512(step + 64);
  const __m512i codes = _mm512_loadu_si512(step + 128);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i hi0 = _mm512_shuffle_epi8(table, _mm512_and_si512(codes, nibble));
  const __m512i hi1 =
      _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble));
  wv[0] = _mm512_unpacklo_epi8(lo0, hi0);
  wv[1] = _mm512_unpackhi_epi8(lo0, hi0);
  wv[2] = _mm512_unpacklo_epi8(lo1, hi1);
  wv[3] = _mm512_unpackhi_epi8(lo1, hi1);
}

// Decoded row s into a plain bf16 panel at `store` (128 bf16 a row), unless null.
inline void X12Store(uint16_t* store, int64_t s, const __m512i (&wv)[4]) {
  if (store == nullptr) return;
  for (int j = 0; j < 4; ++j) _mm512_storeu_si512(store + 128 * s + 32 * j, wv[j]);
}

// The 16 table bytes in each 128-bit lane (vpshufb looks up within lanes).
inline __m512i X12Table(const uint8_t* table) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
}

// What the two decoding steps share: the panel's layout and the decoder's state.
struct X12Step {
  using T = uint8_t;
  static constexpr int64_t kPerStep = kX12StepBytes;
  static constexpr int64_t kPerVec = 0;  // whole panels only (AVX-512)
  static constexpr int64_t kStepBytes = kX12StepBytes;
  static constexpr int64_t kAhead = kStreamAhead;
  __m512i table;  // X12Table
  uint16_t* store = nullptr;  // non-null: the decoded rows also go here (X12Store)
};

// A compressed panel's k pair decoded, then Bf16WidenStep's products: the same sums in
// the same order as Bf16WidenStep over the decoded panel (RunX12's cached path).
struct X12WidenStep : X12Step {
  using X = float;
  template <int MR, int J>
  inline void Run(vn::F (&acc)[MR][J], const X* x, int64_t ldx, const uint8_t* w,
                  int64_t s) const {
    static_assert(J == 4, "AVX-512 only: whole panels");
    __m512i raw[4];
    X12Decode(w, table, raw);
    X12Store(store, s, raw);
    for (int half = 0; half < 2; ++half) {
      vn::F wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = half == 0 ? vn::widen_even(raw[j]) : vn::widen_odd(raw[j]);
      for (int m = 0; m < MR; ++m) {
        const vn::F b = vn::set1(x[m * ldx + 2 * s + half]);
        for (int j = 0; j < 4; ++j) acc[m][j] = vn::fmadd(b, wv[j], acc[m][j]);
      }
    }
  }
};
#endif

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
// A compressed panel's k pair decoded, then Bf16DotStep's products (same order).
struct X12DotStep : X12Step {
  using X = uint16_t;
  template <int MR, int J>
  inline void Run(vn::F (&acc)[MR][J], const X* x, int64_t ldx, const uint8_t* w,
                  int64_t s) const {
    static_assert(J == 4, "AVX-512 only: whole panels");
    __m512i wv[4];
    X12Decode(w, table, wv);
    X12Store(store, s, wv);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * s, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b, (__m512bh)wv[j]);
    }
  }
};
#endif

// Rows [begin, end) of the next panel to pull into L2 while a tile computes, spread
// evenly over the tile's steps (a burst of prefetches stalls on the fill buffers); or,
// `stream` > 0, the tile's own panel that many bytes ahead of each step.
//
// `once`: the data prefetched is read by one pass of one tile and not again (a one-row
// unit's own panel; the next panel where a single tile will read it): non-temporal, so
// the weights stream past the caches. Otherwise the later tiles of a unit read the panel
// from L2, so it is fetched there (T1).
// Whether `once` prefetches are non-temporal. On AMD (Zen 3 / 4) they are: see TileHint.
// On Intel (a Sapphire Rapids-class Xeon with AVX-512 and AMX), prefetchnta streamed a
// one-row unit's panel at 8.5-11 GB/s against 22-33 GB/s fetched T1 (bench_cpu_matmul.py
// --rows=1 --contenders=f32, SmolLM2 shapes: qkv 234 -> 75 us, lm_head 9.7 -> 4.0 ms),
// so one row decoded slower than eight: the SmolLM2 f32 one-row decode step took 50.9 ms
// non-temporal and 21.8 ms T1 (bench_one_batch.py --decode_batches=1,2,4,8,16; 2-4 rows
// likewise 2.3x). T0 was no better than T1 there.
inline bool NonTemporalOnce() {
  static const bool non_temporal = [] {
    __builtin_cpu_init();  // this may run in the library's constructors, before libgcc's
    return !__builtin_cpu_is("intel");
  }();
  return non_temporal;
}

struct Prefetch {
  const char* next = nullptr;
  int64_t begin = 0, end = 0;
  int64_t stream = 0;
  bool once = false;
};


// Native vectors of columns per tile of MR rows: the whole panel where the registers hold
// MR x kVecs accumulators and a panel row (AVX-512's 32 zmm: 6 x 4 + 4), else fewer, so
// that AVX2's 16 ymm registers hold a 6-row tile's 12 accumulators, its 2 weight vectors
// and a broadcast; a row tile then passes over its panel once per group of columns
// (from L2 after the first). Whole-panel tiles of 6 rows, as 16-lane pairs, spill on
// AVX2 and are 1.6-3.5x slower at M=32 than these on a Zen 3
// (scripts/bench/bench_cpu_matmul.py --rows=1,32; docs/benchmarks.md, CPU kernels).
template <int MR>
constexpr int Groups() {
  if constexpr (vn::kLanes == 16 || MR == 1) {
    return kVecs;
  } else {
    return MR == 2 ? kVecs / 2 : kVecs / 4;
  }
}

// Tile's body, its prefetches with hint kHint (a constant for _mm_prefetch; Tile picks it
// from Prefetch::once, outside the step loop).
template <typename Step, int MR, int J, int kHint>
inline void TileHint(const Step& step, const typename Step::X* x, int64_t ldx,
                     const typename Step::T* panel, int64_t steps, float* y, int64_t ldy,
                     const vn::Mask* mask, Prefetch pf) {
  vn::F acc[MR][J];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = vn::setzero();
  const int64_t pf_rows = pf.next != nullptr ? pf.end - pf.begin : 0;
  int64_t pf_row = pf.begin, pf_acc = 0;  // fixed point: pf_rows rows per `steps` steps
  // Past the last panel this touches memory beyond the weights: prefetches never fault.
  // Non-temporal where read once: weights fetched into L3 push out the host thread's
  // working set, whose Python then runs several times slower beside the kernels (one
  // SmolLM2 12-bit decode row: 0.75 ms of host CPU a step against 0.88 with T1, ~8% more
  // single-stream tokens a second). Panels that later tiles reread are fetched T1:
  // non-temporal there makes 8-row decode steps 1.1-1.25x slower (f32, bf16, 12-bit).
  const char* ahead = reinterpret_cast<const char*>(panel) + pf.stream;
  for (int64_t k = 0; k < steps; ++k) {
    if (pf.stream > 0) {
      for (int line = 0; line < Step::kStepBytes / 64; ++line)
        _mm_prefetch(ahead + k * Step::kStepBytes + 64 * line, (_mm_hint)kHint);
    } else if (pf_rows == steps) {  // one row per step (a 2-tile unit): no bookkeeping
      const char* p = pf.next + k * kRowBytes;
      for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, (_mm_hint)kHint);
    } else {
      for (pf_acc += pf_rows; pf_acc >= steps; pf_acc -= steps, ++pf_row) {
        const char* p = pf.next + pf_row * kRowBytes;
        for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, (_mm_hint)kHint);
      }
    }
    step.template Run<MR, J>(acc, x, ldx, panel + k * Step::kPerStep, k);
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < J; ++j)
      vn::mask_storeu(y + m * ldy + vn::kLanes * j, mask[j], acc[m][j]);
}

// y[0:MR, 0:J lanes] = x[0:MR, :] @ the panel's J native vectors of columns from `panel`
// (that many elements into each panel row) over `steps` steps; columns beyond the matrix
// are masked.
template <typename Step, int MR, int J>
inline void Tile(const Step& step, const typename Step::X* x, int64_t ldx,
                 const typename Step::T* panel, int64_t steps, float* y, int64_t ldy,
                 const vn::Mask* mask, Prefetch pf) {
  if (pf.once && NonTemporalOnce()) {
    TileHint<Step, MR, J, _MM_HINT_NTA>(step, x, ldx, panel, steps, y, ldy, mask, pf);
  } else {
    TileHint<Step, MR, J, _MM_HINT_T1>(step, x, ldx, panel, steps, y, ldy, mask, pf);
  }
}

// y[0:MR, 0:64] = x[0:MR, :] @ panel, a group of columns at a time (Groups); the first
// pass does the tile's prefetching.
template <typename Step, int MR>
inline void TileRow(const Step& step, const typename Step::X* x, int64_t ldx,
                    const typename Step::T* panel, int64_t steps, float* y, int64_t ldy,
                    const vn::Mask* mask, Prefetch pf) {
  constexpr int J = Groups<MR>();
  for (int g = 0; g < kVecs; g += J)
    Tile<Step, MR, J>(step, x, ldx, panel + g * Step::kPerVec, steps, y + vn::kLanes * g,
                      ldy, mask + g, g == 0 ? pf : Prefetch{});
}

// Panel p's columns that exist (of N), as each native vector's lane mask.
inline void ColumnMasks(int64_t N, int64_t p, vn::Mask (&mask)[kVecs]) {
  const int64_t cols = std::min(kNR, N - p * kNR);
  for (int j = 0; j < kVecs; ++j)
    mask[j] = vn::first_lanes(std::clamp<int64_t>(cols - vn::kLanes * j, 0, vn::kLanes));
}

// Up to this many rows, AVX2 runs a unit row by row, each row with one-row tiles over
// the whole panel width (the first streams the panel in, the others read it from L2).
// The 6 x 16 tiles pass over a panel four times, each pass reading 64 of every 256
// bytes, and at few rows that strided reading cost more than the extra passes. On a
// Zen 3, bench_cpu_matmul.py, 30 layers + head, A B A B, f32 ms a step at 2 / 4 / 8
// rows: tiles 42.2-48.0 / 63.8-68.3 / 86.0-87.1, row by row 35.1-35.6 / 42.2-47.4 /
// 57.1-63.3 (bf16: 23.1-24.4 / 34.5-35.7 / 48.0-49.8 -> 20.9-21.8 / 27.6-29.5 /
// 41.0-43.3); one row unchanged; at 12-16 rows the two are even in f32 and tiles win in
// bf16. Each row runs the same FMA sequence either way, so results are bitwise the same.
constexpr int64_t kRowByRow = 8;

// Rows [m0, m1) of panel `p`. The first tile reads this panel from memory; the later
// ones compute from L2 and share out the prefetch of `next`.
//
// With more than one tile the first also streams its own panel ahead of itself
// (kStreamAheadTiles): the later tiles' prefetch of `next` covers the panel only when
// they run long enough, and at 7-14 rows (a 6-row tile and a short one) they run a
// fraction of the panel's memory time, so the next unit's first tile would stall on its
// loads. Interleaved A/B in one process (AMD EPYC Zen 4, 2 vCPU; SmolLM2 shapes, 30
// distinct weights a chain), streaming 4 KiB ahead against none: f32 one call at 7-14
// rows 0.73-0.96x the time, bf16 (vdpbf16ps) 0.77-0.99x; the 8-row f32 decode step
// 30.6 against 40.1 ms, 12 rows 0.93x; 1-6 and 16-32 rows level (0.95-1.04x). How far
// ahead: kStreamAheadTiles.
//
// `next_rows`: how many kRowBytes rows of `next` to prefetch (its size; `steps` where it
// is a panel like this one). `cached`: the panel is already in L2 (a compressed panel
// decoded there, RunX12), so no tile streams it and all of them share out `next`.
template <typename Step>
void Unit(const Step& step, const typename Step::X* x, const typename Step::T* panel,
          float* y, int64_t ldx, int64_t steps, int64_t N, int64_t p, int64_t m0, int64_t m1,
          const char* next, int64_t next_rows, bool cached = false) {
  vn::Mask mask[kVecs];
  ColumnMasks(N, p, mask);
  if (vn::kLanes == 8 && m1 - m0 <= kRowByRow) {
    for (int64_t m = m0; m < m1; ++m) {
      Prefetch pf;
      pf.stream = m == m0 ? Step::kAhead : 0;
      pf.once = m1 - m0 == 1;  // more rows reread the panel from L2
      TileRow<Step, 1>(step, x + m * ldx, ldx, panel, steps, y + m * N + p * kNR, N, mask, pf);
    }
    return;
  }
  const int64_t tiles = (m1 - m0 + kMR - 1) / kMR;
  for (int64_t m = m0, tile = 0; m < m1; m += kMR, ++tile) {
    const typename Step::X* xm = x + m * ldx;
    float* ym = y + m * N + p * kNR;
    Prefetch pf;
    if (cached) {  // tile i of 0..tiles-1 takes its share of next's rows
      // The next compressed panel: its unit's first tile reads it once and decodes it.
      if (next != nullptr)
        pf = {next, tile * next_rows / tiles, (tile + 1) * next_rows / tiles, 0, true};
    } else if (tiles > 1 && tile == 0) {
      pf.stream = kStreamAheadTiles;
    } else if (next != nullptr && tile > 0) {  // tile i of 1..tiles-1 takes its share of rows
      pf = {next, (tile - 1) * next_rows / (tiles - 1), tile * next_rows / (tiles - 1)};
    } else if (m1 - m0 == 1) {
      pf.stream = Step::kAhead;
      pf.once = true;
    } else if (next != nullptr && tiles == 1) {
      // 2-6 rows: memory-bound, and the hardware prefetcher alone falls behind (30 layers
      // + head, A B A B: M=2 25 against 29 ms without, M=4 27 against 33 ms). One tile
      // reads the next panel in one pass where a tile spans the panel (Groups).
      pf = {next, 0, next_rows, 0, Groups<kMR>() == kVecs};
    }
    switch (std::min(kMR, m1 - m)) {
      case 6: TileRow<Step, 6>(step, xm, ldx, panel, steps, ym, N, mask, pf); break;
      case 5: TileRow<Step, 5>(step, xm, ldx, panel, steps, ym, N, mask, pf); break;
      case 4: TileRow<Step, 4>(step, xm, ldx, panel, steps, ym, N, mask, pf); break;
      case 3: TileRow<Step, 3>(step, xm, ldx, panel, steps, ym, N, mask, pf); break;
      case 2: TileRow<Step, 2>(step, xm, ldx, panel, steps, ym, N, mask, pf); break;
      default: TileRow<Step, 1>(step, xm, ldx, panel, steps, ym, N, mask, pf); break;
    }
  }
}

// Row chunks [begin, end) of at most kMChunk rows, none crossing a gap between the rows
// a call computes (RowMask), so large M splits across threads.
using Chunks = std::vector<std::pair<int64_t, int64_t>>;

// y[m0:m1, panel p's columns] *= scale[p's 64]: an int8 unit's column scales, applied
// while its outputs are still in L1.
inline void ScaleColumns(float* y, int64_t N, int64_t p, int64_t m0, int64_t m1,
                         const float* scale) {
  const int64_t c0 = p * kNR, cols = std::min(kNR, N - c0);
  for (int64_t m = m0; m < m1; ++m) {
    float* row = y + m * N + c0;
    for (int64_t c = 0; c < cols; ++c) row[c] *= scale[c0 + c];
  }
}

// Work units are (panel, row chunk) pairs in panel-major order, one contiguous range per
// thread (ParallelStealing) so that each thread prefetches its own next panel. `scale`
// (int8 weights: [P * 64] column scales, else null) multiplies each unit's y.
template <typename Step>
void Run(ffi::ThreadPool& pool, const typename Step::X* x, const typename Step::T* w,
         float* y, const Chunks& rows, int64_t ldx, int64_t steps, int64_t N, int64_t P,
         const float* scale = nullptr) {
  const int64_t chunks = static_cast<int64_t>(rows.size());
  const int64_t panel_elems = steps * Step::kPerStep;
  const Step step{};
  xlaserve::ParallelStealing(pool, P * chunks, [=, &rows, &step](int64_t u, int64_t after) {
    const int64_t p = u / chunks, c = u % chunks;
    const char* next = c == chunks - 1 && after == u + 1
                           ? reinterpret_cast<const char*>(w + (p + 1) * panel_elems)
                           : nullptr;
    Unit<Step>(step, x, w + p * panel_elems, y, ldx, steps, N, p, rows[c].first,
               rows[c].second, next, steps);
    if (scale != nullptr) ScaleColumns(y, N, p, rows[c].first, rows[c].second, scale);
  });
}

// The rows of y[M, N] a call computes, as chunks: `mask` [M] (nonzero: compute) or, empty,
// all of them. A bucketed batch pads its tokens to a fixed count; on this compute-bound
// path a padding row costs what a real one does (a decode step of 17 rows in the 32
// bucket took 80 ms against 49 at 16), so the runner masks them out. Masked rows of y are
// zeroed, so what follows them stays finite.
ffi::ErrorOr<Chunks> RowMask(ffi::Buffer<ffi::S32>& mask, int64_t M, float* y, int64_t N) {
  Chunks chunks;
  const int64_t n = static_cast<int64_t>(mask.element_count());
  if (n != 0 && n != M)
    return ffi::Unexpected(
        ffi::Error::InvalidArgument("packed_matmul: the row mask is [M] or empty"));
  const int32_t* m = mask.typed_data();
  for (int64_t r = 0; r < M;) {
    if (n != 0 && m[r] == 0) {
      std::memset(y + r * N, 0, N * sizeof(float));
      ++r;
      continue;
    }
    int64_t end = r + 1;
    while (end < M && end - r < kMChunk && (n == 0 || m[end] != 0)) ++end;
    chunks.emplace_back(r, end);
    r = end;
  }
  return chunks;
}

// x [M, K] f32 rounded to bf16 (round to nearest even, XLA's f32 -> bf16 convert) as
// [M, ld], ld >= K (zero past K; only the rows the call computes), in a buffer of the
// calling thread, valid until its next call (the helpers read it only while Run waits
// for them): M * K values against the product's M * K * N multiply-adds. The widening
// kernel keeps the rounded values as f32 (its broadcasts are loads), the vdpbf16ps and
// AMX ones as bf16 pairs. Rounding here, not in XLA, saves a convert-and-pad fusion
// before every bf16 call of the layer loop.
template <typename X>
const X* RoundX(const float* x, int64_t M, int64_t K, int64_t ld, const Chunks& rows,
                int64_t spare_rows = 0) {
  thread_local std::vector<X> buf;
  // spare_rows past M: readable memory for AMX tiles that load 16 rows at a time.
  if (static_cast<int64_t>(buf.size()) < (M + spare_rows) * ld)
    buf.resize((M + spare_rows) * ld);
  const v16::I half = v16::set1_epi32(0x7FFF), one = v16::set1_epi32(1);
  const v16::I top = v16::set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (const auto& [begin, end] : rows)
  for (int64_t m = begin; m < end; ++m) {
    const float* row = x + m * K;
    X* out = buf.data() + m * ld;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const v16::I v = v16::castps_si(v16::loadu_ps(row + k));
      const v16::I lsb = v16::and_si(v16::srli_epi32<16>(v), one);
      const v16::I r = v16::add_epi32(v, v16::add_epi32(half, lsb));
      if constexpr (sizeof(X) == 4) {
        v16::storeu_si(out + k, v16::and_si(r, top));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                            v16::cvtepi32_epi16(v16::srli_epi32<16>(r)));
      }
    }
    for (; k < ld; ++k) {
      uint32_t bits = 0;
      if (k < K) {
        std::memcpy(&bits, row + k, sizeof(bits));
        bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
      }
      if constexpr (sizeof(X) == 4) {
        std::memcpy(out + k, &bits, sizeof(bits));
      } else {
        out[k] = static_cast<uint16_t>(bits >> 16);
      }
    }
  }
  return buf.data();
}

ffi::Error CheckN(int64_t N, int64_t P) {
  if (N > P * kNR || N <= (P - 1) * kNR)
    return ffi::Error::InvalidArgument("packed_matmul: N does not match the panel count");
  return ffi::Error::Success();
}

// The matrix a call multiplies by: wp holds one (`rank` dims: f32 [P, K, 64], bf16
// [P, K2, 64, 2]) or a stack of them, one per layer, with a leading [L] dim; `layer`
// picks one. The layer loop passes the whole stack and its traced index, so the kernel
// reads the layer's panels in place: sliced on the XLA side, XLA CPU copies the slice
// before the call, and a `lax.switch` over per-layer buffers made a one-row decode step
// 1.05x slower (interleaved A/B, docs/benchmarks.md).
struct Matrix {
  int64_t offset = 0;  // elements from wp's start to the layer's matrix
  ffi::Span<const int64_t> dims;  // the matrix's own `rank` dims
};

ffi::ErrorOr<Matrix> LayerMatrix(ffi::Span<const int64_t> wd, size_t rank,
                                 ffi::Buffer<ffi::S32>& layer) {
  if (layer.element_count() != 1)
    return ffi::Unexpected(ffi::Error::InvalidArgument("packed_matmul: layer is a scalar"));
  if (wd.size() == rank) return Matrix{0, wd};
  if (wd.size() != rank + 1)
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "packed_matmul: want one packed matrix or a stack of them"));
  const int64_t l = *layer.typed_data();
  if (l < 0 || l >= wd[0])
    return ffi::Unexpected(ffi::Error::InvalidArgument("packed_matmul: layer out of range"));
  int64_t size = 1;
  for (size_t i = 1; i < wd.size(); ++i) size *= wd[i];
  return Matrix{l * size, wd.last(rank)};
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::S32> layer,
                        ffi::Buffer<ffi::S32> mask, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  const auto m = LayerMatrix(wp.dimensions(), 3, layer);
  if (m.has_error()) return m.error();
  const auto wd = m->dims;
  if (xd.size() != 2 || yd.size() != 2 || wd[2] != kNR || wd[1] != xd[1] || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("packed_matmul: want x [M, K], w [P, K, 64], y [M, N]");
  if (auto e = CheckN(yd[1], wd[0]); e.failure()) return e;
  const auto rows = RowMask(mask, xd[0], y->typed_data(), yd[1]);
  if (rows.has_error()) return rows.error();
  if (rows->empty()) return ffi::Error::Success();
  Run<F32Step>(pool, x.typed_data(), wp.typed_data() + m->offset, y->typed_data(), *rows,
               xd[1], xd[1], yd[1], wd[0]);
  return ffi::Error::Success();
}

// x [M, K] f32 as [M, ld] rows (ld = K rounded up to 4, zero past K: an int8 step reads
// 4 k at a time) in a buffer of the calling thread, as RoundX; x itself when K % 4 == 0.
const float* PadX(const float* x, int64_t M, int64_t K, int64_t ld, const Chunks& rows) {
  if (ld == K) return x;
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < M * ld) buf.resize(M * ld);
  for (const auto& [begin, end] : rows)
    for (int64_t m = begin; m < end; ++m) {
      std::memcpy(buf.data() + m * ld, x + m * K, K * sizeof(float));
      std::fill(buf.data() + m * ld + K, buf.data() + (m + 1) * ld, 0.0f);
    }
  return buf.data();
}

// Weight-only int8: y = (x @ q) * scale, q [P, K4 * 4, 64] int8 (K4 = ceil(K / 4), zero
// rows past K), scale [P, 64] f32 per column (zero past N); a stack of them takes a
// leading [L] on both, and `layer` picks one. x stays f32: the products are exact in f32
// (an int8 times an f32 with 24 significant bits) and sum in the f32 kernel's order.
ffi::Error PackedMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S8> wp, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> mask,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  const auto m = LayerMatrix(wp.dimensions(), 3, layer);
  if (m.has_error()) return m.error();
  const auto s = LayerMatrix(scale.dimensions(), 2, layer);
  if (s.has_error()) return s.error();
  const auto wd = m->dims;
  if (xd.size() != 2 || yd.size() != 2 || wd[2] != kNR || (xd[1] + 3) / 4 * 4 != wd[1] ||
      yd[0] != xd[0] || s->dims[0] != wd[0] || s->dims[1] != kNR)
    return ffi::Error::InvalidArgument(
        "packed_matmul: want x [M, K] f32, w [P, ceil(K / 4) * 4, 64] int8, scale [P, 64] "
        "f32, y [M, N]");
  if (auto e = CheckN(yd[1], wd[0]); e.failure()) return e;
  const auto rows = RowMask(mask, xd[0], y->typed_data(), yd[1]);
  if (rows.has_error()) return rows.error();
  if (rows->empty()) return ffi::Error::Success();
  const float* xs = PadX(x.typed_data(), xd[0], xd[1], wd[1], *rows);
  Run<Int8Step>(pool, xs, wp.typed_data() + m->offset, y->typed_data(), *rows, wd[1],
                wd[1] / 4, yd[1], wd[0], scale.typed_data() + s->offset);
  return ffi::Error::Success();
}

// The bf16 product of a call after its checks: x [M, K] f32 (rows: the ones to compute)
// by panels w [P, K2, 64, 2] into y [M, N].
using Bf16Body = void (*)(ffi::ThreadPool&, const float* x, int64_t M, int64_t K,
                          const uint16_t* w, int64_t K2, float* y, int64_t N, int64_t P,
                          const Chunks& rows);

template <typename Step>
void RunBf16(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w,
             int64_t K2, float* y, int64_t N, int64_t P, const Chunks& rows) {
  const auto* xs = RoundX<typename Step::X>(x, M, K, 2 * K2, rows);
  Run<Step>(pool, xs, w, y, rows, 2 * K2, K2, N, P);
}

#ifdef __AVX512BW__
// Exceptions of a compressed matrix (weights whose high byte has no code; they decode to
// +0): `start` [P + 1] bounds each panel's run of `exc` [E, 2], (k * 64 + column, the
// bf16's bits) in increasing position. Each adds x[m, k] * w to y[m, column] after the
// panel's product, in that order whichever path computed it, so a row's result does not
// depend on its batch. x: the rounded rows RoundX made (f32 or bf16 bits).
//
// Row by row: y's rows are N floats apart, and at N = 3072 (SmolLM2's gate_up) every row's
// line of a column falls in one L1 set, so a pass over the rows per exception evicted
// each line it touched: 4 ns an exception and row, the 12-bit product at 32 rows
// 1.22x the time of one without exceptions (0.03% of the weights); a row's 64 outputs
// stay in L1 here (1.05x). Each output still takes its exceptions in the list's order.
template <typename X>
void X12Exceptions(const X* x, int64_t ldx, const int32_t* start, const int32_t* exc,
                   float* y, int64_t N, int64_t p, int64_t m0, int64_t m1) {
  if (start[p] == start[p + 1]) return;
  for (int64_t m = m0; m < m1; ++m) {
    const X* xm = x + m * ldx;
    float* ym = y + m * N + p * kNR;
    for (int64_t e = start[p]; e < start[p + 1]; ++e) {
      const int32_t pos = exc[2 * e];
      float xv;
      if constexpr (sizeof(X) == 4) {
        xv = xm[pos / kNR];
      } else {
        xv = Bf16ToF32(xm[pos / kNR]);
      }
      ym[pos % kNR] += xv * Bf16ToF32(static_cast<uint16_t>(exc[2 * e + 1]));
    }
  }
}

// The bf16 product by compressed panels w [P, K2, 192] (X12Decode): a unit of one tile
// (1-6 rows; a decode step) decodes each step as it goes (Fused), reading the panel once
// from memory. In a unit of several tiles, compute-bound, the first tile does the same
// and also stores the decoded panel in L2 (plain bf16), and the other tiles run Plain's
// tiles over that, as a bf16 call would, rather than decode it again each. Every row runs
// the same products in the same order either way.
// (A pass of its own decoding the panel before the tiles would wait on memory with
// nothing to compute, where the first tile of a bf16 unit streams its panel in while it
// computes.)
template <typename Fused, typename Plain>
void RunX12(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint8_t* w,
            const uint8_t* table, const int32_t* start, const int32_t* exc, int64_t K2,
            float* y, int64_t N, int64_t P, const Chunks& rows) {
  using X = typename Fused::X;
  const int64_t ldx = 2 * K2;
  const X* xs = RoundX<X>(x, M, K, ldx, rows);
  const int64_t chunks = static_cast<int64_t>(rows.size());
  const int64_t panel_bytes = K2 * kX12StepBytes;
  const int64_t next_rows = (panel_bytes + kRowBytes - 1) / kRowBytes;
  Fused fused;
  fused.table = X12Table(table);
  const Plain plain{};
  xlaserve::ParallelStealing(pool, P * chunks, [=, &rows, &fused, &plain](int64_t u,
                                                                          int64_t after) {
    const int64_t p = u / chunks, c = u % chunks;
    const int64_t m0 = rows[c].first, m1 = rows[c].second;
    const uint8_t* panel = w + p * panel_bytes;
    const char* next = c == chunks - 1 && after == u + 1
                           ? reinterpret_cast<const char*>(panel + panel_bytes)
                           : nullptr;
    if (m1 - m0 <= kMR) {
      Unit<Fused>(fused, xs, panel, y, ldx, K2, N, p, m0, m1, next, next_rows);
    } else {
      thread_local std::vector<uint16_t> plain_panel;
      plain_panel.resize(K2 * Plain::kPerStep);
      Fused first = fused;
      first.store = plain_panel.data();
      vn::Mask mask[kVecs];
      ColumnMasks(N, p, mask);
      Prefetch pf;
      pf.stream = kStreamAheadTiles;
      TileRow<Fused, kMR>(first, xs + m0 * ldx, ldx, panel, K2, y + m0 * N + p * kNR, N, mask,
                          pf);
      Unit<Plain>(plain, xs, plain_panel.data(), y, ldx, K2, N, p, m0 + kMR, m1, next,
                  next_rows, /*cached=*/true);
    }
    X12Exceptions(xs, ldx, start, exc, y, N, p, m0, m1);
  });
}

using X12Body = void (*)(ffi::ThreadPool&, const float* x, int64_t M, int64_t K,
                         const uint8_t* w, const uint8_t* table, const int32_t* start,
                         const int32_t* exc, int64_t K2, float* y, int64_t N, int64_t P,
                         const Chunks& rows);

// x [M, K] f32 @ the compressed bf16 matrix (w [P, K2, 192] uint8, table [16] uint8,
// start [P + 1] int32, exc [E, 2] int32), or a stack of them with a leading [L] on each
// and `layer` picking one -> y [M, N] f32.
template <X12Body Body>
ffi::Error PackedMatmulX12(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::U8> wp, ffi::Buffer<ffi::U8> table,
                           ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> exc,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> mask,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  const auto m = LayerMatrix(wp.dimensions(), 3, layer);
  if (m.has_error()) return m.error();
  const auto t = LayerMatrix(table.dimensions(), 1, layer);
  if (t.has_error()) return t.error();
  const auto s = LayerMatrix(start.dimensions(), 1, layer);
  if (s.has_error()) return s.error();
  const auto e = LayerMatrix(exc.dimensions(), 2, layer);
  if (e.has_error()) return e.error();
  const auto wd = m->dims;
  if (xd.size() != 2 || yd.size() != 2 || wd[2] != kX12StepBytes ||
      (xd[1] + 1) / 2 != wd[1] || yd[0] != xd[0] || t->dims[0] != 16 ||
      s->dims[0] != wd[0] + 1 || e->dims[1] != 2)
    return ffi::Error::InvalidArgument(
        "packed_matmul: want x [M, K] f32, w [P, ceil(K / 2), 192] uint8, table [16] "
        "uint8, start [P + 1] int32, exc [E, 2] int32, y [M, N]");
  if (auto err = CheckN(yd[1], wd[0]); err.failure()) return err;
  const int32_t* st = start.typed_data() + s->offset;
  if (st[0] < 0 || st[wd[0]] > e->dims[0])
    return ffi::Error::InvalidArgument("packed_matmul: exception bounds out of range");
  const auto rows = RowMask(mask, xd[0], y->typed_data(), yd[1]);
  if (rows.has_error()) return rows.error();
  if (rows->empty()) return ffi::Error::Success();
  Body(pool, x.typed_data(), xd[0], xd[1], wp.typed_data() + m->offset,
       table.typed_data() + t->offset, st, exc.typed_data() + e->offset, wd[1],
       y->typed_data(), yd[1], wd[0], *rows);
  return ffi::Error::Success();
}

// The two decoded products (a macro argument cannot hold the template's comma).
constexpr X12Body kX12Widen = RunX12<X12WidenStep, Bf16WidenStep>;
#ifdef __AVX512BF16__
constexpr X12Body kX12Dot = RunX12<X12DotStep, Bf16DotStep>;
#endif

auto X12Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bf16 on AMX (the tile matrix unit of Intel Xeons from Sapphire Rapids on): one
// tdpbf16ps multiplies a tile of x (16 rows x 16 k pairs) by one of the weights (16 k
// pairs x 16 columns, pairs interleaved) into 16 x 16 f32 accumulators, 8192
// multiply-adds an instruction (a probe on a Sapphire Rapids Xeon: 1.7-2.2 TFLOP/s a core,
// where the AVX-512 kernels reach 0.1-0.2 TFLOP/s on two cores at 32-128 rows). The
// panels are already its weight layout: a weight tile is 64 bytes of each of 16
// consecutive 256-byte panel rows, one strided load.
//
// A tile's 16 rows are independent (row r of the product reads row r of x only), so a
// row's result does not depend on its batch here either; a unit with fewer than 16 rows
// computes the others from whatever x holds there and drops them.
namespace amx {

constexpr int64_t kRows = 16;   // rows of x a tile holds
constexpr int64_t kPairs = 16;  // k pairs a tile step takes
constexpr int64_t kBlock = kPairs * kRowBytes / 2;  // bf16 elements of a panel per step

// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (asm/prctl.h): Linux hands a process the
// tile registers' 8 KiB of state only when asked; once asked, every thread has it.
bool Ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// Every tile 16 rows x 64 bytes: 0-3 accumulate y (16 rows x 64 columns in Step, 32 x 32
// in PairStep); Step loads x into 4 and the weights into 5-7 in turn (so a load need not
// wait on the product reading the last one), PairStep x into 4-5 and weights into 6-7.
void Configure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kRows;
  }
  _tile_loadconfig(&config);
}

// How far ahead of itself the first tile of a unit prefetches the panel it streams in
// (and then the next panel, which follows it in memory), into L1: two steps. One row at
// a time over 900 panels of [576, 64], two threads (a probe on a Xeon with AMX):
// 13.0-16.9 GB/s at 8-12 KiB into L1, 8.4-15.8 at 8 KiB into L2, 5.2-5.3 without
// (vdpbf16ps' one-row stream: 16.1-19.9).
constexpr int64_t kAhead = 2 * kBlock * 2;

// 16 lines from p (none when p is null) into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
// Always inlined: GCC 12 finds a function of prefetches alone free of side effects and
// drops its calls (this one's did, and the one-row stream read at a third of the speed).
template <int kHint>
__attribute__((always_inline)) inline void Prefetch16(const char* p) {
  if (p == nullptr) return;
  for (int line = 0; line < 16; ++line) _mm_prefetch(p + 64 * line, (_mm_hint)kHint);
}

// Accumulators += x's tile (16 rows, 16 pairs from x, rows ldx_bytes apart) @ the 16
// pairs of the panel at w, a tile of 16 columns at a time; prefetches the 4 KiB at `pf`
// between the loads, unless null.
template <int kHint>
inline void Step(const uint16_t* x, int64_t ldx_bytes, const uint16_t* w, const char* pf) {
  _tile_loadd(4, x, ldx_bytes);
  Prefetch16<kHint>(pf);
  _tile_loadd(5, w, kRowBytes);
  _tile_dpbf16ps(0, 4, 5);
  Prefetch16<kHint>(pf ? pf + 1024 : nullptr);
  _tile_loadd(6, w + 32, kRowBytes);
  _tile_dpbf16ps(1, 4, 6);
  Prefetch16<kHint>(pf ? pf + 2048 : nullptr);
  _tile_loadd(7, w + 64, kRowBytes);
  _tile_dpbf16ps(2, 4, 7);
  Prefetch16<kHint>(pf ? pf + 3072 : nullptr);
  _tile_loadd(5, w + 96, kRowBytes);
  _tile_dpbf16ps(3, 4, 5);
}

// Accumulators += two x tiles (rows 0-15 and 16-31 from x) @ the 16 pairs of 32 of the
// panel's columns at w: tiles 0 / 1 rows 0-15, columns 0-15 / 16-31, tiles 2 / 3 the
// same for rows 16-31. Four loads feed four products (Step: five for four), and every
// load has three others between it and its first use; prefetches the 4 KiB at `pf`.
template <int kHint>
inline void PairStep(const uint16_t* x, int64_t ldx_bytes, const uint16_t* w, const char* pf) {
  _tile_loadd(4, x, ldx_bytes);
  Prefetch16<kHint>(pf);
  _tile_loadd(6, w, kRowBytes);
  Prefetch16<kHint>(pf ? pf + 1024 : nullptr);
  _tile_loadd(5, x + kRows * ldx_bytes / 2, ldx_bytes);
  Prefetch16<kHint>(pf ? pf + 2048 : nullptr);
  _tile_loadd(7, w + 32, kRowBytes);
  Prefetch16<kHint>(pf ? pf + 3072 : nullptr);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// Accumulator tile t (0-3) to p, rows `stride` bytes apart (GCC's _tile_stored takes
// the register as a literal).
inline void StoreTile(int t, float* p, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    case 2: _tile_stored(2, p, stride); break;
    default: _tile_stored(3, p, stride); break;
  }
}

// Accumulator tile t (16 x 16 f32) into y rows [0, rows) from ym (rows N apart),
// columns [c, c + 16) clipped to `cols`; through `out` (16 x 16) when clipped.
inline void Store(int t, float* ym, int64_t N, int64_t rows, int64_t c, int64_t cols,
                  float* out) {
  if (c >= cols) return;
  if (rows == kRows && c + 16 <= cols) {
    StoreTile(t, ym + c, N * sizeof(float));
    return;
  }
  StoreTile(t, out, 16 * sizeof(float));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(ym + r * N + c, out + r * 16, std::min<int64_t>(16, cols - c) * sizeof(float));
}

// Rows [m0, m1) of panel `panel` (K2 pairs) into y's columns [c0, c0 + cols). x: bf16
// rows ldx apart, ldx a multiple of 2 kPairs (zero past K), readable 16 rows past m1.
// 32 rows at a time in two passes of 32 columns (PairStep), a last 16 or fewer in one
// pass of 64 (Step); each row sees the same products in the same order either way, so
// its result does not depend on the blocking. The first pass streams the panel in; the
// second, from L2, pulls `next` (the panel this thread computes next, or null) into L2
// meanwhile, as the f32 tiles do.
void Unit(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K2, float* y,
          int64_t N, int64_t c0, int64_t m0, int64_t m1, const char* next) {
  const int64_t steps = K2 / kPairs, rem = K2 % kPairs;
  // The panel's last rem pairs, zero-padded to a whole step: the rows past the panel are
  // another panel's (or past the weights' end), and x's zeros times them need not be 0.
  alignas(64) uint16_t tail[kBlock];
  if (rem != 0) {
    std::memcpy(tail, panel + steps * kBlock, rem * kRowBytes);
    std::memset(tail + rem * kRowBytes / 2, 0, (kPairs - rem) * kRowBytes);
  }
  alignas(64) float out[kRows * 16];
  const int64_t cols = std::min(kNR, N - c0);
  // The prefetch of pass `pass` at step s: the panel ahead of itself, then `next`.
  auto pf = [&](int64_t pass, int64_t s) -> const char* {
    if (pass == 0) return reinterpret_cast<const char*>(panel + s * kBlock) + kAhead;
    return pass == 1 && next != nullptr ? next + s * kBlock * 2 : nullptr;
  };
  Configure();
  int64_t pass = 0;
  for (int64_t m = m0; m < m1;) {
    const uint16_t* xm = x + m * ldx;
    float* ym = y + m * N + c0;
    const int64_t rows = std::min(2 * kRows, m1 - m);
    if (rows > kRows) {
      for (int64_t half = 0; half < 2; ++half, ++pass) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int64_t w0 = 64 * half;  // 32 columns of k pairs
        for (int64_t s = 0; s < steps; ++s) {
          if (pass == 0) {
            PairStep<_MM_HINT_T0>(xm + 2 * kPairs * s, 2 * ldx, panel + s * kBlock + w0,
                                  pf(pass, s));
          } else {
            PairStep<_MM_HINT_T1>(xm + 2 * kPairs * s, 2 * ldx, panel + s * kBlock + w0,
                                  pf(pass, s));
          }
        }
        if (rem != 0)
          PairStep<_MM_HINT_T0>(xm + 2 * kPairs * steps, 2 * ldx, tail + w0, nullptr);
        const int64_t c = 32 * half;
        Store(0, ym, N, kRows, c, cols, out);
        Store(1, ym, N, kRows, c + 16, cols, out);
        Store(2, ym + kRows * N, N, rows - kRows, c, cols, out);
        Store(3, ym + kRows * N, N, rows - kRows, c + 16, cols, out);
      }
      m += 2 * kRows;
      continue;
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* w = panel + s * kBlock;
      if (pass == 0) {
        Step<_MM_HINT_T0>(xm + 2 * kPairs * s, 2 * ldx, w, pf(pass, s));
      } else {
        Step<_MM_HINT_T1>(xm + 2 * kPairs * s, 2 * ldx, w, pf(pass, s));
      }
    }
    if (rem != 0) Step<_MM_HINT_T0>(xm + 2 * kPairs * steps, 2 * ldx, tail, nullptr);
    Store(0, ym, N, rows, 0, cols, out);
    Store(1, ym, N, rows, 16, cols, out);
    Store(2, ym, N, rows, 32, cols, out);
    Store(3, ym, N, rows, 48, cols, out);
    ++pass;
    m += kRows;
  }
  _tile_release();
}

void Run(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w,
         int64_t K2, float* y, int64_t N, int64_t P, const Chunks& rows) {
  const int64_t ldx = (2 * K2 + 2 * kPairs - 1) / (2 * kPairs) * (2 * kPairs);
  const uint16_t* xs = RoundX<uint16_t>(x, M, K, ldx, rows, kRows);
  const int64_t chunks = static_cast<int64_t>(rows.size());
  const int64_t panel_elems = K2 * kNR * 2;
  xlaserve::ParallelStealing(pool, P * chunks, [=, &rows](int64_t u, int64_t after) {
    const int64_t p = u / chunks, c = u % chunks;
    const char* next = c == chunks - 1 && after == u + 1 && p + 1 < P
                           ? reinterpret_cast<const char*>(w + (p + 1) * panel_elems)
                           : nullptr;
    Unit(xs, ldx, w + p * panel_elems, K2, y, N, p * kNR, rows[c].first, rows[c].second,
         next);
  });
}

}  // namespace amx
#endif

template <Bf16Body Body>
ffi::Error PackedMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::BF16> wp, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> mask, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  const auto m = LayerMatrix(wp.dimensions(), 4, layer);
  if (m.has_error()) return m.error();
  const auto wd = m->dims;
  if (xd.size() != 2 || yd.size() != 2 || wd[2] != kNR || wd[3] != 2 ||
      (xd[1] + 1) / 2 != wd[1] || yd[0] != xd[0])
    return ffi::Error::InvalidArgument(
        "packed_matmul: want x [M, K] f32, w [P, ceil(K / 2), 64, 2] bf16, y [M, N]");
  if (auto e = CheckN(yd[1], wd[0]); e.failure()) return e;
  const auto rows = RowMask(mask, xd[0], y->typed_data(), yd[1]);
  if (rows.has_error()) return rows.error();
  if (rows->empty()) return ffi::Error::Success();
  Body(pool, x.typed_data(), xd[0], xd[1],
       reinterpret_cast<const uint16_t*>(wp.typed_data()) + m->offset, wd[1],
       y->typed_data(), yd[1], wd[0], *rows);
  return ffi::Error::Success();
}

auto Bf16Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmulInt8, PackedMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmulBf16Widen,
                              PackedMatmulBf16<RunBf16<Bf16WidenStep>>, Bf16Binding());

#ifdef __AVX512BF16__
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmulBf16Dot,
                              PackedMatmulBf16<RunBf16<Bf16DotStep>>, Bf16Binding());
#endif

#ifdef __AVX512BW__
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmulX12Widen, PackedMatmulX12<kX12Widen>,
                              X12Binding());
#endif
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmulX12Dot, PackedMatmulX12<kX12Dot>,
                              X12Binding());
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmulBf16Amx, PackedMatmulBf16<amx::Run>,
                              Bf16Binding());

// 1 when this process may use the tile registers (the kernel above then runs), else 0.
extern "C" int XlaserveAmxReady() { return amx::Ready() ? 1 : 0; }
#endif
