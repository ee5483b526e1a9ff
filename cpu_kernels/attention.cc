// xlaserve CPU paged attention (decode and extend), called from jit through the XLA FFI.
//
// A query attends to its row's earlier context, read in place from the paged pool
// through the page table, and to this step's new keys/values of its row (written to the
// pool only after the layer stack). The jnp path gathers every page into a dense copy
// first and the copy dominated its time (XLA's gather runs at ~10 GB/s on this CPU);
// here each page is read where it lies, once for K and once for V.
//
// Work item: one query token and kv head, with its G = Hq / Hkv query heads. Scores for
// all its keys go to a per-thread buffer, then an exact two-pass softmax (max, then exp
// and sum), then p @ V. Items are independent, so a row's result does not depend on the
// rest of its batch.
//
// K/V (pool and new) are float32 or bfloat16 (`--kv_cache_dtype`); bf16 rows widen to
// f32 as they load (a shift), and all arithmetic is f32 either way.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial,
// times 2^n by scalef. Relative error ~2e-7; inputs below -87 give 0 (softmax terms far
// under the max), never NaN.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 K/V elements as f32 (masked: lanes off m are 0); bf16 is f32's top half.
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}
inline __m512 Load16(const uint16_t* p) {
  return Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 Load16(__mmask16 m, const uint16_t* p) { return Widen(_mm256_maskz_loadu_epi16(m, p)); }

template <typename T>
inline float Dot(const float* a, const T* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), Load16(b + i), acc);
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), Load16(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// out[0:d] += p * v[0:d]
template <typename T>
inline void Axpy(float p, const T* v, float* out, int64_t d) {
  const __m512 pp = _mm512_set1_ps(p);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pp, Load16(v + i), _mm512_loadu_ps(out + i)));
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1u);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(pp, Load16(m, v + i),
                                                      _mm512_maskz_loadu_ps(m, out + i)));
  }
}

struct Shapes {
  int64_t Hq, Hkv, G, D, P, S, W;  // heads, group, head dim, pool pages, page size, table
  int64_t layer;
  float scale, soft_cap;  // soft_cap 0: none
  int64_t window;         // 0: none
};

