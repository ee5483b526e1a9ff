// xlaserve CPU paged attention (decode and extend), called from jit through the XLA FFI.
//
// A query attends to its row's earlier context, read in place from the paged pool
// through the page table, and to this step's new keys/values of its row (written to the
// pool only after the layer stack). The jnp path gathers every page into a dense copy
// first and the copy dominated its time (XLA's gather runs at ~10 GB/s on this CPU);
// here each page is read where it lies.
//
// Two kernels, for the two shapes of work:
// - Decode (one query token per row): per key. Work item: one row and kv head, with its
//   G = Hq / Hkv query heads. Scores for all its keys go to a per-thread buffer, then an
//   exact two-pass softmax (max, then exp and sum), then p @ V. Only G queries share a
//   key, so there is nothing to amortize a transpose over (the blocked kernel below ran
//   decode 2.3x slower: 32 rows x 192 keys x 30 layers, 18.5 vs 8.0 ms bf16).
// - Extend (prefill): blocked, one pass (flash attention's online softmax). A work item
//   is the G heads of up to 64 / G consecutive tokens of a row, and its keys go by in
//   blocks of 16. Each block's keys are transposed once into f32 [D][16], so a query's 16
//   scores are 16-lane FMAs with no sum across lanes and the block serves every query of
//   the item; its values are widened once and each query adds p @ V. Against the
//   per-key kernel on prefill: 1.5-2.0x at 512 and 2,048 tokens, f32 and bf16 pages
//   (scripts/bench/bench_cpu_attention.py; 2,048 tokens f32: 1,122-1,172 against 2,034 ms for
//   30 layers); with the per-key kernel attention is 2/3 of a 2,048-token bf16 forward.
//
// Determinism: items are independent, so a row's result does not depend on its batch.
// Extend blocks are aligned to a key's index in its row's key stream (the pool prefix by
// position, then the new tokens) and a query adds only the keys it sees, so an extend
// token's result does not depend on which tokens share its item or where its prompt
// was chunked (bitwise, tested). Decode and extend sum in different orders: the same
// token through both agrees to f32 rounding, not bitwise.
//
// Variants (attention_ref.py defines them): a sliding window (a traced int32 operand, 0:
// none; keys at positions <= q_pos - window are skipped, so decode reads only the pages
// the window reaches), soft-capped scores (an attribute, 0: none) and attention sinks
// (an f32 [Hq] operand, empty: none), one logit per query head that joins the softmax
// denominator with no value.
//
// K/V (pool and new) are float32 or bfloat16 (`--kv_cache_dtype`); bf16 rows widen to
// f32 as they load (a shift), and all arithmetic is f32 either way.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Position of a padding token (PAD_POSITION in runtime/batch_builder.py).
constexpr int32_t kPadPosition = 1 << 30;

// exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial,
// times 2^n by scalef. Relative error ~2e-7; inputs below -87 give 0 (softmax terms far
// under the max), never NaN.
inline v16::F Exp(v16::F x) {
  x = v16::max_ps(x, v16::set1_ps(-87.0f));
  const v16::F n = v16::round_nearest_ps(v16::mul_ps(x, v16::set1_ps(1.44269504f)));
  v16::F r = v16::fnmadd_ps(n, v16::set1_ps(0.693145752f), x);
  r = v16::fnmadd_ps(n, v16::set1_ps(1.42860677e-6f), r);
  v16::F p = v16::set1_ps(1.0f / 720);
  p = v16::fmadd_ps(p, r, v16::set1_ps(1.0f / 120));
  p = v16::fmadd_ps(p, r, v16::set1_ps(1.0f / 24));
  p = v16::fmadd_ps(p, r, v16::set1_ps(1.0f / 6));
  p = v16::fmadd_ps(p, r, v16::set1_ps(0.5f));
  p = v16::fmadd_ps(p, r, v16::set1_ps(1.0f));
  p = v16::fmadd_ps(p, r, v16::set1_ps(1.0f));
  return v16::scalef_ps(p, n);
}

// 16 K/V elements as f32 (masked: lanes off m are 0); bf16 is f32's top half.
inline v16::F Load16(const float* p) { return v16::loadu_ps(p); }
inline v16::F Load16(v16::Mask m, const float* p) { return v16::maskz_loadu_ps(m, p); }
inline v16::F Widen(__m256i bf16) {
  return v16::castsi_ps(v16::slli_epi32<16>(v16::cvtepu16_epi32(bf16)));
}
inline v16::F Load16(const uint16_t* p) {
  return Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline v16::F Load16(v16::Mask m, const uint16_t* p) { return Widen(v16::maskz_loadu_epi16(m, p)); }

struct Shapes {
  int64_t Hq, Hkv, G, D, P, S, W;  // heads, group, head dim, pool pages, page size, table
  int64_t layer;
  float scale, soft_cap;  // soft_cap 0: none
  int64_t window;         // 0: none
  const float* sinks;     // [Hq] sink logits, or null: none
};

// A query's output scale and denominator once its sink logit joins the softmax: with m
// the max of its scores and l the sum of exp(score - m), the output o / l becomes
// o * alpha / (l * alpha + exp(sink - max(m, sink))), alpha = exp(m - max(m, sink)).
// Rescaling to the larger of the two keeps a sink far above the scores finite.
inline std::pair<float, float> SinkScale(float m, float l, float sink) {
  const float top = std::max(m, sink);
  const float alpha = m == -INFINITY ? 0.0f : std::exp(m - top);
  return {alpha, l * alpha + std::exp(sink - top)};
}

// ---- Decode: per key, two passes ----

template <typename T>
inline float Dot(const float* a, const T* b, int64_t d) {
  v16::F acc = v16::setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) acc = v16::fmadd_ps(v16::loadu_ps(a + i), Load16(b + i), acc);
  if (i < d) {
    const v16::Mask m = static_cast<v16::Mask>((1u << (d - i)) - 1u);
    acc = v16::fmadd_ps(v16::maskz_loadu_ps(m, a + i), Load16(m, b + i), acc);
  }
  return v16::reduce_add_ps(acc);
}

