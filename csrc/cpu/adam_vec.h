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

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

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

// The fp32 update at 256 bits in the AVX-512 build (update_fp32_256, below): every state fp32, no
// remainders. Why: the update is bound by its two divisions and square root per element, which
// 512-bit registers do no faster per element than 256-bit ones, and 512 measured slower: on the
// 2-core AVX-512 VM of docs/performance.md ("A small model on the CPU") the same loop over 263K
// fp32 elements took 210 us at 512 bits and 181 us at 256 (torch's fused AdamW there, also
// 256-bit, 160-168 us). Each element's operations are the same IEEE operations
// in the same order at either width (no contraction: -ffp-contract=off), so the results are the
// same bit for bit (grad_stats' L2 sums likewise, lane for lane: grad_stats_cpu.cpp).
template <typename G, typename O, typename M, typename V, bool R>
constexpr bool kUpdate256 =
#if defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<G, float> && std::is_same_v<M, float> && std::is_same_v<V, float> && !R &&
    (std::is_void_v<O> || std::is_same_v<O, float>);
#else
    false;
#endif

// [lo, i) of the chunk updated 8 + 8 elements a step with adam_chunk's operations (its `update`,
// operation for operation); returns i, where fewer than 16 are left for the scalar remainder.
// `op`: the model params' fp32 copy, or null. Only the AVX-512 build defines it (kUpdate256);
// elsewhere it is declared for adam_chunk's discarded branch and never called.
#if defined(CPU_CAPABILITY_AVX512)
inline int64_t update_fp32_256(const float* gp, float* pp, float* mp, float* vp, float* op, int64_t lo, int64_t hi,
                               const SegmentScalars& s, bool adam_w) {
  const __m256 coef = _mm256_set1_ps(s.coef), decay = _mm256_set1_ps(s.decay), wd = _mm256_set1_ps(s.wd),
               w1 = _mm256_set1_ps(s.w1), b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_beta2),
               bc2 = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps), lr = _mm256_set1_ps(s.step_size),
               one_minus_w1 = _mm256_sub_ps(_mm256_set1_ps(1.f), w1);
  const bool lerp_lo = s.w1 < 0.5f;
  auto update = [&](__m256& g, __m256& p, __m256& m, __m256& v) {
    g = _mm256_mul_ps(g, coef);
    if (adam_w) {
      p = _mm256_mul_ps(p, decay);
    } else {
      g = _mm256_add_ps(g, _mm256_mul_ps(wd, p));
    }
    const __m256 d = _mm256_sub_ps(g, m);
    m = lerp_lo ? _mm256_add_ps(m, _mm256_mul_ps(w1, d)) : _mm256_sub_ps(g, _mm256_mul_ps(d, one_minus_w1));
    v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    p = _mm256_sub_ps(p, _mm256_mul_ps(lr, _mm256_div_ps(m, denom)));
  };
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m256 g0 = _mm256_loadu_ps(gp + i), g1 = _mm256_loadu_ps(gp + i + 8);
    __m256 p0 = _mm256_loadu_ps(pp + i), p1 = _mm256_loadu_ps(pp + i + 8);
    __m256 m0 = _mm256_loadu_ps(mp + i), m1 = _mm256_loadu_ps(mp + i + 8);
    __m256 v0 = _mm256_loadu_ps(vp + i), v1 = _mm256_loadu_ps(vp + i + 8);
    update(g0, p0, m0, v0);
    update(g1, p1, m1, v1);
    _mm256_storeu_ps(mp + i, m0);
    _mm256_storeu_ps(mp + i + 8, m1);
    _mm256_storeu_ps(vp + i, v0);
    _mm256_storeu_ps(vp + i + 8, v1);
    _mm256_storeu_ps(pp + i, p0);
    _mm256_storeu_ps(pp + i + 8, p1);
    if (op != nullptr) {
      _mm256_storeu_ps(op + i, p0);
      _mm256_storeu_ps(op + i + 8, p1);
    }
  }
  return i;
}
#else
int64_t update_fp32_256(const float* gp, float* pp, float* mp, float* vp, float* op, int64_t lo, int64_t hi,
                        const SegmentScalars& s, bool adam_w);
#endif

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
  if constexpr (kUpdate256<G, O, M, V, R>) {
    float* out = nullptr;
    if constexpr (!std::is_void_v<O>) out = op;
    i = update_fp32_256(gp, pp, mp, vp, out, lo, hi, s, adam_w);
  }
  for (; !kUpdate256<G, O, M, V, R> && i + kV <= hi; i += kV) {
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
