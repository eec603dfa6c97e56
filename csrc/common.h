// Shared by the CPU (.cpp) and CUDA (.cu) kernels: the per-segment scalars and the per-element
// Adam update, written once so both devices do the same arithmetic in the same order as
// optim/kernels/reference.py (scalars in fp64 as torch.optim forms them from Python floats, then fp32).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(__CUDACC__)
#define SHARDAMP_HD __host__ __device__ __forceinline__
#else
#define SHARDAMP_HD inline
#endif

// Argument errors are thrown as std::runtime_error (Python RuntimeError), not c10::Error: on
// torch 2.11 + g++ 13.3 a c10::Error thrown from a JIT-built extension was seen to crash the
// interpreter (segfault) instead of raising, while std exceptions translate cleanly.
#define SHARDAMP_CHECK(cond, ...)                                          \
  do {                                                                     \
    if (!(cond)) throw std::runtime_error(c10::str(__VA_ARGS__));          \
  } while (0)

namespace shardamp {

// Elements per unit of work of the CPU adam_step (one at::parallel_for task), and the default of
// chunk tables built without an explicit size. A chunk never crosses a segment, so each one has a
// single set of hyperparameters. (It was the CUDA block's size too until the CUDA step got
// kCudaChunk below; csrc/NOTES.md has the measurements of both.)
#ifndef SHARDAMP_CHUNK
#define SHARDAMP_CHUNK 16384
#endif
constexpr int64_t kChunk = SHARDAMP_CHUNK;

// The CUDA step's unit of work (one block each). Its blocks read their scalars from per-segment
// records without a barrier, so a chunk costs little to start, and 4096 elements was the fastest
// size for the fp32 state kinds (larger chunks leave a ragged last wave, smaller ones pay the
// start more often: csrc/NOTES.md; the timings are in docs/performance.md). SHARDAMP_CUDA_CHUNK
// in the environment overrides it at run time (optim/kernels/dispatch.py), for such measurements.
#ifndef SHARDAMP_CUDA_CHUNK
#define SHARDAMP_CUDA_CHUNK 4096
#endif
constexpr int64_t kCudaChunk = SHARDAMP_CUDA_CHUNK;

// Floats per segment record of the CUDA step (adam_prepare -> adam_step's records: nine
// scalars, a skip flag, padding to three float4).
constexpr int64_t kRecordFloats = 12;

// The most segments of a CUDA launch whose grads are read where autograd left them (grad_parts.h):
// each segment's grad address travels in the update launch's arguments (8 bytes each, inside the
// portable 4 KiB of kernel arguments with the rest), and each grad's address, start and length in
// the flags' pass's (24 bytes each). A bucket with more segments is copied into its shard.
constexpr int64_t kHeldSegments = 128;

// A chunk-table row is (start, segment << 32 | length); length <= kChunk fits 32 bits.
SHARDAMP_HD int64_t chunk_segment(int64_t packed) { return packed >> 32; }
SHARDAMP_HD int64_t chunk_length(int64_t packed) { return packed & 0xffffffffLL; }

// Dtype of a scalar tensor read on the device (found_inf, grad_coef, steps, touched): the
// optimizer may keep these as fp32, fp64, bool/uint8 or integers, so kernels take a tag instead
// of being instantiated for each.
enum ScalarCode : int { kF32 = 0, kF64 = 1, kU8 = 2, kI32 = 3, kI64 = 4 };

SHARDAMP_HD double load_scalar(const void* p, int code, int64_t i) {
  switch (code) {
    case kF32: return static_cast<const float*>(p)[i];
    case kF64: return static_cast<const double*>(p)[i];
    case kU8: return static_cast<const uint8_t*>(p)[i];
    case kI32: return static_cast<const int32_t*>(p)[i];
    default: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
  }
}

inline int scalar_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kDouble: return kF64;
    case at::kBool:
    case at::kByte: return kU8;
    case at::kInt: return kI32;
    case at::kLong: return kI64;
    default: SHARDAMP_CHECK(false, "shardamp kernels: unsupported scalar tensor dtype ", t.scalar_type());
  }
}

// Host read of a CPU scalar tensor (only the CPU kernels use this).
inline double read_scalar(const at::Tensor& t, int64_t i) {
  return load_scalar(t.data_ptr(), scalar_code(t), i);
}

