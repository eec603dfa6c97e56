// The CPU step's vector pieces, shared by the float-moment step (fused_adam_cpu.cpp) and the
// blockwise one (adam_blockwise_cpu.cpp): at::vec loads and stores widening 16-bit types to fp32,
// remainders joined and split, and one chunk of the update (adam_chunk). Compiled into each file
// of one module with the same vector ISA flags (optim/kernels/variants.py).
#pragma once

#include "../common.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <tuple>
#include <type_traits>

namespace shardamp {
namespace cpu {


using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kW = fVec::size();  // floats per vector register
constexpr int64_t kV = 2 * kW;        // elements per step: one bf16/fp16 vector widens to two fp32

// Loads/stores kV consecutive elements of T as two fp32 vectors. bf16/fp16 go through at::vec's
// conversions, which round to nearest even on the way back, as Tensor.to() does.
template <typename T>
inline void load2(const T* p, fVec& a, fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + kW);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
  }
}

template <typename T>
inline void store2(T* p, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + kW);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// Param remainders: kV fp32 masters from their bf16 high halves (raw bits) and int16 low halves,
// and back. Plain loops over a register-sized block: the compiler vectorizes them.
inline void join_block(const uint16_t* hi, const int16_t* lo, fVec& a, fVec& b) {
  alignas(64) float buf[kV];
  for (int64_t k = 0; k < kV; ++k) buf[k] = join_remainder(hi[k], lo[k]);
  a = fVec::loadu(buf);
  b = fVec::loadu(buf + kW);
}

inline void split_block(const fVec& a, const fVec& b, uint16_t* hi, int16_t* lo) {
  alignas(64) float buf[kV];
  a.store(buf);
  b.store(buf + kW);
  for (int64_t k = 0; k < kV; ++k) split_remainder(buf[k], hi[k], lo[k]);
}

// One chunk of the update. P: the master storage (float, or int16 remainders when R, with O the
// bf16 param holding the high halves); M / V: the moments (float or bf16, rounded to nearest
// even on store). Every dtype choice is a template parameter: the loop has no dtype branches.
template <typename G, typename O, typename M, typename V, bool R>
inline void adam_chunk(const G* gp, void* pp_, M* mp, V* vp, O* op, int64_t lo, int64_t hi,
                       const SegmentScalars& s, bool adam_w) {
  using P = std::conditional_t<R, int16_t, float>;
  P* pp = static_cast<P*>(pp_);
  const fVec coef(s.coef), decay(s.decay), wd(s.wd), w1(s.w1), b2(s.beta2), omb2(s.one_minus_beta2),
      bc2(s.bc2_sqrt), eps(s.eps), lr(s.step_size), one(1.f);
  // torch.lerp switches formula at weight 0.5; the weight is per segment, so the branch is too.
  const bool lerp_lo = s.w1 < 0.5f;
  auto update = [&](fVec& g, fVec& p, fVec& m, fVec& v) {
    g = g * coef;
    if (adam_w) p = p * decay; else g = g + wd * p;
    m = lerp_lo ? m + w1 * (g - m) : g - (g - m) * (one - w1);
    v = v * b2 + omb2 * g * g;
    p = p - lr * (m / (v.sqrt() / bc2 + eps));
  };
  [[maybe_unused]] uint16_t* hbits = nullptr;
  if constexpr (R) hbits = reinterpret_cast<uint16_t*>(op);
  int64_t i = lo;
  for (; i + kV <= hi; i += kV) {
    fVec g0, g1, p0, p1, m0, m1, v0, v1;
    load2(gp + i, g0, g1);
    if constexpr (R) {
      join_block(hbits + i, pp + i, p0, p1);
    } else {
      load2(pp + i, p0, p1);
    }
    load2(mp + i, m0, m1);
    load2(vp + i, v0, v1);
    update(g0, p0, m0, v0);
    update(g1, p1, m1, v1);
    store2(mp + i, m0, m1);
    store2(vp + i, v0, v1);
    if constexpr (R) {
      split_block(p0, p1, hbits + i, pp + i);
    } else {
      store2(pp + i, p0, p1);
      if constexpr (!std::is_void_v<O>) store2(op + i, p0, p1);
    }
  }
  for (; i < hi; ++i) {
    float p, m = static_cast<float>(mp[i]), v = static_cast<float>(vp[i]);
    if constexpr (R) {
      p = join_remainder(hbits[i], pp[i]);
    } else {
      p = pp[i];
    }
    adam_scalar(static_cast<float>(gp[i]), p, m, v, s, adam_w);
    mp[i] = static_cast<M>(m);
    vp[i] = static_cast<V>(v);
    if constexpr (R) {
      split_remainder(p, hbits[i], pp[i]);
    } else {
      pp[i] = p;
      if constexpr (!std::is_void_v<O>) op[i] = static_cast<O>(p);
    }
  }
}

}  // namespace cpu
}  // namespace shardamp