// One query token's G heads against its keys: writes out [G, D]. `keys(f, values)` calls
// f(i, k, v) for its n keys in order (row pointers into the pool or the new K/V); the
// score pass reads k, the value pass (values = true) v.
// kG, kDV > 0: G and D / 16 known at compile time, so the G queries and the G output rows
// stay in registers; 0: any G and D (head dims not a multiple of 16, or too many
// registers), through memory.
template <typename T, int kG, int kDV, typename Keys>
void Attend(const Shapes& s, const float* qb, float* ob, int64_t n, Keys&& keys,
            std::vector<float>& scores) {
  const int64_t D = kDV > 0 ? 16 * kDV : s.D, G = kG > 0 ? kG : s.G;
  if (n == 0) {  // nothing to attend to (padding tokens): 0, as the jnp path gives
    std::fill(ob, ob + G * D, 0.0f);
    return;
  }
  const int64_t stride = (n + 15) / 16 * 16;
  scores.resize(G * stride);
  if constexpr (kG > 0) {
    __m512 qv[kG][kDV];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) qv[g][c] = _mm512_loadu_ps(qb + g * D + 16 * c);
    keys([&](int64_t i, const T* k, const T*) {
      __m512 kv[kDV];
      for (int c = 0; c < kDV; ++c) kv[c] = Load16(k + 16 * c);
      for (int g = 0; g < kG; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < kDV; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
        scores[g * stride + i] = _mm512_reduce_add_ps(a);
      }
    }, false);
  } else {
    keys([&](int64_t i, const T* k, const T*) {
      for (int64_t g = 0; g < G; ++g) scores[g * stride + i] = Dot(qb + g * D, k, D);
    }, false);
  }

  // Softmax per query head, in place: scores -> probabilities.
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores.data() + g * stride;
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc + i), scale);
      if (s.soft_cap > 0) {  // rare (Gemma-style models): scalar tanh
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, x);
        for (float& v : tmp) v = s.soft_cap * std::tanh(v / s.soft_cap);
        x = _mm512_load_ps(tmp);
      }
      _mm512_storeu_ps(sc + i, x);
      vmx = _mm512_mask_max_ps(vmx, m, vmx, x);
    }
    vmx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
      const __m512 e = _mm512_maskz_mov_ps(m, Exp(_mm512_sub_ps(_mm512_loadu_ps(sc + i), vmx)));
      _mm512_storeu_ps(sc + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));  // >= exp(0)
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(sc + i, _mm512_mul_ps(_mm512_loadu_ps(sc + i), inv));
  }

  if constexpr (kG > 0) {
    __m512 acc[kG][kDV];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) acc[g][c] = _mm512_setzero_ps();
    keys([&](int64_t i, const T*, const T* v) {
      __m512 vv[kDV];
      for (int c = 0; c < kDV; ++c) vv[c] = Load16(v + 16 * c);
      for (int g = 0; g < kG; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * stride + i]);
        for (int c = 0; c < kDV; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }, true);
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) _mm512_storeu_ps(ob + g * D + 16 * c, acc[g][c]);
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
// (of V in the value pass, else of K), a share per token.
template <typename T, typename F>
void WalkPages(const Shapes& s, const T* k_pool, const T* v_pool,
               const int32_t* table_row, int64_t h, int64_t first, int64_t end, bool values,
               F&& f) {
  const T* ahead = values ? v_pool : k_pool;
  const int64_t head_base = (s.layer * s.Hkv + h) * s.P;  // pool page index of page 0
  const int64_t page_elems = s.S * s.D, lines = (page_elems * sizeof(T) + 63) / 64;
  // Page ids are clipped into the pool, as the jnp path's gathers do: a bad table entry
  // reads a wrong page, never outside the pool.
  auto page_of = [&](int64_t tok) {
    return (head_base + std::clamp<int64_t>(table_row[tok / s.S], 0, s.P - 1)) * page_elems;
  };
  for (int64_t t = first; t < end;) {
    const int64_t slot = t % s.S, n_here = std::min(s.S - slot, end - t);
    const int64_t page = page_of(t);
    const int64_t next = t + n_here < end ? page_of(t + n_here) : -1;
    const int64_t per_token = (lines + n_here - 1) / n_here;
    for (int64_t i = 0; i < n_here; ++i) {
      if (next >= 0) {
        for (int64_t l = i * per_token; l < std::min(lines, (i + 1) * per_token); ++l)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + next) + 64 * l, _MM_HINT_T0);
      }
      const int64_t row = page + (slot + i) * s.D;
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
    Attend<T, kG, kDV>(s, q + qo, out + qo, ctx - first + 1, keys, scores);
  }
};

template <typename T>
struct Extend {
  const float* q;
  const T *k_new, *v_new, *k_pool, *v_pool;
  const int32_t *page_table, *query_start, *positions, *token_row;
  int64_t rows;
  float* out;

  // Token t of row r: the row's pool prefix (positions before its first new token), then
  // the row's new tokens at positions <= its own, all within the window.
  template <int kG, int kDV>
  void operator()(const Shapes& s, int64_t item, std::vector<float>& scores) const {
    const int64_t t = item / s.Hkv, h = item % s.Hkv, r = token_row[t];
    const int64_t qo = (t * s.Hq + h * s.G) * s.D;
    if (r >= rows) {  // a padding token past every row
      Attend<T, kG, kDV>(s, q + qo, out + qo, 0, [](auto&&, bool) {}, scores);
      return;
    }
    const int64_t q_pos = positions[t], lo = s.window > 0 ? q_pos - s.window + 1 : INT64_MIN;
    const int64_t row0 = query_start[r], row1 = query_start[r + 1];
    const int64_t prefix = std::min<int64_t>(positions[row0], s.W * s.S);
    const int64_t first = std::clamp<int64_t>(lo, 0, prefix);
    int64_t n = prefix - first;
    for (int64_t j = row0; j < row1; ++j) n += positions[j] <= q_pos && positions[j] >= lo;
    auto keys = [&](auto&& f, bool values) {
      WalkPages(s, k_pool, v_pool, page_table + r * s.W, h, first, prefix, values,
                [&](int64_t i, const T* k, const T* v) { f(i - first, k, v); });
      int64_t i = prefix - first;
      for (int64_t j = row0; j < row1; ++j) {
        if (positions[j] > q_pos || positions[j] < lo) continue;
        const int64_t kv = (j * s.Hkv + h) * s.D;
        f(i++, k_new + kv, v_new + kv);
      }
    };
    Attend<T, kG, kDV>(s, q + qo, out + qo, n, keys, scores);
  }
};