// NaN-propagating max, as torch.maximum.
SHARDAMP_HD float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// The row of ``rows`` (int64 [k, 3] of (start, length, index), sorted by start, not overlapping)
// holding element ``i``, or -1 where none does (padding between rows).
SHARDAMP_HD int64_t find_row(const int64_t* rows, int64_t n_rows, int64_t i) {
  int64_t lo = 0, hi = n_rows - 1, found = -1;
  while (lo <= hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (rows[3 * mid] <= i) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return (found >= 0 && i < rows[3 * found] + rows[3 * found + 1]) ? found : -1;
}

// The flags' passes on both devices: element ``i`` (value ``v``) is inf/NaN (v - v is NaN then,
// and NaN != 0 too): its row's flag (``rows``' third column names it) and the any flag set.
SHARDAMP_HD void flag_nonfinite(float v, int64_t i, const int64_t* rows, int64_t n_rows, float* flags,
                                int64_t any_index) {
  if (v - v == 0.f) return;
  const int64_t row = find_row(rows, n_rows, i);
  if (row >= 0) {
    flags[rows[3 * row + 2]] = 1.f;
    flags[any_index] = 1.f;
  }
}

struct SegmentScalars {
  float coef;             // grad_coef
  float decay;            // 1 - lr * wd        (AdamW)
  float wd;               // wd                 (Adam, L2)
  float w1;               // 1 - beta1, the lerp weight
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;         // sqrt(1 - beta2^step), or 1
  float eps;
  float step_size;        // lr / (1 - beta1^step), or lr
};

// hp: one row (lr, beta1, beta2, eps, wd) of the fp64 hparams table.
SHARDAMP_HD SegmentScalars segment_scalars(const double* hp, double step, double coef, bool bias_correction) {
  const double lr = hp[0], beta1 = hp[1], beta2 = hp[2], eps = hp[3], wd = hp[4];
  const double bc1 = bias_correction ? 1.0 - pow(beta1, step) : 1.0;
  const double bc2_sqrt = bias_correction ? sqrt(1.0 - pow(beta2, step)) : 1.0;
  SegmentScalars s;
  s.coef = static_cast<float>(coef);
  s.decay = static_cast<float>(1.0 - lr * wd);
  s.wd = static_cast<float>(wd);
  s.w1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(bc2_sqrt);
  s.eps = static_cast<float>(eps);
  s.step_size = static_cast<float>(lr / bc1);
  return s;
}

// fp32 arithmetic rounded after every operation, never contracted into FMAs: nvcc contracts
// a * b + c by default, and where it does can differ between template instantiations (seen on an
// H200: the remainders kernel and the fp32-master kernel disagreed in the last bit), so on the
// device every operation is an explicitly rounded intrinsic. The host build is ISO C++ with
// -ffp-contract=off (optim/kernels/build.py): the same operations, the same bits on both devices.
#if defined(__CUDA_ARCH__)
#define SHARDAMP_MUL(a, b) __fmul_rn(a, b)
#define SHARDAMP_ADD(a, b) __fadd_rn(a, b)
#define SHARDAMP_SUB(a, b) __fsub_rn(a, b)
#define SHARDAMP_DIV(a, b) __fdiv_rn(a, b)
#define SHARDAMP_SQRT(a) __fsqrt_rn(a)
#else
#define SHARDAMP_MUL(a, b) ((a) * (b))
#define SHARDAMP_ADD(a, b) ((a) + (b))
#define SHARDAMP_SUB(a, b) ((a) - (b))
#define SHARDAMP_DIV(a, b) ((a) / (b))
#define SHARDAMP_SQRT(a) std::sqrt(a)
#endif

// One element of the update. The expression order mirrors reference.py (torch.lerp's two
// formulas included) so that results agree to fp32 round-off.
SHARDAMP_HD void adam_scalar(float g, float& p, float& m, float& v, const SegmentScalars& s, bool adam_w) {
  g = SHARDAMP_MUL(g, s.coef);
  if (adam_w) {
    p = SHARDAMP_MUL(p, s.decay);
  } else {
    g = SHARDAMP_ADD(g, SHARDAMP_MUL(s.wd, p));
  }
  const float d = SHARDAMP_SUB(g, m);
  m = s.w1 < 0.5f ? SHARDAMP_ADD(m, SHARDAMP_MUL(s.w1, d)) : SHARDAMP_SUB(g, SHARDAMP_MUL(d, SHARDAMP_SUB(1.0f, s.w1)));
  v = SHARDAMP_ADD(SHARDAMP_MUL(v, s.beta2), SHARDAMP_MUL(SHARDAMP_MUL(s.one_minus_beta2, g), g));
  const float denom = SHARDAMP_ADD(SHARDAMP_DIV(SHARDAMP_SQRT(v), s.bc2_sqrt), s.eps);
  p = SHARDAMP_SUB(p, SHARDAMP_MUL(s.step_size, SHARDAMP_DIV(m, denom)));
}

// Param remainders (optim/kernels/reference.py: join_remainders / split_remainders): the fp32 master's
// bit pattern is (hi << 16) + lo modulo 2^32, hi the bf16 param's bits, lo a signed int16. The
// split rounds the pattern half-up at bit 16 (to nearest, ties away from zero), so every fp32
// pattern has exactly one (hi, lo) and the join restores it bit for bit.
SHARDAMP_HD float join_remainder(uint16_t hi, int16_t lo) {
  const uint32_t bits = (static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo));
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

SHARDAMP_HD void split_remainder(float p, uint16_t& hi, int16_t& lo) {
  uint32_t bits;
  memcpy(&bits, &p, sizeof(bits));
  hi = static_cast<uint16_t>((bits + 0x8000u) >> 16);
  lo = static_cast<int16_t>(static_cast<uint16_t>(bits & 0xffffu));
}

// Compile-time dispatch over the tensor dtypes of adam_step: f(Tag<T>{}) with T the element
// type for a runtime dtype (BF16 / F16: the device's own 16-bit float types).
template <typename T>
struct Tag {
  using type = T;
};

template <typename BF16, typename F16, typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(Tag<float>{});
    case at::kBFloat16: return f(Tag<BF16>{});
    case at::kHalf: return f(Tag<F16>{});
    default: SHARDAMP_CHECK(false, "adam_step: unsupported ", what, " dtype ", t);
  }
}

