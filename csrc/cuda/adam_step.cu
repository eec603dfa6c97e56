// adam_step on CUDA: one pass over the shard, no temporaries beyond a per-segment scalar table
// (contract: optim/kernels/reference.py). Two kernels:
//   1. prepare_kernel: one thread per segment reads found_inf / touched / steps / grad_coef and
//      the segment's hparams row and forms the scalars derived in fp64 (bias corrections,
//      lr / bc1, 1 - lr * wd) once, into a 48-byte record per segment;
//   2. adam_kernel: one block per row of a host-built chunk table (a <= kCudaChunk slice of one
//      segment). Every thread reads its chunk's row and record itself (broadcast loads that hit
//      L1/L2): no serial set-up by one thread, no barrier, so a block streams from its start.
// found_inf, grad_coef, steps and touched are read on the device: no host sync, CUDA-graph
// capturable. The optimizer runs prepare_kernel once per step for the segments of every bucket
// (adam_prepare) and hands each bucket's adam_step its slice of those records; adam_step alone
// runs its own. Bytes per element: grad read; master (fp32, or bf16 param + int16 remainder),
// exp_avg and exp_avg_sq (fp32 or bf16 each) read + written; model_out written (csrc/NOTES.md
// has the table). Every dtype is a template parameter (G grad, O model_out, M / V moments, R
// remainders), so no instantiation carries a branch on another's dtype. Loads are 16 bytes wide
// and all of a thread's loads of an iteration (U vector steps of 8 elements) are issued before any
// math; each kind has a launch shape (KindShape below): steps per thread, blocks per SM, and for
// all-16-bit kinds loads staged through shared memory instead of registers.

#include "../common.h"
#include "../segment_record.h"
#include "vec.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>

