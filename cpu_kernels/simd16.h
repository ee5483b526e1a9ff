// 16-lane f32 / i32 vectors for the CPU kernels, on AVX-512 or on AVX2 + FMA.
//
// The kernels were written for AVX-512 (one zmm register holds 16 floats, masks are
// 16-bit). Many x86-64 CPUs people serve on have AVX2 and FMA only (AMD Zen 1-3, Intel
// client parts), and there the kernels would not build at all, leaving XLA's dot, which
// re-packs every weight on every call. So the kernels use these names: with __AVX512F__
// each is the AVX-512 intrinsic itself (a typedef or a one-line inline: the same code as
// before), else a pair of 8-lane AVX2 operations on the low and high halves. Results are
// the same sums in the same lane order except the horizontal reductions (another tree),
// so the two builds agree to f32 rounding (Exp's 2^n, built from exponent bits on AVX2,
// is exact on both), and each build alone keeps every determinism property the kernels
// claim.
//
// Register pressure differs: AVX2 has 16 ymm registers where AVX-512 has 32 zmm of twice
// the width, so a tile that fills AVX-512's file spills on AVX2. packed_matmul.cc's
// tiles therefore use the native vectors below (vn) and pick their width per ISA.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace v16 {

using Mask = uint16_t;  // lane i on: bit i

#ifdef __AVX512F__

using F = __m512;
using I = __m512i;