// out[0:d] += p * v[0:d]
template <typename T>
inline void Axpy(float p, const T* v, float* out, int64_t d) {
  const v16::F pp = v16::set1_ps(p);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    v16::storeu_ps(out + i, v16::fmadd_ps(pp, Load16(v + i), v16::loadu_ps(out + i)));
  if (i < d) {
    const v16::Mask m = static_cast<v16::Mask>((1u << (d - i)) - 1u);
    v16::mask_storeu_ps(out + i, m, v16::fmadd_ps(pp, Load16(m, v + i),
                                                      v16::maskz_loadu_ps(m, out + i)));
  }
}

// One query token's G heads against its keys: writes out [G, D]. `sinks`: the G heads'
// sink logits, or null. `keys(f, values)` calls
// f(i, k, v) for its n keys in order (row pointers into the pool or the new K/V); the
// score pass reads k, the value pass (values = true) v.
// kG, kDV > 0: G and D / 16 known at compile time, so the G queries and the G output rows
// stay in registers; 0: any G and D (head dims not a multiple of 16, or too many
// registers), through memory.
template <typename T, int kG, int kDV, typename Keys>
void AttendKeys(const Shapes& s, const float* qb, float* ob, int64_t n, Keys&& keys,
            std::vector<float>& scores, const float* sinks) {
  const int64_t D = kDV > 0 ? 16 * kDV : s.D, G = kG > 0 ? kG : s.G;
  if (n == 0) {  // nothing to attend to (padding tokens): 0, as the jnp path gives
    std::fill(ob, ob + G * D, 0.0f);
    return;
  }
  const int64_t stride = (n + 15) / 16 * 16;
  scores.resize(G * stride);
  if constexpr (kG > 0) {
    v16::F qv[kG][kDV];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) qv[g][c] = v16::loadu_ps(qb + g * D + 16 * c);
    keys([&](int64_t i, const T* k, const T*) {
      v16::F kv[kDV];
      for (int c = 0; c < kDV; ++c) kv[c] = Load16(k + 16 * c);
      for (int g = 0; g < kG; ++g) {
        v16::F a = v16::mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < kDV; ++c) a = v16::fmadd_ps(qv[g][c], kv[c], a);
        scores[g * stride + i] = v16::reduce_add_ps(a);
      }
    }, false);
  } else {
    keys([&](int64_t i, const T* k, const T*) {
      for (int64_t g = 0; g < G; ++g) scores[g * stride + i] = Dot(qb + g * D, k, D);
    }, false);
  }

  // Softmax per query head, in place: scores -> probabilities.
  const v16::F scale = v16::set1_ps(s.scale);
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores.data() + g * stride;
    v16::F vmx = v16::set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
      const v16::Mask m = static_cast<v16::Mask>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
      v16::F x = v16::mul_ps(v16::loadu_ps(sc + i), scale);
      if (s.soft_cap > 0) {  // rare (Gemma-style models): scalar tanh
        alignas(64) float tmp[16];
        v16::store_ps(tmp, x);
        for (float& v : tmp) v = s.soft_cap * std::tanh(v / s.soft_cap);
        x = v16::load_ps(tmp);
      }
      v16::storeu_ps(sc + i, x);
      vmx = v16::mask_max_ps(vmx, m, vmx, x);
    }
    const float mx = v16::reduce_max_ps(vmx);
    // With a sink the exponents are taken against max(scores, sink) (see SinkScale).
    const float top = sinks ? std::max(mx, sinks[g]) : mx;
    vmx = v16::set1_ps(top);
    v16::F sum = v16::setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const v16::Mask m = static_cast<v16::Mask>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
      const v16::F e = v16::maskz_mov_ps(m, Exp(v16::sub_ps(v16::loadu_ps(sc + i), vmx)));
      v16::storeu_ps(sc + i, e);
      sum = v16::add_ps(sum, e);
    }
    float denom = v16::reduce_add_ps(sum);  // >= exp(0) without a sink
    if (sinks) denom += std::exp(sinks[g] - top);
    const v16::F inv = v16::set1_ps(1.0f / denom);
    for (int64_t i = 0; i < n; i += 16)
      v16::storeu_ps(sc + i, v16::mul_ps(v16::loadu_ps(sc + i), inv));
  }

  if constexpr (kG > 0) {
    v16::F acc[kG][kDV];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) acc[g][c] = v16::setzero_ps();
    keys([&](int64_t i, const T*, const T* v) {
      v16::F vv[kDV];
      for (int c = 0; c < kDV; ++c) vv[c] = Load16(v + 16 * c);
      for (int g = 0; g < kG; ++g) {
        const v16::F p = v16::set1_ps(scores[g * stride + i]);
        for (int c = 0; c < kDV; ++c) acc[g][c] = v16::fmadd_ps(p, vv[c], acc[g][c]);
      }
    }, true);
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) v16::storeu_ps(ob + g * D + 16 * c, acc[g][c]);
  } else {
    std::fill(ob, ob + G * D, 0.0f);
    keys([&](int64_t i, const T*, const T* v) {
      for (int64_t g = 0; g < G; ++g) Axpy(scores[g * stride + i], v, ob + g * D, D);
    }, true);
  }
}