namespace shardamp {
namespace cuda {
namespace {

#ifndef SHARDAMP_ADAM_THREADS
#define SHARDAMP_ADAM_THREADS 256
#endif
constexpr int kThreads = SHARDAMP_ADAM_THREADS;
constexpr int kVec = 8;  // elements per vector step
static_assert(kCudaChunk % (kThreads * kVec) == 0, "a chunk is a whole number of block-wide steps");

// How one instantiation runs: U vector steps per thread per iteration (all of their loads issued
// before any math: the bytes each thread keeps in flight), and B, the fewest resident blocks per
// multiprocessor its register budget must allow (__launch_bounds__: 2 caps at 128 registers).
// `staged`: the loads go through shared memory (cp.async) instead of registers.
template <int U, int B, bool Staged = false>
struct Shape {
  static constexpr int unroll = U, min_blocks = B;
  static constexpr bool staged = Staged;
};
using DefaultShape = Shape<2, 1>;  // __launch_bounds__(kThreads): as before the shapes existed

// 16-byte words per vector step of 8 elements, over every array the step reads.
template <typename G, typename M, typename V, bool R>
constexpr int kStepWords = kWords<G> + 2 + kWords<M> + kWords<V>;  // master: fp32, or bf16 + int16

struct Params {
  const void* grad;
  void* master;  // fp32, or int16 remainders (R)
  void* exp_avg;
  void* exp_avg_sq;
  void* model_out;
  const int64_t* chunks;
  PrepareArgs prep;  // the scalar inputs and the records (prep.records: what adam_kernel reads)
  bool adam_w, vec_ok;
  // held: the grads are read where autograd left them, segment s's from bases[s] (indexed as the
  // shard: segment_bases; null: no grad, the segment is skipped without a read); else from grad
  bool held;
  const void* bases[kHeldSegments];
};

// The update of elements [lo, hi) with the scalars of record `rec`, by the threads of one block.
// The record is loaded here but first used (its skip flag) only after this thread's first data
// loads are issued: a block's record fetch overlaps its data fetch instead of preceding it (a
// chunk is one iteration per thread, so a serial record fetch was a whole extra L2 round trip
// per block). A skipped segment costs those reads, and writes nothing.
template <typename G, typename O, typename M, typename V, bool R, int kUnroll, bool kStaged>
__device__ __forceinline__ void update_range(const Params& P, const float4* rec, const void* grad, bool vec_ok,
                                             int64_t lo, int64_t hi) {
  const float4 ra = __ldg(rec), rb = __ldg(rec + 1), rd = __ldg(rec + 2);
  const SegmentScalars s{ra.x, ra.y, ra.z, ra.w, rb.x, rb.y, rb.z, rb.w, rd.x};
  const bool skip = rd.y != 0.0f;
  using PT = std::conditional_t<R, int16_t, float>;  // the master's storage
  static_assert(!R || std::is_same_v<O, __nv_bfloat16>, "remainders live under a bf16 model_out");
  const bool adam_w = P.adam_w;
  const G* __restrict__ g = static_cast<const G*>(grad);
  PT* __restrict__ p = static_cast<PT*>(P.master);
  M* __restrict__ m = static_cast<M*>(P.exp_avg);
  V* __restrict__ v = static_cast<V*>(P.exp_avg_sq);
  O* __restrict__ o = static_cast<O*>(P.model_out);

  // Vector body [vlo, vhi): starts on a multiple of kVec elements, so 16-byte aligned in every
  // array given aligned bases (checked on the host; otherwise all scalar). Head and tail of an
  // unaligned or odd-length segment go through the scalar path below.
  int64_t vlo = hi, vhi = hi;
  if (vec_ok) {
    const int64_t up = (lo + kVec - 1) / kVec * kVec;
    vlo = up < hi ? up : hi;
    vhi = vlo + (hi - vlo) / kVec * kVec;
  }
  constexpr int64_t kStep = int64_t(kThreads) * kVec;
  if constexpr (kStaged) {
    // Loads staged in shared memory: [kUnroll * W][kThreads] 16-byte slots; thread t copies its
    // own words into slots (k, t) and reads them back after waiting on its own copies.
    constexpr int W = kStepWords<G, M, V, R>;
    extern __shared__ uint4 stage[];
    for (int64_t base = vlo + threadIdx.x * kVec; base < vhi; base += kUnroll * kStep) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kStep;
        uint4* sl = stage + u * W * kThreads + threadIdx.x;
        if (i < vhi) {
          stage8(sl, kThreads, g + i);
          sl += kWords<G> * kThreads;
          if constexpr (R) {
            cp_async16(sl, o + i);
            cp_async16(sl + kThreads, p + i);
          } else {
            stage8(sl, kThreads, p + i);
          }
          sl += 2 * kThreads;
          stage8(sl, kThreads, m + i);
          sl += kWords<M> * kThreads;
          stage8(sl, kThreads, v + i);
        }
      }
      cp_async_wait_all();
      if (skip) return;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kStep;
        if (i < vhi) {
          const uint4* sl = stage + u * W * kThreads + threadIdx.x;
          float rg[kVec], rp[kVec], rm[kVec], rv[kVec];
          unstage8<G>(sl, kThreads, rg);
          sl += kWords<G> * kThreads;
          if constexpr (R) {
            join8(sl[0], sl[kThreads], rp);
          } else {
            unstage8<float>(sl, kThreads, rp);
          }
          sl += 2 * kThreads;
          unstage8<M>(sl, kThreads, rm);
          sl += kWords<M> * kThreads;
          unstage8<V>(sl, kThreads, rv);
#pragma unroll
          for (int k = 0; k < kVec; ++k) adam_scalar(rg[k], rp[k], rm[k], rv[k], s, adam_w);
          store8(m + i, rm);
          store8(v + i, rv);
          if constexpr (R) {
            store8_split(o + i, p + i, rp);
          } else {
            store8(p + i, rp);
            if constexpr (!std::is_void_v<O>) store8(o + i, rp);
          }
        }
      }
    }
  }
  for (int64_t base = vlo + threadIdx.x * kVec; !kStaged && base < vhi; base += kUnroll * kStep) {
    float rg[kUnroll][kVec], rp[kUnroll][kVec], rm[kUnroll][kVec], rv[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStep;
      if (i < vhi) {
        load8(g + i, rg[u]);
        if constexpr (R) {
          load8_joined(o + i, p + i, rp[u]);
        } else {
          load8(p + i, rp[u]);
        }
        load8(m + i, rm[u]);
        load8(v + i, rv[u]);
      }
    }
    if (skip) return;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kStep;
      if (i < vhi) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) adam_scalar(rg[u][k], rp[u][k], rm[u][k], rv[u][k], s, adam_w);
        store8(m + i, rm[u]);
        store8(v + i, rv[u]);
        if constexpr (R) {
          store8_split(o + i, p + i, rp[u]);
        } else {
          store8(p + i, rp[u]);
          if constexpr (!std::is_void_v<O>) store8(o + i, rp[u]);
        }
      }
    }
  }
  auto scalar = [&](int64_t i) {
    float pi, mi = to_float(m[i]), vi = to_float(v[i]);
    if constexpr (R) {
      pi = join_remainder(reinterpret_cast<const uint16_t*>(o)[i], p[i]);
    } else {
      pi = p[i];
    }
    adam_scalar(to_float(g[i]), pi, mi, vi, s, adam_w);
    m[i] = from_float<M>(mi);
    v[i] = from_float<V>(vi);
    if constexpr (R) {
      split_remainder(pi, reinterpret_cast<uint16_t*>(o)[i], p[i]);
    } else {
      p[i] = pi;
      if constexpr (!std::is_void_v<O>) o[i] = from_float<O>(pi);
    }
  };
  if (skip) return;
  for (int64_t i = lo + threadIdx.x; i < vlo; i += kThreads) scalar(i);
  for (int64_t i = vhi + threadIdx.x; i < hi; i += kThreads) scalar(i);
}

