// 16-byte global loads/stores of 8 elements, widened to / narrowed from fp32 in registers
// (fp32, bf16, fp16; and fp32 masters split into bf16 high and int16 low halves).
// Callers guarantee 16-byte alignment for 2-byte types and 32-byte alignment (two float4) for
// fp32: every base pointer is 16-byte aligned and vector work starts at multiples of 8 elements.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace shardamp {
namespace cuda {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

// Round to nearest even, as Tensor.to(dtype) does.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ void unpack(const uint4& r, const float*, float (&f)[4]) {
  f[0] = __uint_as_float(r.x);
  f[1] = __uint_as_float(r.y);
  f[2] = __uint_as_float(r.z);
  f[3] = __uint_as_float(r.w);
}

template <typename H>  // __nv_bfloat16 or __half
__device__ __forceinline__ void unpack(const uint4& r, const H*, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned short lo = static_cast<unsigned short>(w[k] & 0xffffu);
    const unsigned short hi = static_cast<unsigned short>(w[k] >> 16);
    if constexpr (std::is_same_v<H, __nv_bfloat16>) {
      f[2 * k] = __uint_as_float(static_cast<uint32_t>(lo) << 16);  // bf16 -> fp32 is exact
      f[2 * k + 1] = __uint_as_float(static_cast<uint32_t>(hi) << 16);
    } else {
      f[2 * k] = __half2float(__ushort_as_half(lo));
      f[2 * k + 1] = __half2float(__ushort_as_half(hi));
    }
  }
}

template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, float (&f)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else {
    unpack(*reinterpret_cast<const uint4*>(p), p, f);
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ p, const float (&f)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const T lo = from_float<T>(f[2 * k]), hi = from_float<T>(f[2 * k + 1]);
      w[k] = static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&lo)) |
             (static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Staging through shared memory (cp.async, sm_80+): a thread copies its own 16-byte words into
// its own slots and reads them back after waiting on its own copies, so no barrier is needed and
// the bytes in flight hold no registers. Slots of one word index are kThreads apart (a warp's
// 16-byte accesses are consecutive: no bank conflicts). Words per 8 elements: fp32 2, 16-bit 1.
// Used for kinds whose arrays are all 16-bit: with fp32 arrays staging ran slower than the
// register path, also with warp-coalesced copies (csrc/NOTES.md; the cause is not established).
template <typename T>
constexpr int kWords = static_cast<int>(sizeof(T)) / 2;

// Below sm_80 (no cp.async: builds with SHARDAMP_CUDA_ARCH naming older targets) the copy is a
// plain load and store: the same result, without the asynchrony.
__device__ __forceinline__ void cp_async16(uint4* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  *dst = *static_cast<const uint4*>(src);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
#endif
}

template <typename T>
__device__ __forceinline__ void stage8(uint4* dst, int stride, const T* __restrict__ src) {
#pragma unroll
  for (int w = 0; w < kWords<T>; ++w) cp_async16(dst + w * stride, reinterpret_cast<const uint4*>(src) + w);
}

template <typename T>
__device__ __forceinline__ void unstage8(const uint4* s, int stride, float (&f)[8]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint4 r = s[w * stride];
      f[4 * w] = __uint_as_float(r.x);
      f[4 * w + 1] = __uint_as_float(r.y);
      f[4 * w + 2] = __uint_as_float(r.z);
      f[4 * w + 3] = __uint_as_float(r.w);
    }
  } else {
    unpack(s[0], static_cast<const T*>(nullptr), f);
  }
}

// 8 fp32 masters from 8 bf16 high halves and 8 int16 low halves: sign-extended low halves added
// to the high halves shifted into place (mod 2^32).
__device__ __forceinline__ void join8(const uint4& h, const uint4& l, float (&f)[8]) {
  const uint32_t hw[4] = {h.x, h.y, h.z, h.w}, lw[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo0 = static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(lw[k] & 0xffffu)));
    const uint32_t lo1 = static_cast<uint32_t>(static_cast<int32_t>(lw[k]) >> 16);
    f[2 * k] = __uint_as_float((hw[k] << 16) + lo0);
    f[2 * k + 1] = __uint_as_float((hw[k] & 0xffff0000u) + lo1);
  }
}

// Param remainders: 8 fp32 masters from 8 bf16 high halves and 8 int16 low halves (one 16-byte
// load each), and back (common.h: join_remainder / split_remainder, the same bit arithmetic).
__device__ __forceinline__ void load8_joined(const __nv_bfloat16* __restrict__ hi, const int16_t* __restrict__ lo,
                                             float (&f)[8]) {
  join8(*reinterpret_cast<const uint4*>(hi), *reinterpret_cast<const uint4*>(lo), f);
}

__device__ __forceinline__ void store8_split(__nv_bfloat16* __restrict__ hi, int16_t* __restrict__ lo,
                                             const float (&f)[8]) {
  uint32_t hw[4], lw[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t b0 = __float_as_uint(f[2 * k]), b1 = __float_as_uint(f[2 * k + 1]);
    hw[k] = ((b0 + 0x8000u) >> 16) | ((b1 + 0x8000u) & 0xffff0000u);
    lw[k] = (b0 & 0xffffu) | (b1 << 16);
  }
  *reinterpret_cast<uint4*>(hi) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
  *reinterpret_cast<uint4*>(lo) = make_uint4(lw[0], lw[1], lw[2], lw[3]);
}

}  // namespace cuda
}  // namespace shardamp