// Calls f(t, k row, v row) for the pool tokens [first, end) of one row and kv head, page
// by page (no division per token). Pages lie anywhere in the pool and the hardware
// prefetcher stops at 4 KiB boundaries, so each page's tokens pull the next page into L1
// (of V in the value pass, else of K), a share per token. Decode reads its K/V once
// from memory and was latency-bound (16-17 GB/s against ~40 GB/s with the same pages in
// L3), so the score pass also keeps more reads in flight: the K page ~8 KiB ahead and
// the current token's V row go to L2, and the value pass then reads V from L2. That
// takes 32 rows x 192 keys x 30 layers on scattered pages to 11.2-14.5 ms in f32 and
// 6.7-8.0 ms in bf16, against 15.6-17.2 and 8.9-9.7 ms when only the next page is
// prefetched (scripts/bench/bench_cpu_attention.py, A B A B; docs/results/bench_cpu_attention.json).
template <typename T, typename F>
void WalkPages(const Shapes& s, const T* k_pool, const T* v_pool,
               const int32_t* table_row, int64_t h, int64_t first, int64_t end, bool values,
               F&& f) {
  const T* ahead = values ? v_pool : k_pool;
  const int64_t head_base = (s.layer * s.Hkv + h) * s.P;  // pool page index of page 0
  const int64_t page_elems = s.S * s.D, lines = (page_elems * sizeof(T) + 63) / 64;
  const int64_t row_lines = (s.D * sizeof(T) + 63) / 64;
  const int64_t far_pages = std::max<int64_t>(2, 8192 / (page_elems * sizeof(T)));
  // Page ids are clipped into the pool, as the jnp path's gathers do: a bad table entry
  // reads a wrong page, never outside the pool.
  auto page_of = [&](int64_t tok) {
    return (head_base + std::clamp<int64_t>(table_row[tok / s.S], 0, s.P - 1)) * page_elems;
  };
  for (int64_t t = first; t < end;) {
    const int64_t slot = t % s.S, n_here = std::min(s.S - slot, end - t);
    const int64_t page = page_of(t);
    const int64_t next = t + n_here < end ? page_of(t + n_here) : -1;
    const int64_t far_tok = t + n_here + (far_pages - 1) * s.S;
    const int64_t far = far_tok < end ? page_of(far_tok) : -1;
    const int64_t per_token = (lines + n_here - 1) / n_here;
    for (int64_t i = 0; i < n_here; ++i) {
      if (next >= 0) {
        for (int64_t l = i * per_token; l < std::min(lines, (i + 1) * per_token); ++l)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + next) + 64 * l, _MM_HINT_T0);
      }
      const int64_t row = page + (slot + i) * s.D;
      if (!values) {  // the score pass: K further ahead and this token's V, into L2
        for (int64_t l = i * per_token; far >= 0 && l < std::min(lines, (i + 1) * per_token); ++l)
          _mm_prefetch(reinterpret_cast<const char*>(k_pool + far) + 64 * l, _MM_HINT_T1);
        for (int64_t l = 0; l < row_lines; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(v_pool + row) + 64 * l, _MM_HINT_T1);
      }
      f(t + i, k_pool + row, v_pool + row);
    }
    t += n_here;
  }
}

template <typename T>
struct Decode {
  const float* q;
  const T *k_new, *v_new, *k_pool, *v_pool;
  const int32_t *page_table, *seq_lens;
  float* out;

  // Row b's one query sits at seq_len - 1: its pool prefix, then its own new key.
  template <int kG, int kDV>
  void operator()(const Shapes& s, int64_t item, std::vector<float>& scores) const {
    const int64_t b = item / s.Hkv, h = item % s.Hkv;
    const int64_t q_pos = std::max<int64_t>(seq_lens[b] - 1, 0);
    // Earlier context [first, ctx): the window drops keys at or below q_pos - window.
    const int64_t ctx = std::min<int64_t>(q_pos, s.W * s.S);
    const int64_t first =
        s.window > 0 ? std::clamp<int64_t>(q_pos - s.window + 1, 0, ctx) : 0;
    const int64_t own = (b * s.Hkv + h) * s.D;
    auto keys = [&](auto&& f, bool values) {
      WalkPages(s, k_pool, v_pool, page_table + b * s.W, h, first, ctx, values,
                [&](int64_t t, const T* k, const T* v) { f(t - first, k, v); });
      f(ctx - first, k_new + own, v_new + own);
    };
    const int64_t qo = (b * s.Hq + h * s.G) * s.D;
    AttendKeys<T, kG, kDV>(s, q + qo, out + qo, ctx - first + 1, keys, scores,
                           s.sinks ? s.sinks + h * s.G : nullptr);
  }
};