__global__ void prepare_kernel(const PrepareArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < a.count) prepare_segment(a, i);
}

// One block per chunk; the hardware hands a new chunk to each block slot as one finishes.
template <typename G, typename O, typename M, typename V, bool R, int U, int B, bool S>
__global__ void __launch_bounds__(kThreads, B) adam_kernel(const Params P) {
  const longlong2 row = __ldg(reinterpret_cast<const longlong2*>(P.chunks) + blockIdx.x);
  const int64_t seg = chunk_segment(row.y);
  const float4* rec = reinterpret_cast<const float4*>(P.prep.records) + 3 * seg;
  const void* grad = P.grad;
  bool vec_ok = P.vec_ok;
  if (P.held) {
    grad = P.bases[seg];
    if (grad == nullptr) return;  // no grad: untouched, so skipped (nothing to read)
    vec_ok = vec_ok && reinterpret_cast<uintptr_t>(grad) % 16 == 0;
  }
  update_range<G, O, M, V, R, U, S>(P, rec, grad, vec_ok, row.x, row.x + chunk_length(row.y));
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename G, typename O, typename M, typename V, bool R, typename S>
void launch_shape(const Params& P, int64_t nchunks) {
  const auto kernel = adam_kernel<G, O, M, V, R, S::unroll, S::min_blocks, S::staged>;
  constexpr int smem = S::staged ? S::unroll * kStepWords<G, M, V, R> * kThreads * 16 : 0;
  if constexpr (smem > 48 * 1024) {  // above the default limit: raised once per device
    static std::atomic<uint64_t> raised{0};
    const int dev = c10::cuda::current_device();
    const uint64_t bit = uint64_t(1) << (dev & 63);
    if (!(raised.load() & bit)) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      raised.fetch_or(bit);
    }
  }
  kernel<<<static_cast<unsigned int>(nchunks), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

using bf16 = __nv_bfloat16;

// The shape of each kind (csrc/NOTES.md says why; docs/performance.md has the measurements,
// benchmarks/tune_step.py takes them):
// * remainders with bf16 moments and 16-bit grads (every array 16-bit): loads staged through
//   shared memory, 2 steps per thread, 4 blocks per SM (<= 64 registers): staging frees the
//   registers that bytes in flight would hold, and it pays only when no array is fp32;
// * remainders with fp32 moments and 16-bit grads: registers, 2 steps, 3 blocks per SM (<= 80
//   registers, no spills; fp32 grads would spill);
// * fp32 master with two bf16 moments (any grad and model_out dtype): 1 step per thread, 4 blocks
//   per SM (<= 64 registers, no spills): twice the warps of 2x1 hide the update's arithmetic
//   behind the loads (at 128 registers, 2x1 left most issue cycles with no eligible warp, half of
//   its stalls on loads);
// * the rest: 2 steps in registers, no bound (fp32 states: ~95% of the 28-byte floor).
// optim/kernels/dispatch.py picks each kind's chunk size to match (kernels.light_state).
template <typename G, typename M, typename V, bool R>
using KindShape = std::conditional_t<
    R && sizeof(G) == 2 && std::is_same_v<M, bf16> && std::is_same_v<V, bf16>, Shape<2, 4, true>,
    std::conditional_t<R && sizeof(G) == 2 && std::is_same_v<M, float> && std::is_same_v<V, float>, Shape<2, 3>,
                       std::conditional_t<!R && std::is_same_v<M, bf16> && std::is_same_v<V, bf16>, Shape<1, 4>,
                                          DefaultShape>>>;

// Tuning: SHARDAMP_CUDA_STEP (read once by optim/kernels/dispatch.py, passed in as `shape`) picks
// another shape for the kinds the benchmark measures: 1 "2x1", 2 "2x3", 4 "1x4" (registers, U
// steps x B blocks), 3 "c2x4" (staged); 0 or anything else: the kind's own. ("1x3" was timed
// too: slower than the default for every kind, NOTES.)
// The kinds the knob reaches (benchmarks/tune_step.py times them): bench_step.py's light-state
// kinds, and fp32 params with bf16 grads and bf16 moments. (fp32 and bf16 params with fp32
// states were timed under every shape too: the default was the fastest, NOTES.)
template <typename G, typename O, typename M, typename V, bool R>
constexpr bool kTuned = std::is_same_v<M, V> && (
    (std::is_same_v<G, float> && std::is_void_v<O> && std::is_same_v<M, bf16> && !R) ||  // fp32 + bf16 moments
    (std::is_same_v<G, bf16> && std::is_same_v<O, bf16> && (R || std::is_same_v<M, bf16>)) ||  // bf16 params
    (std::is_same_v<G, bf16> && std::is_void_v<O> && std::is_same_v<M, bf16> && !R));  // bf16 grads only

template <typename G, typename O, typename M, typename V, bool R>
void launch(const Params& P, int64_t nchunks, int64_t shape) {
  if constexpr (kTuned<G, O, M, V, R>) {
    switch (shape) {
      case 1: return launch_shape<G, O, M, V, R, Shape<2, 1>>(P, nchunks);
      case 2: return launch_shape<G, O, M, V, R, Shape<2, 3>>(P, nchunks);
      case 3: return launch_shape<G, O, M, V, R, Shape<2, 4, true>>(P, nchunks);
      case 4: return launch_shape<G, O, M, V, R, Shape<1, 4>>(P, nchunks);
      default: break;
    }
  }
  launch_shape<G, O, M, V, R, KindShape<G, M, V, R>>(P, nchunks);
}

// The scalar inputs of prepare_kernel (the records: run_prepare's).
PrepareArgs scalar_inputs(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                          const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                          bool bias_correction) {
  PrepareArgs a;
  a.segments = segments.data_ptr<int64_t>();
  a.count = segments.size(0);
  a.hparams = hparams.data_ptr<double>();
  a.steps = steps.data_ptr();
  a.touched = touched.data_ptr();
  a.grad_coef = grad_coef.data_ptr();
  a.found_inf = found_inf.data_ptr();
  a.steps_code = scalar_code(steps);
  a.touched_code = scalar_code(touched);
  a.coef_code = scalar_code(grad_coef);
  a.found_code = scalar_code(found_inf);
  a.bias_correction = bias_correction;
  return a;
}

// The records of `a`'s segments formed into `out` (the caller's: a persistent buffer reused every
// step, stream-ordered as the state it steps), or else into a scratch tensor from the caching
// allocator (the graph's private pool under capture); returned, with a.records pointed at them.
at::Tensor run_prepare(PrepareArgs& a, const at::Tensor& like, const c10::optional<at::Tensor>& out) {
  at::Tensor records = out ? *out : at::empty({a.count * kRecordFloats}, like.options().dtype(at::kFloat));
  a.records = reinterpret_cast<SegmentRecord*>(records.data_ptr<float>());
  if (a.count == 0) return records;
  constexpr int kPrepThreads = 128;
  prepare_kernel<<<static_cast<unsigned int>((a.count + kPrepThreads - 1) / kPrepThreads), kPrepThreads, 0,
                   c10::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return records;
}

}  // namespace

