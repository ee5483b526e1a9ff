// xlaserve CPU paged decode attention, called from jit through the XLA FFI.
//
// Each decode row has one query at position seq_len - 1. It attends to the row's earlier
// context, read in place from the paged pool through the page table, and to its own new
// key/value (written to the pool only after the layer stack). The jnp path gathers every
// page into a dense copy first and the copy dominated its time (XLA's gather runs at
// ~10 GB/s on this CPU); here each page is read where it lies, once for K and once for V.
//
// Work item: one (row, kv head) pair with its G = Hq / Hkv query heads. Scores for the
// whole context go to a per-thread buffer, then an exact two-pass softmax (max, then
// exp and sum), then p @ V. Items are independent, so a row's result does not depend on
// the rest of its batch.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

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

inline float Dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// out[0:d] += p * v[0:d]
inline void Axpy(float p, const float* v, float* out, int64_t d) {
  const __m512 pp = _mm512_set1_ps(p);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + i),
                                              _mm512_loadu_ps(out + i)));
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1u);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(pp, _mm512_maskz_loadu_ps(m, v + i),
                                                      _mm512_maskz_loadu_ps(m, out + i)));
  }
}

struct Shapes {
  int64_t B, Hq, Hkv, G, D, P, S, W;  // rows, heads, group, head dim, pages, page size, table
  int64_t layer;
  float scale, soft_cap;  // soft_cap 0: none
  int64_t window;         // 0: none
};

// One (row b, kv head h): writes out[b, h*G:(h+1)*G, :]. `scores` holds G x (ctx + 1).
// kG, kDV > 0: G and D / 16 known at compile time, so the G queries and the G output rows
// stay in registers; 0: any G and D (head dims not a multiple of 16, or too many
// registers), through memory.
template <int kG, int kDV>
void Item(const Shapes& s, const float* q, const float* k_new, const float* v_new,
          const float* k_pool, const float* v_pool, const int32_t* page_table,
          const int32_t* seq_lens, float* out, int64_t b, int64_t h,
          std::vector<float>& scores) {
  const int64_t D = kDV > 0 ? 16 * kDV : s.D, G = kG > 0 ? kG : s.G;
  const int64_t q_pos = std::max<int64_t>(seq_lens[b] - 1, 0);
  // Earlier context [first, ctx): the window drops keys at or below q_pos - window.
  const int64_t ctx = std::min<int64_t>(q_pos, s.W * s.S);
  const int64_t first = s.window > 0 ? std::clamp<int64_t>(q_pos - s.window + 1, 0, ctx) : 0;
  const int64_t n = ctx - first + 1;  // + the row's own new key, last
  const int64_t stride = (n + 15) / 16 * 16;
  scores.resize(G * stride);
  const float* qb = q + (b * s.Hq + h * G) * D;  // [G, D]
  const int64_t head_base = (s.layer * s.Hkv + h) * s.P;  // pool page index of page 0
  const float* k_own = k_new + (b * s.Hkv + h) * D;
  const float* v_own = v_new + (b * s.Hkv + h) * D;
  auto page_ptr = [&](const float* pool, int64_t t) {  // token t's page, at its slot 0
    return pool + (head_base + page_table[b * s.W + t / s.S]) * s.S * D;
  };
  // Calls f(t, pointer to token t's row in `pool`) for t in [first, ctx), page by page
  // (no division per token), then f(ctx, own) for the row's new token. Pages lie
  // anywhere in the pool and the hardware prefetcher stops at 4 KiB boundaries, so each
  // page's tokens pull the next page into L1, a share per token.
  auto walk = [&](const float* pool, const float* own, auto&& f) {
    const int64_t page_floats = s.S * D, lines = (page_floats * 4 + 63) / 64;
    for (int64_t t = first; t < ctx;) {
      const int64_t slot = t % s.S, n_here = std::min(s.S - slot, ctx - t);
      const float* page = page_ptr(pool, t);
      const char* next = t + n_here < ctx
                             ? reinterpret_cast<const char*>(page_ptr(pool, t + n_here))
                             : nullptr;
      const int64_t per_token = (lines + n_here - 1) / n_here;
      for (int64_t i = 0; i < n_here; ++i) {
        if (next != nullptr) {
          for (int64_t l = i * per_token; l < std::min(lines, (i + 1) * per_token); ++l)
            _mm_prefetch(next + 64 * l, _MM_HINT_T0);
        }
        f(t + i, page + (slot + i) * D);
      }
      t += n_here;
    }
    f(ctx, own);
  };

  if constexpr (kG > 0) {
    __m512 qv[kG][kDV];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) qv[g][c] = _mm512_loadu_ps(qb + g * D + 16 * c);
    walk(k_pool, k_own, [&](int64_t t, const float* k) {
      __m512 kv[kDV];
      for (int c = 0; c < kDV; ++c) kv[c] = _mm512_loadu_ps(k + 16 * c);
      for (int g = 0; g < kG; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < kDV; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
        scores[g * stride + t - first] = _mm512_reduce_add_ps(a);
      }
    });
  } else {
    walk(k_pool, k_own, [&](int64_t t, const float* k) {
      for (int64_t g = 0; g < G; ++g) scores[g * stride + t - first] = Dot(qb + g * D, k, D);
    });
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

  float* ob = out + (b * s.Hq + h * G) * D;  // [G, D]
  if constexpr (kG > 0) {
    __m512 acc[kG][kDV];
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) acc[g][c] = _mm512_setzero_ps();
    walk(v_pool, v_own, [&](int64_t t, const float* v) {
      __m512 vv[kDV];
      for (int c = 0; c < kDV; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
      for (int g = 0; g < kG; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * stride + t - first]);
        for (int c = 0; c < kDV; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    });
    for (int g = 0; g < kG; ++g)
      for (int c = 0; c < kDV; ++c) _mm512_storeu_ps(ob + g * D + 16 * c, acc[g][c]);
  } else {
    std::fill(ob, ob + G * D, 0.0f);
    walk(v_pool, v_own, [&](int64_t t, const float* v) {
      for (int64_t g = 0; g < G; ++g) Axpy(scores[g * stride + t - first], v, ob + g * D, D);
    });
  }
}