// Runs work(s, item, scores) for items [0, n) with the register-resident variant for
// the common head shapes (G queries x D floats, twice: at most 24 of the 32 zmm
// registers), else the general one. `ranges` > threads balances items of unequal cost.
template <typename Work>
void RunDecode(ffi::ThreadPool& pool, const Shapes& s, int64_t n, const Work& work) {
  auto run = [&](auto variant) {
    const auto items = [&, variant](int64_t i0, int64_t i1) {
      std::vector<float> scores;
      for (int64_t i = i0; i < i1; ++i) variant(s, i, scores);
    };
    xlaserve::ParallelRanges(pool, n, 8 * xlaserve::Workers(pool), items);
  };
#define XLASERVE_VARIANT(G_, DV_)                                                    \
  run([&work](const Shapes& s, int64_t i, std::vector<float>& scores) {              \
    work.template operator()<G_, DV_>(s, i, scores);                                 \
  })
  if (s.D == 64 && s.G >= 1 && s.G <= 6) {
    switch (s.G) {
      case 1: XLASERVE_VARIANT(1, 4); return;
      case 2: XLASERVE_VARIANT(2, 4); return;
      case 3: XLASERVE_VARIANT(3, 4); return;
      case 4: XLASERVE_VARIANT(4, 4); return;
      case 5: XLASERVE_VARIANT(5, 4); return;
      default: XLASERVE_VARIANT(6, 4); return;
    }
  }
  if (s.D == 128 && s.G >= 1 && s.G <= 3) {
    switch (s.G) {
      case 1: XLASERVE_VARIANT(1, 8); return;
      case 2: XLASERVE_VARIANT(2, 8); return;
      default: XLASERVE_VARIANT(3, 8); return;
    }
  }
  XLASERVE_VARIANT(0, 0);
#undef XLASERVE_VARIANT
}

// ---- Extend: blocked, one pass ----

constexpr int kBlock = 16;  // keys per block: key-stream indices [16j, 16j + 16)
constexpr int kAhead = 2;   // blocks prefetched ahead: pool pages lie anywhere

// In-register transpose of 16 rows of 16 floats: r[i][j] -> r[j][i].
inline void Transpose16(v16::F r[16]) {
  v16::F t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = v16::unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = v16::unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = v16::shuffle_ps<0x44>(t[i], t[i + 2]);
    r[i + 1] = v16::shuffle_ps<0xEE>(t[i], t[i + 2]);
    r[i + 2] = v16::shuffle_ps<0x44>(t[i + 1], t[i + 3]);
    r[i + 3] = v16::shuffle_ps<0xEE>(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = v16::shuffle_f32x4<0x88>(r[i], r[i + 4]);
    t[i + 4] = v16::shuffle_f32x4<0xDD>(r[i], r[i + 4]);
    t[i + 8] = v16::shuffle_f32x4<0x88>(r[i + 8], r[i + 12]);
    t[i + 12] = v16::shuffle_f32x4<0xDD>(r[i + 8], r[i + 12]);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = v16::shuffle_f32x4<0x88>(t[i], t[i + 8]);
    r[i + 8] = v16::shuffle_f32x4<0xDD>(t[i], t[i + 8]);
  }
}

// An item's keys in stream order: the pool prefix [first, pool_end) by position (stream
// index = position), then new keys: stream index pool_end + i is new row i.
template <typename T>
struct Stream {
  const T *k_pool, *v_pool;
  const int32_t* table_row;  // the row's page table
  int64_t head_base;         // pool page index of page 0 of (layer, kv head)
  const T *k_new, *v_new;    // new key 0's row
  int64_t new_stride;        // elements from one new key's row to the next
  const int32_t* new_pos;    // new keys' positions
  int64_t first, pool_end, end;

  // Row pointers and positions of block b's keys (stream indices [16b, 16b + 16) within
  // [first, end)); lanes off the stream get null rows. Returns the lanes present.
  v16::Mask Block(const Shapes& s, int64_t b, const T** k, const T** v, int32_t* pos) const {
    const int64_t t0 = b * kBlock;
    const int64_t j0 = std::max<int64_t>(first - t0, 0), j1 = std::min<int64_t>(end - t0, kBlock);
    // Page ids are clipped into the pool, as the jnp path's gathers do: a bad table entry
    // reads a wrong page, never outside the pool.
    auto pool_row = [&](int64_t t) {
      const int64_t page = head_base + std::clamp<int64_t>(table_row[t / s.S], 0, s.P - 1);
      return (page * s.S + t % s.S) * s.D;
    };
    // Pages of a multiple of 16 tokens hold a whole block: one page lookup.
    const bool one_page = s.S % kBlock == 0 && t0 + j1 <= pool_end;
    const int64_t base = one_page ? pool_row(t0 + j0) - j0 * s.D : 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t t = t0 + j;
      if (j < j0 || j >= j1) {
        k[j] = v[j] = nullptr, pos[j] = 0;
      } else if (t < pool_end) {
        const int64_t row = one_page ? base + j * s.D : pool_row(t);
        k[j] = k_pool + row, v[j] = v_pool + row, pos[j] = static_cast<int32_t>(t);
      } else {
        const int64_t i = t - pool_end;
        k[j] = k_new + i * new_stride, v[j] = v_new + i * new_stride, pos[j] = new_pos[i];
      }
    }
    return static_cast<v16::Mask>(((1u << j1) - 1u) & ~((1u << j0) - 1u));
  }
};

