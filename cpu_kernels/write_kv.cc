// xlaserve CPU KV write: this step's K/V rows into their pool slots, in place (the pools
// are aliased to the outputs), called from jit through the XLA FFI.
//
// Why: XLA CPU scatters a bfloat16 pool by converting all of it to f32 and back, a read
// and two writes of the whole pool per step (755 MB of bf16 K/V: ~1-3 s instead of the
// f32 pool's ~7 ms). Here a step touches only the rows it writes, in either dtype.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// pools [L, Hkv, P, S, D]; layers [N]; slots [T] (flat page * S + slot; outside the pool:
// dropped, as the jnp scatter drops them); k_new, v_new [N, T, Hkv, D] in the pools' dtype.
// `after`: not read; an operand computed from every read of the pools this step, so that
// XLA orders this in-place write after them by data dependency (cpu_kernels.write_kv).
template <ffi::DataType DT>
ffi::Error WriteKv(ffi::Buffer<DT> k_pool, ffi::Buffer<DT> v_pool, ffi::Buffer<ffi::S32> layers,
                   ffi::Buffer<ffi::S32> slots, ffi::Buffer<DT> k_new, ffi::Buffer<DT> v_new,
                   ffi::AnyBuffer after, ffi::ResultBuffer<DT> k_out,
                   ffi::ResultBuffer<DT> v_out) {
  using T = ffi::NativeType<DT>;
  const auto pd = k_pool.dimensions(), nd = k_new.dimensions();
  const int64_t N = layers.element_count(), Tn = slots.element_count();
  if (pd.size() != 5 || nd.size() != 4 || nd[0] != N || nd[1] != Tn || nd[2] != pd[1] ||
      nd[3] != pd[4] || v_pool.element_count() != k_pool.element_count() ||
      v_new.element_count() != k_new.element_count())
    return ffi::Error::InvalidArgument(
        "write_kv: want pools [L, Hkv, P, S, D], layers [N], slots [T], new [N, T, Hkv, D]");
  if (k_out->typed_data() != k_pool.typed_data() || v_out->typed_data() != v_pool.typed_data())
    return ffi::Error::InvalidArgument("write_kv: the pools must alias the outputs");
  const int64_t L = pd[0], H = pd[1], PS = pd[2] * pd[3], D = pd[4];
  const int32_t* layer = layers.typed_data();
  const int32_t* slot = slots.typed_data();
  for (int64_t n = 0; n < N; ++n) {
    if (layer[n] < 0 || layer[n] >= L) continue;
    for (int64_t t = 0; t < Tn; ++t) {
      if (slot[t] < 0 || slot[t] >= PS) continue;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = ((layer[n] * H + h) * PS + slot[t]) * D;
        const int64_t src = ((n * Tn + t) * H + h) * D;
        std::memcpy(k_out->typed_data() + dst, k_new.typed_data() + src, D * sizeof(T));
        std::memcpy(v_out->typed_data() + dst, v_new.typed_data() + src, D * sizeof(T));
      }
    }
  }
  return ffi::Error::Success();
}

template <ffi::DataType DT>
auto WriteKvBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<DT>>()
      .template Ret<ffi::Buffer<DT>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveWriteKv, WriteKv<ffi::F32>, WriteKvBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveWriteKvBf16, WriteKv<ffi::BF16>,
                              WriteKvBinding<ffi::BF16>());