// Runs work(s, item, scores) for items [0, n) with the register-resident variant for
// the common head shapes (G queries x D floats, twice: at most 24 of the 32 zmm
// registers), else the general one. `ranges` > threads balances items of unequal cost.
template <typename Work>
void RunItems(ffi::ThreadPool& pool, const Shapes& s, int64_t n, const Work& work) {
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

template <typename A, typename B>
bool SameShape(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Checks the operands shared by both kernels; fills `s` (all but W).
template <typename KV>
ffi::Error CheckCommon(const char* name, ffi::Buffer<ffi::F32>& q, KV& k_new, KV& v_new,
                       KV& k_pool, KV& v_pool, ffi::Buffer<ffi::S32>& layer,
                       float sm_scale, float soft_cap, int64_t window, Shapes& s) {
  const auto qd = q.dimensions(), kd = k_new.dimensions(), pd = k_pool.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 5 || kd[0] != qd[0] ||
      kd[2] != qd[2] || pd[1] != kd[1] || pd[4] != qd[2] || kd[1] == 0 ||
      qd[1] % kd[1] != 0 || !SameShape(v_pool.dimensions(), pd) ||
      !SameShape(v_new.dimensions(), kd))
    return ffi::Error::InvalidArgument(
        std::string(name) + ": want q [T, Hq, D], k/v_new [T, Hkv, D], pools [L, Hkv, P, S, D]");
  s = Shapes{qd[1], kd[1], qd[1] / kd[1], qd[2], pd[2], pd[3], 0,
             static_cast<int64_t>(layer.typed_data()[0]), sm_scale, soft_cap, window};
  if (s.layer < 0 || s.layer >= pd[0])
    return ffi::Error::InvalidArgument(std::string(name) + ": layer out of range");
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<DT> k_new, ffi::Buffer<DT> v_new,
                           ffi::Buffer<DT> k_pool, ffi::Buffer<DT> v_pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::ResultBuffer<ffi::F32> out,
                           float sm_scale, float soft_cap, int64_t sliding_window) {
  Shapes s;
  if (auto e = CheckCommon("decode_attention", q, k_new, v_new, k_pool, v_pool, layer,
                           sm_scale, soft_cap, sliding_window, s);
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
  RunItems(pool, s, B * s.Hkv, work);
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error ExtendAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<DT> k_new, ffi::Buffer<DT> v_new,
                           ffi::Buffer<DT> k_pool, ffi::Buffer<DT> v_pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                           int64_t sliding_window) {
  Shapes s;
  if (auto e = CheckCommon("extend_attention", q, k_new, v_new, k_pool, v_pool, layer,
                           sm_scale, soft_cap, sliding_window, s);
      e.failure())
    return e;
  const int64_t T = q.dimensions()[0];
  const auto td = page_table.dimensions();
  const int64_t rows = td.size() == 2 ? td[0] : -1;
  if (rows < 0 || query_start.element_count() != rows + 1 || positions.element_count() != T)
    return ffi::Error::InvalidArgument(
        "extend_attention: want page_table [B, W], query_start [B + 1], positions [T]");
  s.W = td[1];
  // Each token's row (rows + 1 past the last row's end: padding), as searchsorted would.
  const int32_t* qs = query_start.typed_data();
  std::vector<int32_t> token_row(T);
  for (int64_t t = 0, r = 0; t < T; ++t) {
    while (r < rows && t >= qs[r + 1]) ++r;
    token_row[t] = static_cast<int32_t>(r);
  }
  const Extend<ffi::NativeType<DT>> work{q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                    k_pool.typed_data(), v_pool.typed_data(), page_table.typed_data(),
                    qs, positions.typed_data(), token_row.data(), rows, out->typed_data()};
  RunItems(pool, s, T * s.Hkv, work);
  return ffi::Error::Success();
}

// The bindings both handlers share: the pool context and q, k_new, v_new, k_pool, v_pool,
// layer, page_table first; then each its own operands; the attributes last. K/V are DT.
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
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("sm_scale")
      .template Attr<float>("soft_cap")
      .template Attr<int64_t>("sliding_window");
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
