// xlaserve CPU matmul: y[M, N] = x[M, K] @ W[K, N] with W packed once at load into
// column panels wp[P, K, 64] (P = ceil(N / 64), zero-padded), called from jit through
// the XLA FFI.
//
// Why: XLA CPU's GEMM re-packs the weight operand on every call. A decode step multiplies
// a few rows by every weight, so the packing pass (a read and a write of all weights)
// costs more than the product itself. With panels packed at load, each panel streams
// from memory once per call and stays in L2 while every 6-row tile of x passes over it.
//
// Every output row is computed with the same FMA sequence over k = 0..K-1 whatever M is
// and wherever the row falls in a tile, so a row's result does not depend on its batch.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 64;       // panel width: 4 zmm registers of 16 floats
constexpr int64_t kMR = 6;        // rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast
constexpr int64_t kMChunk = 96;   // rows per work unit, so large M splits across threads

// Rows [begin, end) of the next panel to pull into L2 while a tile computes, spread
// evenly over the tile's K steps (a burst of prefetches stalls on the fill buffers).
struct Prefetch {
  const float* next = nullptr;
  int64_t begin = 0, end = 0;
};

// y[0:MR, 0:64] = x[0:MR, 0:K] @ panel[0:K, 0:64]; columns beyond the matrix are masked.
template <int MR>
inline void Tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y,
                 int64_t ldy, const __mmask16* mask, Prefetch pf) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t pf_rows = pf.next != nullptr ? pf.end - pf.begin : 0;
  int64_t pf_row = pf.begin, pf_acc = 0;  // fixed point: pf_rows rows per K steps
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kNR;
    if (pf_rows == K) {  // one row per step (a 2-tile unit): no bookkeeping
      const char* p = reinterpret_cast<const char*>(pf.next + k * kNR);
      for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
    } else {
      for (pf_acc += pf_rows; pf_acc >= K; pf_acc -= K, ++pf_row) {
        const char* p = reinterpret_cast<const char*>(pf.next + pf_row * kNR);
        for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
      }
    }
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(b, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(b, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(y + m * ldy + 16 * j, mask[j], acc[m][j]);
}

// Rows [m0, min(M, m0 + kMChunk)) of panel `p`. The first tile reads this panel from
// memory; the later ones compute from L2 and share out the prefetch of `next`.
void Unit(const float* x, const float* wp, float* y, int64_t M, int64_t K, int64_t N,
          int64_t p, int64_t m0, const float* next) {
  __mmask16 mask[4];
  const int64_t cols = std::min(kNR, N - p * kNR);
  for (int j = 0; j < 4; ++j) {
    const int64_t c = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    mask[j] = static_cast<__mmask16>((1u << c) - 1u);
  }
  const float* panel = wp + p * K * kNR;
  const int64_t m1 = std::min(M, m0 + kMChunk);
  const int64_t tiles = (m1 - m0 + kMR - 1) / kMR;
  for (int64_t m = m0, tile = 0; m < m1; m += kMR, ++tile) {
    const float* xm = x + m * K;
    float* ym = y + m * N + p * kNR;
    Prefetch pf;
    if (next != nullptr && tile > 0) {  // tile i of 1..tiles-1 takes its share of rows
      pf = {next, (tile - 1) * K / (tiles - 1), tile * K / (tiles - 1)};
    } else if (next != nullptr && tiles == 1 && m1 - m0 > 1) {
      // 2-6 rows: memory-bound, and the hardware prefetcher alone falls behind (30 layers
      // + head, A B A B: M=2 29 -> 25 ms, M=4 33 -> 27 ms); one row streams fine without.
      pf = {next, 0, K};
    }
    switch (std::min(kMR, m1 - m)) {
      case 6: Tile<6>(xm, K, panel, K, ym, N, mask, pf); break;
      case 5: Tile<5>(xm, K, panel, K, ym, N, mask, pf); break;
      case 4: Tile<4>(xm, K, panel, K, ym, N, mask, pf); break;
      case 3: Tile<3>(xm, K, panel, K, ym, N, mask, pf); break;
      case 2: Tile<2>(xm, K, panel, K, ym, N, mask, pf); break;
      default: Tile<1>(xm, K, panel, K, ym, N, mask, pf); break;
    }
  }
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> wp, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = wp.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNR || wd[1] != xd[1] ||
      yd[0] != xd[0])
    return ffi::Error::InvalidArgument("packed_matmul: want x [M, K], w [P, K, 64], y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = wd[0];
  if (N > P * kNR || N <= (P - 1) * kNR)
    return ffi::Error::InvalidArgument("packed_matmul: N does not match the panel count");
  if (M == 0) return ffi::Error::Success();
  // Work units are (panel, row chunk) pairs in panel-major order, cut into one contiguous
  // range per thread so each thread can prefetch its own next panel.
  const int64_t chunks = (M + kMChunk - 1) / kMChunk;
  const float* xp = x.typed_data();
  const float* w = wp.typed_data();
  float* yp = y->typed_data();
  const auto units = [=](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t p = u / chunks, c = u % chunks;
      const float* next = c == chunks - 1 && u + 1 < u1 ? w + (p + 1) * K * kNR : nullptr;
      Unit(xp, w, yp, M, K, N, p, c * kMChunk, next);
    }
  };
  xlaserve::ParallelRanges(pool, P * chunks, xlaserve::Workers(pool), units);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