at::Tensor adam_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                        const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                        bool bias_correction, const c10::optional<at::Tensor>& out) {
  const c10::cuda::CUDAGuard guard(segments.device());
  PrepareArgs a = scalar_inputs(segments, hparams, steps, touched, grad_coef, found_inf, bias_correction);
  return run_prepare(a, segments, out);
}

PrepareArgs prepare_args(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                         const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                         bool bias_correction, at::Tensor& records) {
  PrepareArgs a = scalar_inputs(segments, hparams, steps, touched, grad_coef, found_inf, bias_correction);
  a.records = reinterpret_cast<SegmentRecord*>(records.data_ptr<float>());
  return a;
}

void adam_step(const AdamArgs& a, const at::Tensor& chunks, const c10::optional<at::Tensor>& records,
               int64_t record_offset, int64_t shape) {
  const int64_t nchunks = chunks.size(0);
  if (nchunks == 0) return;
  SHARDAMP_CHECK(nchunks < (int64_t(1) << 31), "adam_step: too many chunks for one launch");
  SHARDAMP_CHECK(aligned16(chunks.data_ptr()),
                 "adam_step: the chunk table must be 16-byte aligned (pass build_chunks' result as is)");
  const c10::cuda::CUDAGuard guard(a.grad.device());
  Params P{};
  P.grad = a.grad.data_ptr();
  P.master = a.master.data_ptr();
  P.exp_avg = a.exp_avg.data_ptr();
  P.exp_avg_sq = a.exp_avg_sq.data_ptr();
  P.model_out = a.model_out ? a.model_out->data_ptr() : nullptr;
  P.chunks = chunks.data_ptr<int64_t>();
  P.prep = scalar_inputs(a.segments, a.hparams, a.steps, a.touched, a.grad_coef, a.found_inf, a.bias_correction);
  P.adam_w = a.adam_w_mode;
  P.held = a.bases != nullptr;
  if (P.held) {
    SHARDAMP_CHECK(static_cast<int64_t>(a.bases->size()) == a.segments.size(0) &&
                       a.segments.size(0) <= kHeldSegments,
                   "adam_step: grads read in place need one address per segment (at most ", kHeldSegments, ")");
    std::copy(a.bases->begin(), a.bases->end(), P.bases);
  }
  // held grads: each segment's own address is checked in the kernel
  P.vec_ok = (P.held || aligned16(P.grad)) && aligned16(P.master) && aligned16(P.exp_avg) && aligned16(P.exp_avg_sq) &&
             (P.model_out == nullptr || aligned16(P.model_out));
  at::Tensor own;  // without `records` (one shard alone): this shard's own prepare launch
  if (records) {
    P.prep.records = reinterpret_cast<SegmentRecord*>(records->data_ptr<float>()) + record_offset;
  } else {
    own = run_prepare(P.prep, a.grad, c10::nullopt);
  }
  dispatch_step<__nv_bfloat16, __half>(a.grad, a.master, a.exp_avg, a.exp_avg_sq, a.model_out,
                                       [&](auto g, auto o, auto m, auto v, auto r) {
    launch<typename decltype(g)::type, typename decltype(o)::type, typename decltype(m)::type,
           typename decltype(v)::type, decltype(r)::value>(P, nchunks, shape);
  });
}

}  // namespace cuda
}  // namespace shardamp