inline F loadu_ps(const float* p) { return _mm512_loadu_ps(p); }
inline F load_ps(const float* p) { return _mm512_load_ps(p); }
inline void storeu_ps(float* p, F x) { _mm512_storeu_ps(p, x); }
inline void store_ps(float* p, F x) { _mm512_store_ps(p, x); }
inline F maskz_loadu_ps(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void mask_storeu_ps(float* p, Mask m, F x) { _mm512_mask_storeu_ps(p, m, x); }
inline F set1_ps(float v) { return _mm512_set1_ps(v); }
inline F setzero_ps() { return _mm512_setzero_ps(); }
inline F add_ps(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub_ps(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul_ps(F a, F b) { return _mm512_mul_ps(a, b); }
inline F max_ps(F a, F b) { return _mm512_max_ps(a, b); }
inline F fmadd_ps(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F fnmadd_ps(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
inline F mask_max_ps(F src, Mask m, F a, F b) { return _mm512_mask_max_ps(src, m, a, b); }
inline F maskz_mov_ps(Mask m, F x) { return _mm512_maskz_mov_ps(m, x); }
inline float reduce_add_ps(F x) { return _mm512_reduce_add_ps(x); }
inline float reduce_max_ps(F x) { return _mm512_reduce_max_ps(x); }
inline float mask_reduce_max_ps(Mask m, F x) { return _mm512_mask_reduce_max_ps(m, x); }
inline float cvtss_f32(F x) { return _mm512_cvtss_f32(x); }
inline F round_nearest_ps(F x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// x * 2^n for integer-valued n in [-126, 0] (Exp's range).
inline F scalef_ps(F x, F n) { return _mm512_scalef_ps(x, n); }
inline F unpacklo_ps(F a, F b) { return _mm512_unpacklo_ps(a, b); }
inline F unpackhi_ps(F a, F b) { return _mm512_unpackhi_ps(a, b); }
template <int kImm>
inline F shuffle_ps(F a, F b) { return _mm512_shuffle_ps(a, b, kImm); }
template <int kImm>
inline F shuffle_f32x4(F a, F b) { return _mm512_shuffle_f32x4(a, b, kImm); }

inline I loadu_si(const void* p) { return _mm512_loadu_si512(p); }
inline I load_si(const void* p) { return _mm512_load_si512(p); }
inline void storeu_si(void* p, I x) { _mm512_storeu_si512(p, x); }
inline I set1_epi32(int32_t v) { return _mm512_set1_epi32(v); }
inline I and_si(I a, I b) { return _mm512_and_si512(a, b); }
inline I add_epi32(I a, I b) { return _mm512_add_epi32(a, b); }
template <int kBits>
inline I slli_epi32(I x) { return _mm512_slli_epi32(x, kBits); }
template <int kBits>
inline I srli_epi32(I x) { return _mm512_srli_epi32(x, kBits); }
inline Mask cmple_epi32_mask(I a, I b) { return _mm512_cmple_epi32_mask(a, b); }
inline Mask cmpge_epi32_mask(I a, I b) { return _mm512_cmpge_epi32_mask(a, b); }
inline F castsi_ps(I x) { return _mm512_castsi512_ps(x); }
inline I castps_si(F x) { return _mm512_castps_si512(x); }
// 16 uint16 <-> 16 i32 lanes (low 16 bits kept).
inline I cvtepu16_epi32(__m256i x) { return _mm512_cvtepu16_epi32(x); }
inline __m256i cvtepi32_epi16(I x) { return _mm512_cvtepi32_epi16(x); }
inline __m256i maskz_loadu_epi16(Mask m, const uint16_t* p) {
  return _mm256_maskz_loadu_epi16(m, p);
}

#else  // AVX2 + FMA: each 16-lane vector is two 8-lane halves, lanes 0-7 in lo.

struct F {
  __m256 lo, hi;
};
struct I {
  __m256i lo, hi;
};

// The 8-lane mask of bits [8 * half, 8 * half + 8) of m: all ones where the bit is set.
inline __m256i HalfMask(Mask m, int half) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i v = _mm256_set1_epi32((m >> (8 * half)) & 0xFF);
  return _mm256_cmpeq_epi32(_mm256_and_si256(v, bits), bits);
}
inline Mask MaskOf(__m256 lo, __m256 hi) {
  return static_cast<Mask>(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}

inline F loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F load_ps(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void storeu_ps(float* p, F x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void store_ps(float* p, F x) {
  _mm256_store_ps(p, x.lo);
  _mm256_store_ps(p + 8, x.hi);
}
// vmaskmovps neither reads nor faults on the lanes it leaves off, as AVX-512's masks.
inline F maskz_loadu_ps(Mask m, const float* p) {
  return {_mm256_maskload_ps(p, HalfMask(m, 0)), _mm256_maskload_ps(p + 8, HalfMask(m, 1))};
}
inline void mask_storeu_ps(float* p, Mask m, F x) {
  _mm256_maskstore_ps(p, HalfMask(m, 0), x.lo);
  _mm256_maskstore_ps(p + 8, HalfMask(m, 1), x.hi);
}
inline F set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F add_ps(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F sub_ps(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F mul_ps(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F max_ps(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F fmadd_ps(F a, F b, F c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F fnmadd_ps(F a, F b, F c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F maskz_mov_ps(Mask m, F x) {
  return {_mm256_and_ps(x.lo, _mm256_castsi256_ps(HalfMask(m, 0))),
          _mm256_and_ps(x.hi, _mm256_castsi256_ps(HalfMask(m, 1)))};
}
inline F mask_max_ps(F src, Mask m, F a, F b) {
  const F mx = max_ps(a, b);
  return {_mm256_blendv_ps(src.lo, mx.lo, _mm256_castsi256_ps(HalfMask(m, 0))),
          _mm256_blendv_ps(src.hi, mx.hi, _mm256_castsi256_ps(HalfMask(m, 1)))};
}
inline float ReduceAdd8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float ReduceMax8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_add_ps(F x) { return ReduceAdd8(_mm256_add_ps(x.lo, x.hi)); }
inline float reduce_max_ps(F x) { return ReduceMax8(_mm256_max_ps(x.lo, x.hi)); }
inline float mask_reduce_max_ps(Mask m, F x) {
  return reduce_max_ps(mask_max_ps(set1_ps(-INFINITY), m, x, x));
}
inline float cvtss_f32(F x) { return _mm256_cvtss_f32(x.lo); }
inline F round_nearest_ps(F x) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, kMode), _mm256_round_ps(x.hi, kMode)};
}
// x * 2^n for integer-valued n in [-126, 0] (Exp's range): 2^n from its exponent bits.
// n is clipped to [-127, 127] first, so lanes a mask later drops stay finite numbers.
inline __m256 Scale8(__m256 x, __m256 n) {
  n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(e));
}
inline F scalef_ps(F x, F n) { return {Scale8(x.lo, n.lo), Scale8(x.hi, n.hi)}; }
// In-lane ops act on 128-bit lanes, which the halves split evenly.
inline F unpacklo_ps(F a, F b) {
  return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)};
}
inline F unpackhi_ps(F a, F b) {
  return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)};
}
template <int kImm>
inline F shuffle_ps(F a, F b) {
  return {_mm256_shuffle_ps(a.lo, b.lo, kImm), _mm256_shuffle_ps(a.hi, b.hi, kImm)};
}
// Result 128-bit lanes 0-1 are a's lanes imm[1:0], imm[3:2]; lanes 2-3 b's imm[5:4],
// imm[7:6]. A 16-lane vector's 128-bit lane i is half i / 2's lane i % 2, which is
// vperm2f128's selector i over (lo, hi).
template <int kImm>
inline F shuffle_f32x4(F a, F b) {
  constexpr int kLo = (kImm & 3) | ((kImm >> 2) & 3) << 4;
  constexpr int kHi = ((kImm >> 4) & 3) | ((kImm >> 6) & 3) << 4;
  return {_mm256_permute2f128_ps(a.lo, a.hi, kLo), _mm256_permute2f128_ps(b.lo, b.hi, kHi)};
}

inline I loadu_si(const void* p) {
  const auto* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline I load_si(const void* p) {
  const auto* q = static_cast<const __m256i*>(p);
  return {_mm256_load_si256(q), _mm256_load_si256(q + 1)};
}
inline void storeu_si(void* p, I x) {
  auto* q = static_cast<__m256i*>(p);
  _mm256_storeu_si256(q, x.lo);
  _mm256_storeu_si256(q + 1, x.hi);
}
inline I set1_epi32(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I and_si(I a, I b) {
  return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)};
}
inline I add_epi32(I a, I b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
template <int kBits>
inline I slli_epi32(I x) {
  return {_mm256_slli_epi32(x.lo, kBits), _mm256_slli_epi32(x.hi, kBits)};
}
template <int kBits>
inline I srli_epi32(I x) {
  return {_mm256_srli_epi32(x.lo, kBits), _mm256_srli_epi32(x.hi, kBits)};
}
inline Mask cmple_epi32_mask(I a, I b) {  // a <= b: not a > b
  return static_cast<Mask>(~MaskOf(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a.lo, b.lo)),
                                   _mm256_castsi256_ps(_mm256_cmpgt_epi32(a.hi, b.hi))));
}
inline Mask cmpge_epi32_mask(I a, I b) { return cmple_epi32_mask(b, a); }
inline F castsi_ps(I x) { return {_mm256_castsi256_ps(x.lo), _mm256_castsi256_ps(x.hi)}; }
inline I castps_si(F x) { return {_mm256_castps_si256(x.lo), _mm256_castps_si256(x.hi)}; }
inline I cvtepu16_epi32(__m256i x) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)),
          _mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1))};
}
// Lanes hold values below 2^16 where the kernels call this (a bf16 in the low half), so
// the unsigned saturating pack keeps them; it interleaves 128-bit lanes, put back in order.
inline __m256i cvtepi32_epi16(I x) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(x.lo, x.hi), 0xD8);
}
inline __m256i maskz_loadu_epi16(Mask m, const uint16_t* p) {
  if (m == 0xFFFF) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint16_t buf[16] = {};
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) buf[i] = p[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}