// The queries of an item: n = tokens * G, query i is head i % G of token i / G.
struct Queries {
  const float* q;      // token 0's row of q [.., Hq, D], at the item's first head
  float* out;          // likewise in out
  int64_t stride;      // elements from one token's row to the next (Hq * D)
  int64_t tokens;
  const int32_t* pos;  // each token's position (its causal limit)
  const int32_t* lo;   // each token's first visible position (window), else INT32_MIN
  const float* sinks;  // the item's G heads' sink logits, or null
};

// Head dims padded to whole 64-column groups (p @ V works 64 columns at a time).
inline int64_t PaddedDim(int64_t D) { return (D + 63) / 64 * 64; }

// Per-thread buffers for items of at most n queries, reused across items. Zero-filled:
// the pad columns of kt, vr and q are never written, so they read 0.
struct Scratch {
  Scratch(int64_t n, int64_t Dp)
      : kt(Dp * kBlock), vr(kBlock * Dp), q(n * Dp), o(n * Dp), l(n * kBlock), m(n),
        p(n * kBlock), alpha(n), visible(n) {}

  std::vector<float> kt, vr, q, o, l, m, p, alpha;
  std::vector<v16::Mask> visible;  // per query: the block's keys it sees
  const float* vrow[kBlock];       // the block's value rows as f32 [Dp] (vr, or the pool's)
};

inline void LoadRow(const float* src, float* dst, int64_t D) { std::copy(src, src + D, dst); }
inline void LoadRow(const uint16_t* src, float* dst, int64_t D) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) v16::storeu_ps(dst + d, Load16(src + d));
  for (; d < D; ++d) {
    const uint32_t bits = static_cast<uint32_t>(src[d]) << 16;
    std::memcpy(dst + d, &bits, 4);
  }
}

// scores[i] (16 keys) = q_i . kt for N queries: four partial sums per query (d mod 4)
// keep enough FMAs in flight; the same order for every query whatever N is.
template <int N>
inline void Scores(const float* q, int64_t Dp, const float* kt, v16::F* scores) {
  v16::F a[N][4];
  for (int i = 0; i < N; ++i)
    for (int r = 0; r < 4; ++r) a[i][r] = v16::setzero_ps();
  for (int64_t d = 0; d < Dp; d += 4) {
    for (int r = 0; r < 4; ++r) {
      const v16::F k = v16::loadu_ps(kt + (d + r) * kBlock);
      for (int i = 0; i < N; ++i)
        a[i][r] = v16::fmadd_ps(v16::set1_ps(q[i * Dp + d + r]), k, a[i][r]);
    }
  }
  for (int i = 0; i < N; ++i)
    scores[i] = v16::add_ps(v16::add_ps(a[i][0], a[i][1]), v16::add_ps(a[i][2], a[i][3]));
}