// Moments are fp32 or bf16.
template <typename BF16, typename F>
void dispatch_moment(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(Tag<float>{});
    case at::kBFloat16: return f(Tag<BF16>{});
    default: SHARDAMP_CHECK(false, "adam_step: unsupported ", what, " dtype ", t, " (fp32 or bf16)");
  }
}

// adam_step's instantiations: G grad, O model_out (void: none), M / V the moments, R: the master
// is int16 remainders under a bf16 model_out (then O is the bf16 type). Calls
// launch(Tag<G>, Tag<O>, Tag<M>, Tag<V>, std::bool_constant<R>) once.
template <typename BF16, typename F16, typename Launch>
void dispatch_step(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& model_out, Launch&& launch) {
  const bool remainders = master.scalar_type() == at::kShort;
  dispatch_float<BF16, F16>(grad.scalar_type(), "grad", [&](auto g) {
    using G = typename decltype(g)::type;
    dispatch_moment<BF16>(exp_avg.scalar_type(), "exp_avg", [&](auto m) {
      using M = typename decltype(m)::type;
      dispatch_moment<BF16>(exp_avg_sq.scalar_type(), "exp_avg_sq", [&](auto v) {
        using V = typename decltype(v)::type;
        if (remainders) return launch(Tag<G>{}, Tag<BF16>{}, Tag<M>{}, Tag<V>{}, std::true_type{});
        if (!model_out) return launch(Tag<G>{}, Tag<void>{}, Tag<M>{}, Tag<V>{}, std::false_type{});
        dispatch_float<BF16, F16>(model_out->scalar_type(), "model_out", [&](auto o) {
          launch(Tag<G>{}, Tag<typename decltype(o)::type>{}, Tag<M>{}, Tag<V>{}, std::false_type{});
        });
      });
    });
  });
}

struct GradPart;  // grad_parts.h

// The validated arguments of adam_step, as the binding hands them to either device.
struct AdamArgs {
  at::Tensor grad, master, exp_avg, exp_avg_sq;
  c10::optional<at::Tensor> model_out;
  at::Tensor segments, hparams, steps, touched, grad_coef, found_inf;
  bool adam_w_mode;
  bool bias_correction;
  // the grads where autograd left them (grad_parts.h), read in place; ``grad`` is then an empty
  // tensor of their dtype. CPU: the parts; CUDA: each segment's grad address (segment_bases)
  const std::vector<GradPart>* parts = nullptr;
  const std::vector<const void*>* bases = nullptr;
};

}  // namespace shardamp