#endif

}  // namespace v16

// The matmul's tiles keep their accumulators in registers, which a 16-lane pair does not
// reliably do on AVX2 (GCC kept a stack copy of a 6 x 16 tile's pairs and stored all 12
// halves every k step: 2-3x slower at 32 rows). So the matmul works in the CPU's native
// vectors: 16 lanes on AVX-512, 8 on AVX2.
namespace vn {

#ifdef __AVX512F__

constexpr int kLanes = 16;
using F = __m512;
using I = __m512i;
using Mask = __mmask16;

inline F loadu(const float* p) { return _mm512_loadu_ps(p); }
inline I loadu_si(const void* p) { return _mm512_loadu_si512(p); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F setzero() { return _mm512_setzero_ps(); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
// A bf16 k pair per 32-bit lane: the even k's value sits in the low half, the odd k's in
// the high half; bf16 -> f32 is a 16-bit shift.
inline F widen_even(I pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline F widen_odd(I pairs) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
// 16 int8 weights (one per column) -> 16 f32 lanes: sign-extend, then convert (exact).
inline F widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Mask first_lanes(int64_t n) {  // lanes [0, n) on, n in [0, 16]
  return static_cast<Mask>((1u << n) - 1u);
}
inline void mask_storeu(float* p, Mask m, F x) { _mm512_mask_storeu_ps(p, m, x); }

#else

constexpr int kLanes = 8;
using F = __m256;
using I = __m256i;
using Mask = __m256i;  // all ones on the lanes to store

inline F loadu(const float* p) { return _mm256_loadu_ps(p); }
inline I loadu_si(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F setzero() { return _mm256_setzero_ps(); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F widen_even(I pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline F widen_odd(I pairs) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline F widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Mask first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline void mask_storeu(float* p, Mask m, F x) { _mm256_maskstore_ps(p, m, x); }

#endif

}  // namespace vn