// o_i = o_i * alpha_i + sum over the block's keys `keys`, ascending, of p_i[k] * v[k],
// for N queries from i0 that see the same keys (heads of one token) and 64 columns from
// col. A query adds exactly the keys it sees, so its sum does not depend on which
// queries share its item.
template <int N>
inline void AddValues(Scratch& sc, int64_t Dp, int64_t i0, int64_t col, unsigned keys) {
  v16::F acc[N][4];
  for (int i = 0; i < N; ++i) {
    const float* o = sc.o.data() + (i0 + i) * Dp + col;
    const float alpha = sc.alpha[i0 + i];
    for (int c = 0; c < 4; ++c) {
      acc[i][c] = v16::loadu_ps(o + 16 * c);
      if (alpha != 1.0f) acc[i][c] = v16::mul_ps(acc[i][c], v16::set1_ps(alpha));
    }
  }
  for (; keys; keys &= keys - 1) {
    const int k = __builtin_ctz(keys);
    const float* v = sc.vrow[k] + col;
    v16::F p[N];
    for (int i = 0; i < N; ++i) p[i] = v16::set1_ps(sc.p[(i0 + i) * kBlock + k]);
    for (int c = 0; c < 4; ++c) {
      const v16::F vv = v16::loadu_ps(v + 16 * c);
      for (int i = 0; i < N; ++i) acc[i][c] = v16::fmadd_ps(p[i], vv, acc[i][c]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < 4; ++c)
      v16::storeu_ps(sc.o.data() + (i0 + i) * Dp + col + 16 * c, acc[i][c]);
}

// One extend item: its queries against its key stream (see the file comment).
template <typename T>
void AttendBlock(const Shapes& s, const Queries& qs, const Stream<T>& st, Scratch& sc) {
  const int64_t G = s.G, D = s.D, Dp = PaddedDim(D), n = qs.tokens * G;
  for (int64_t i = 0; i < n; ++i) {  // queries times the scale, pad columns 0
    const float* src = qs.q + (i / G) * qs.stride + (i % G) * D;
    for (int64_t d = 0; d < D; ++d) sc.q[i * Dp + d] = src[d] * s.scale;
  }
  std::fill(sc.o.begin(), sc.o.begin() + n * Dp, 0.0f);
  std::fill(sc.l.begin(), sc.l.begin() + n * kBlock, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + n, -INFINITY);

  const int64_t first_block = st.first / kBlock, end_block = (st.end + kBlock - 1) / kBlock;
  const int64_t lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  alignas(64) int32_t kpos[kBlock];
  const T *krow[kBlock], *vrow[kBlock];
  auto prefetch = [&](int64_t b) {
    st.Block(s, b, krow, vrow, kpos);
    for (int j = 0; j < kBlock; ++j)
      for (int64_t l = 0; krow[j] && l < lines; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(krow[j]) + 64 * l, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vrow[j]) + 64 * l, _MM_HINT_T0);
      }
  };
  for (int64_t b = first_block; b < std::min(first_block + kAhead, end_block); ++b) prefetch(b);
  // f32 rows of a whole number of 64 columns are read in place; others are widened to vr.
  constexpr bool kF32 = std::is_same_v<T, float>;
  const bool in_place = kF32 && D == Dp;

  alignas(64) float tmp[kBlock];
  for (int64_t b = first_block; b < end_block; ++b) {
    if (b + kAhead < end_block) prefetch(b + kAhead);
    const v16::Mask present = st.Block(s, b, krow, vrow, kpos);
    for (int j = 0; j < kBlock; ++j) {
      if (!krow[j]) continue;
      if (in_place) {
        sc.vrow[j] = reinterpret_cast<const float*>(vrow[j]);
      } else {
        LoadRow(vrow[j], sc.vr.data() + j * Dp, D);
        sc.vrow[j] = sc.vr.data() + j * Dp;
      }
    }
    // kt [Dp][16]: 16 columns of K at a time, absent keys 0.
    for (int64_t c = 0; c < (D + 15) / 16; ++c) {
      const int64_t width = std::min<int64_t>(16, D - 16 * c);
      const v16::Mask cols = static_cast<v16::Mask>(width == 16 ? 0xFFFFu : (1u << width) - 1u);
      v16::F r[16];
      for (int j = 0; j < kBlock; ++j)
        r[j] = krow[j] ? Load16(cols, krow[j] + 16 * c) : v16::setzero_ps();
      Transpose16(r);
      for (int j = 0; j < width; ++j) v16::storeu_ps(sc.kt.data() + (16 * c + j) * kBlock, r[j]);
    }
    const v16::I key_pos = v16::load_si(kpos);

    // Scores, then the online softmax step per query: p (0 off its visible keys), alpha.
    for (int64_t i0 = 0; i0 < n; i0 += 4) {
      v16::F sv[4];
      const float* q = sc.q.data() + i0 * Dp;
      switch (std::min<int64_t>(4, n - i0)) {
        case 1: Scores<1>(q, Dp, sc.kt.data(), sv); break;
        case 2: Scores<2>(q, Dp, sc.kt.data(), sv); break;
        case 3: Scores<3>(q, Dp, sc.kt.data(), sv); break;
        default: Scores<4>(q, Dp, sc.kt.data(), sv); break;
      }
      for (int64_t i = i0; i < std::min(n, i0 + 4); ++i) {
        v16::F x = sv[i - i0];
        if (s.soft_cap > 0) {  // rare (Gemma-style models): scalar tanh
          v16::store_ps(tmp, x);
          for (float& v : tmp) v = s.soft_cap * std::tanh(v / s.soft_cap);
          x = v16::load_ps(tmp);
        }
        const int64_t tok = i / G;
        const v16::Mask visible =
            present & v16::cmple_epi32_mask(key_pos, v16::set1_epi32(qs.pos[tok])) &
            v16::cmpge_epi32_mask(key_pos, v16::set1_epi32(qs.lo[tok]));
        sc.visible[i] = visible;
        if (!visible) {  // nothing here for this query: o, l and m stay as they are
          sc.alpha[i] = 1.0f;
          continue;
        }
        const float m_old = sc.m[i];
        const float m_new = std::max(m_old, v16::mask_reduce_max_ps(visible, x));
        // exp(0) is exactly 1: the common case skips the call.
        const float alpha = m_old == m_new      ? 1.0f
                            : m_old == -INFINITY ? 0.0f
                                 : v16::cvtss_f32(Exp(v16::set1_ps(m_old - m_new)));
        const v16::F e = v16::maskz_mov_ps(visible, Exp(v16::sub_ps(x, v16::set1_ps(m_new))));
        v16::storeu_ps(sc.p.data() + i * kBlock, e);
        float* l = sc.l.data() + i * kBlock;
        v16::storeu_ps(l, v16::fmadd_ps(v16::loadu_ps(l), v16::set1_ps(alpha), e));
        sc.m[i] = m_new, sc.alpha[i] = alpha;
      }
    }
    // p @ V, a token's heads together (they see the same keys), up to 4 at a time.
    for (int64_t tok = 0; tok < qs.tokens; ++tok) {
      const unsigned keys = sc.visible[tok * G];
      if (!keys) continue;
      for (int64_t i0 = tok * G; i0 < (tok + 1) * G; i0 += 4)
        for (int64_t col = 0; col < Dp; col += 64) switch (std::min<int64_t>(4, (tok + 1) * G - i0)) {
            case 1: AddValues<1>(sc, Dp, i0, col, keys); break;
            case 2: AddValues<2>(sc, Dp, i0, col, keys); break;
            case 3: AddValues<3>(sc, Dp, i0, col, keys); break;
            default: AddValues<4>(sc, Dp, i0, col, keys); break;
          }
    }
  }
  // out = o / l; no visible key (padding tokens): 0, as the jnp path gives.
  for (int64_t i = 0; i < n; ++i) {
    float l = v16::reduce_add_ps(v16::loadu_ps(sc.l.data() + i * kBlock)), alpha = 1.0f;
    if (qs.sinks) std::tie(alpha, l) = SinkScale(sc.m[i], l, qs.sinks[i % G]);
    const float inv = l > 0 ? alpha / l : 0.0f;
    float* dst = qs.out + (i / G) * qs.stride + (i % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = sc.o[i * Dp + d] * inv;
  }
}

// Runs extend items [0, n) of at most max_queries queries over the pool's threads, with a
// Scratch per range; more ranges than threads balances items of unequal cost (causal
// prefill items grow along the row).
template <typename Item>
void RunBlocks(ffi::ThreadPool& pool, int64_t n, int64_t max_queries, int64_t D,
               const Item& item) {
  xlaserve::ParallelRanges(pool, n, 8 * xlaserve::Workers(pool), [&](int64_t i0, int64_t i1) {
    Scratch sc(max_queries, PaddedDim(D));
    for (int64_t i = i0; i < i1; ++i) item(i, sc);
  });
}

// Extend items: up to `tokens` consecutive tokens of one row (and a kv head) share their
// keys: the row's pool prefix (which ends at the position of its first new token), then
// the row's new tokens up to the last one any of them sees.
template <typename T>
struct Extend {
  const float* q;
  const T *k_new, *v_new, *k_pool, *v_pool;
  const int32_t *page_table, *query_start, *positions;
  const int32_t* lo;           // [T] each token's first visible position
  const int64_t* item_token;   // [items + 1] first token of each item (row-aligned)
  const int32_t* item_row;     // [items]
  float* out;

  void operator()(const Shapes& s, int64_t item, Scratch& sc) const {
    const int64_t group = item / s.Hkv, h = item % s.Hkv;
    const int64_t t0 = item_token[group], t1 = item_token[group + 1], r = item_row[group];
    const int64_t row0 = query_start[r], row1 = query_start[r + 1];
    int32_t max_pos = INT32_MIN, min_lo = INT32_MAX;
    for (int64_t t = t0; t < t1; ++t)
      max_pos = std::max(max_pos, positions[t]), min_lo = std::min(min_lo, lo[t]);
    // New tokens' positions increase along the row (padding, at 2^30, last): the keys any
    // of these tokens sees end at the first later position.
    int64_t j_end = t1;
    while (j_end < row1 && positions[j_end] <= max_pos) ++j_end;
    const int64_t prefix = std::min<int64_t>(positions[row0], s.W * s.S);
    int64_t first = std::clamp<int64_t>(min_lo, 0, prefix);
    if (min_lo > prefix) {  // the window starts among the new tokens
      int64_t j = row0;
      while (j < j_end && positions[j] < min_lo) ++j;
      first = prefix + (j - row0);
    }
    const int64_t kv = (row0 * s.Hkv + h) * s.D;
    const Stream<T> st{k_pool, v_pool, page_table + r * s.W, (s.layer * s.Hkv + h) * s.P,
                       k_new + kv, v_new + kv, s.Hkv * s.D, positions + row0,
                       first, prefix, prefix + (j_end - row0)};
    const int64_t qo = (t0 * s.Hq + h * s.G) * s.D;
    AttendBlock<T>(s, Queries{q + qo, out + qo, s.Hq * s.D, t1 - t0, positions + t0, lo + t0,
                              s.sinks ? s.sinks + h * s.G : nullptr},
                   st, sc);
  }
};

template <typename A, typename B>
bool SameShape(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Checks the operands shared by both kernels; fills `s` (all but W).
template <typename KV>
ffi::Error CheckCommon(const char* name, ffi::Buffer<ffi::F32>& q, KV& k_new, KV& v_new,
                       KV& k_pool, KV& v_pool, ffi::Buffer<ffi::S32>& layer,
                       ffi::Buffer<ffi::S32>& window, ffi::Buffer<ffi::F32>& sinks,
                       float sm_scale, float soft_cap, Shapes& s) {
  const auto qd = q.dimensions(), kd = k_new.dimensions(), pd = k_pool.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 5 || kd[0] != qd[0] ||
      kd[2] != qd[2] || pd[1] != kd[1] || pd[4] != qd[2] || kd[1] == 0 ||
      qd[1] % kd[1] != 0 || !SameShape(v_pool.dimensions(), pd) ||
      !SameShape(v_new.dimensions(), kd))
    return ffi::Error::InvalidArgument(
        std::string(name) + ": want q [T, Hq, D], k/v_new [T, Hkv, D], pools [L, Hkv, P, S, D]");
  if (window.element_count() != 1 ||
      (sinks.element_count() != 0 && sinks.element_count() != qd[1]))
    return ffi::Error::InvalidArgument(std::string(name) + ": want window [], sinks [Hq] or [0]");
  s = Shapes{qd[1], kd[1], qd[1] / kd[1], qd[2], pd[2], pd[3], 0,
             static_cast<int64_t>(layer.typed_data()[0]), sm_scale, soft_cap,
             std::max<int64_t>(window.typed_data()[0], 0),
             sinks.element_count() ? sinks.typed_data() : nullptr};
  if (s.layer < 0 || s.layer >= pd[0])
    return ffi::Error::InvalidArgument(std::string(name) + ": layer out of range");
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<DT> k_new, ffi::Buffer<DT> v_new,
                           ffi::Buffer<DT> k_pool, ffi::Buffer<DT> v_pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> window,
                           ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                           float sm_scale, float soft_cap) {
  Shapes s;
  if (auto e = CheckCommon("decode_attention", q, k_new, v_new, k_pool, v_pool, layer, window,
                           sinks, sm_scale, soft_cap, s);
      e.failure())
    return e;
  const int64_t B = q.dimensions()[0];
  const auto td = page_table.dimensions();
  if (td.size() != 2 || td[0] != B || seq_lens.element_count() != B)
    return ffi::Error::InvalidArgument(
        "decode_attention: want page_table [B, W], seq_lens [B] for q [B, Hq, D]");
  s.W = td[1];
  const Decode<ffi::NativeType<DT>> work{q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                    k_pool.typed_data(), v_pool.typed_data(), page_table.typed_data(),
                    seq_lens.typed_data(), out->typed_data()};
  RunDecode(pool, s, B * s.Hkv, work);
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error ExtendAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<DT> k_new, ffi::Buffer<DT> v_new,
                           ffi::Buffer<DT> k_pool, ffi::Buffer<DT> v_pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> positions,
                           ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks,
                           ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap) {
  Shapes s;
  if (auto e = CheckCommon("extend_attention", q, k_new, v_new, k_pool, v_pool, layer, window,
                           sinks, sm_scale, soft_cap, s);
      e.failure())
    return e;
  const int64_t T = q.dimensions()[0];
  const auto td = page_table.dimensions();
  const int64_t rows = td.size() == 2 ? td[0] : -1;
  if (rows < 0 || query_start.element_count() != rows + 1 || positions.element_count() != T)
    return ffi::Error::InvalidArgument(
        "extend_attention: want page_table [B, W], query_start [B + 1], positions [T]");
  s.W = td[1];
  // Items: runs of up to `per_item` tokens within a row (~64 queries: each key block is
  // shared by more queries, and the item's queries, outputs and softmax state stay in L2). Tokens past the last row are padding
  // and give 0.
  const int32_t* qs = query_start.typed_data();
  const int32_t* pos = positions.typed_data();
  // Padding follows the last row's tokens inside its query_start span, at kPadPosition,
  // where a causal mask lets it see every key: cut it off, or a 300-token chunk in a
  // 512-token bucket attends 512 queries.
  int64_t real_end = T;
  while (real_end > 0 && pos[real_end - 1] >= kPadPosition) --real_end;
  const int64_t per_item = std::max<int64_t>(1, 64 / s.G);
  std::vector<int64_t> item_token{0};
  std::vector<int32_t> item_row;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t end = std::clamp<int64_t>(qs[r + 1], item_token.back(), real_end);
    for (int64_t t = item_token.back(); t < end; t = std::min(t + per_item, end)) {
      item_token.push_back(std::min(t + per_item, end));
      item_row.push_back(static_cast<int32_t>(r));
    }
  }
  float* o = out->typed_data();
  std::fill(o + item_token.back() * s.Hq * s.D, o + T * s.Hq * s.D, 0.0f);
  std::vector<int32_t> lo(T, INT32_MIN);  // each token's first visible position
  if (s.window > 0)
    for (int64_t t = 0; t < T; ++t)
      lo[t] = static_cast<int32_t>(std::max<int64_t>(pos[t] - s.window + 1, INT32_MIN));
  const Extend<ffi::NativeType<DT>> work{q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                    k_pool.typed_data(), v_pool.typed_data(), page_table.typed_data(),
                    qs, pos, lo.data(), item_token.data(), item_row.data(), o};
  RunBlocks(pool, static_cast<int64_t>(item_row.size()) * s.Hkv, per_item * s.G, s.D,
            [&](int64_t i, Scratch& sc) { work(s, i, sc); });
  return ffi::Error::Success();
}

// The bindings both handlers share: the pool context and q, k_new, v_new, k_pool, v_pool,
// layer, page_table first; then each its own operands; then window and sinks; the
// attributes last. K/V are DT.
template <ffi::DataType DT>
auto BindLeading() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}

template <typename Binding>
auto BindTrailing(Binding b) {  // Binding's methods take an rvalue
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("sm_scale")
      .template Attr<float>("soft_cap");
}

template <ffi::DataType DT>
auto DecodeBinding() {
  return BindTrailing(BindLeading<DT>().template Arg<ffi::Buffer<ffi::S32>>());
}

template <ffi::DataType DT>
auto ExtendBinding() {
  return BindTrailing(BindLeading<DT>()
                          .template Arg<ffi::Buffer<ffi::S32>>()
                          .template Arg<ffi::Buffer<ffi::S32>>());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeAttention, DecodeAttention<ffi::F32>,
                              DecodeBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveExtendAttention, ExtendAttention<ffi::F32>,
                              ExtendBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeAttentionBf16, DecodeAttention<ffi::BF16>,
                              DecodeBinding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveExtendAttentionBf16, ExtendAttention<ffi::BF16>,
                              ExtendBinding<ffi::BF16>());