using ItemFn = decltype(&Item<0, 0>);

// The register-resident variants for the common head shapes (G queries x D floats in
// registers, twice: at most 24 of the 32 zmm registers), else the general one.
ItemFn PickItem(int64_t G, int64_t D) {
  if (D == 64) {
    switch (G) {
      case 1: return Item<1, 4>;
      case 2: return Item<2, 4>;
      case 3: return Item<3, 4>;
      case 4: return Item<4, 4>;
      case 5: return Item<5, 4>;
      case 6: return Item<6, 4>;
    }
  }
  if (D == 128) {
    switch (G) {
      case 1: return Item<1, 8>;
      case 2: return Item<2, 8>;
      case 3: return Item<3, 8>;
    }
  }
  return Item<0, 0>;
}

template <typename A, typename B>
bool SameShape(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                           ffi::Buffer<ffi::F32> k_pool, ffi::Buffer<ffi::F32> v_pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::ResultBuffer<ffi::F32> out,
                           float sm_scale, float soft_cap, int64_t sliding_window) {
  const auto qd = q.dimensions(), kd = k_new.dimensions(), pd = k_pool.dimensions();
  const auto td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 5 || td.size() != 2 ||
      kd[0] != qd[0] || kd[2] != qd[2] || pd[1] != kd[1] || pd[4] != qd[2] ||
      td[0] != qd[0] || seq_lens.element_count() != qd[0] || qd[1] % kd[1] != 0 ||
      !SameShape(v_pool.dimensions(), pd) || !SameShape(v_new.dimensions(), kd))
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [B, Hq, D], k/v_new [B, Hkv, D], pools [L, Hkv, P, S, D], "
        "page_table [B, W], seq_lens [B]");
  Shapes s{qd[0], qd[1], kd[1], qd[1] / kd[1], qd[2], pd[2], pd[3], td[1],
           static_cast<int64_t>(layer.typed_data()[0]), sm_scale, soft_cap, sliding_window};
  if (s.layer < 0 || s.layer >= pd[0])
    return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  const int64_t items = s.B * s.Hkv;
  if (items == 0) return ffi::Error::Success();
  const int64_t helpers = std::clamp<int64_t>(pool.num_threads() - 1, 0, items - 1);
  const int64_t ranges = helpers + 1;
  const float *qp = q.typed_data(), *knp = k_new.typed_data(), *vnp = v_new.typed_data();
  const float *kpp = k_pool.typed_data(), *vpp = v_pool.typed_data();
  const int32_t *pt = page_table.typed_data(), *sl = seq_lens.typed_data();
  float* op = out->typed_data();
  auto progress = std::make_shared<Progress>();
  const ItemFn item = PickItem(s.G, s.D);
  auto run = [=]() {
    std::vector<float> scores;
    for (int64_t r; (r = progress->next.fetch_add(1)) < ranges;) {
      const int64_t i1 = (r + 1) * items / ranges;
      for (int64_t i = r * items / ranges; i < i1; ++i)
        item(s, qp, knp, vnp, kpp, vpp, pt, sl, op, i / s.Hkv, i % s.Hkv, scores);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([run]() { run(); });
  run();
  for (int spins = 0; progress->done.load(std::memory_order_acquire) < ranges; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));
