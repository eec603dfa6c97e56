// grad_stats on CUDA: one read pass over a flat grad shard accumulating sum |g|^p (or max |g|)
// and a non-finite flag into out[2] (contract: optim/kernels/reference.py).
//
// Deterministic by construction: each block reduces its grid-stride slice in a fixed order,
// writes one partial, and the last block to finish (ticket counter) folds the partials in index
// order and resets the counter, so the next call (or a CUDA-graph replay) finds it at zero. The
// partials live in a scratch buffer allocated once per (device, stream) and cached.

#include "../common.h"
#include "../grad_parts.h"
#include "device_info.cuh"
#include "vec.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace shardamp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // partials per call; also the folding loop's trip count bound
constexpr int kUnroll = 4;        // independent 16-byte loads in flight per thread

enum class Norm { kTwo, kOne, kGeneric, kMax };

template <Norm N>
__device__ __forceinline__ float combine(float acc, float x, float p) {
  if constexpr (N == Norm::kTwo) return fmaf(x, x, acc);
  if constexpr (N == Norm::kOne) return acc + fabsf(x);
  if constexpr (N == Norm::kGeneric) return acc + powf(fabsf(x), p);
  return nan_max(acc, fabsf(x));
}

template <Norm N>
__device__ __forceinline__ float merge(float a, float b) {
  return N == Norm::kMax ? nan_max(a, b) : a + b;
}

// Fixed-order block reduction of (acc, bad); the result is valid in thread 0.
template <Norm N>
__device__ __forceinline__ float2 block_reduce(float acc, float bad) {
  __shared__ float2 warp_part[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    acc = merge<N>(acc, __shfl_down_sync(0xffffffffu, acc, off));
    bad += __shfl_down_sync(0xffffffffu, bad, off);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_part[warp] = make_float2(acc, bad);
  __syncthreads();
  float2 r = make_float2(0.f, 0.f);
  if (threadIdx.x == 0) {
    r = warp_part[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      r.x = merge<N>(r.x, warp_part[w].x);
      r.y += warp_part[w].y;
    }
  }
  __syncthreads();  // warp_part is reused by a second call in the last block
  return r;
}

// Where bucket_stats flags the params holding inf/NaN (nonfinite_flags' rows, sorted by start);
// unused (all null) for grad_stats.
struct FlagRows {
  const int64_t* rows;
  int64_t n_rows;
  float* flags;
  int64_t any_index;
};

// A block's (acc, bad) into its partial; the last block to finish folds every partial in index
// order into out (assigned or added) and resets the ticket counter.
template <Norm N>
__device__ __forceinline__ void finish(float acc, float bad, float2* __restrict__ partials,
                                       unsigned int* __restrict__ counter, float* __restrict__ out, bool assign) {
  const float2 part = block_reduce<N>(acc, bad);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = part;
    __threadfence();  // publish the partial before taking a ticket
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  float a = 0.f, b = 0.f;
  for (int k = threadIdx.x; k < static_cast<int>(gridDim.x); k += kThreads) {
    const float2 q = __ldcg(partials + k);  // L2: other blocks' writes, not a stale L1 line
    a = merge<N>(a, q.x);
    b += q.y;
  }
  const float2 total = block_reduce<N>(a, b);
  if (threadIdx.x == 0) {
    // assign: the first of a round's accumulations (out's old values are not read: no zeroing launch)
    const float before = assign ? 0.f : out[0];
    out[0] = N == Norm::kMax ? nan_max(before, total.x) : before + total.x;
    if (total.y != 0.f) {
      out[1] = assign ? 1.f : fmaxf(out[1], 1.f);  // NaN != 0 as well
    } else if (assign) {
      out[1] = 0.f;
    }
    *counter = 0u;
  }
}

template <typename T, Norm N, bool Flags>
__global__ void __launch_bounds__(kThreads)
stats_kernel(const T* __restrict__ g, int64_t n, float p, bool vec_ok, float2* __restrict__ partials,
             unsigned int* __restrict__ counter, float* __restrict__ out, FlagRows flag_rows, bool assign) {
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte load
  using Lane = float[V];
  float acc = 0.f;
  // x - x is 0 for finite x and NaN for inf/NaN; the running sum stays NaN once it is.
  float bad = 0.f;
  auto take = [&](float x, int64_t j) {
    acc = combine<N>(acc, x, p);
    const float d = x - x;
    bad += d;
    if constexpr (Flags) {
      if (d != 0.f) {  // inf/NaN (NaN != 0 too), rare: find the param (as nonfinite_flags_kernel; same benign races)
        flag_nonfinite(x, j, flag_rows.rows, flag_rows.n_rows, flag_rows.flags, flag_rows.any_index);
      }
    }
  };

  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t nvec = vec_ok ? n / V : 0;
  const uint4* gv = reinterpret_cast<const uint4*>(g);
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = __ldcs(gv + i + u * stride);  // streamed: read once
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      Lane f;
      unpack(r[u], g, f);
#pragma unroll
      for (int k = 0; k < V; ++k) take(f[k], (i + u * stride) * V + k);
    }
  }
  for (; i < nvec; i += stride) {
    Lane f;
    unpack(__ldcs(gv + i), g, f);
#pragma unroll
    for (int k = 0; k < V; ++k) take(f[k], i * V + k);
  }
  for (int64_t j = nvec * V + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < n; j += stride) {
    take(to_float(g[j]), j);
  }

  finish<N>(acc, bad, partials, counter, out, assign);
}

// bucket_stats over grads where autograd left them (bucket_stats_parts): part k holds elements
// [start[k], start[k] + len[k]) of the flat shard at data[k] (sorted by start, disjoint); an
// element no part holds reads as zero, as a landed shard's gaps. The threads walk the flat index
// space exactly as stats_kernel walks a landed shard (16-byte aligned: vec_ok), so every element
// meets the same thread in the same order and the sums are bitwise the same.
struct PartTable {
  const void* data[kHeldSegments];
  int64_t start[kHeldSegments];
  int64_t len[kHeldSegments];
  int count;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
stats_parts_kernel(const PartTable t, int64_t n, float2* __restrict__ partials, unsigned int* __restrict__ counter,
                   float* __restrict__ out, FlagRows flag_rows, bool assign) {
  constexpr int V = 16 / sizeof(T);
  using Lane = float[V];
  float acc = 0.f, bad = 0.f;
  auto take = [&](float x, int64_t j) {
    acc = combine<Norm::kTwo>(acc, x, 2.f);
    const float d = x - x;
    bad += d;
    if (d != 0.f) flag_nonfinite(x, j, flag_rows.rows, flag_rows.n_rows, flag_rows.flags, flag_rows.any_index);
  };
  int c = 0;  // the part at or after this thread's element: its elements only move forward
  auto seek = [&](int64_t j) {
    while (c < t.count && t.start[c] + t.len[c] <= j) ++c;
  };
  auto element = [&](int64_t j) -> float {
    seek(j);
    return c < t.count && t.start[c] <= j ? to_float(static_cast<const T*>(t.data[c])[j - t.start[c]]) : 0.f;
  };
  auto load = [&](int64_t i, Lane& f) {  // the 16 bytes of vector i, as stats_kernel's unpack reads them
    const int64_t j = i * V;
    seek(j);
    if (c < t.count && t.start[c] <= j && j + V <= t.start[c] + t.len[c]) {
      const T* src = static_cast<const T*>(t.data[c]) + (j - t.start[c]);
      if (reinterpret_cast<uintptr_t>(src) % 16 == 0) {
        unpack(__ldcs(reinterpret_cast<const uint4*>(src)), src, f);
        return;
      }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = element(j + k);
  };

  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t nvec = n / V;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
    Lane f[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load(i + u * stride, f[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k) take(f[u][k], (i + u * stride) * V + k);
    }
  }
  for (; i < nvec; i += stride) {
    Lane f;
    load(i, f);
#pragma unroll
    for (int k = 0; k < V; ++k) take(f[k], i * V + k);
  }
  for (int64_t j = nvec * V + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < n; j += stride) {
    take(element(j), j);
  }
  finish<Norm::kTwo>(acc, bad, partials, counter, out, assign);
}

// The blocks of a stats pass over n elements of T (stats_kernel, stats_parts_kernel alike).
template <typename T>
int stats_blocks(int64_t n, int device) {
  constexpr int V = 16 / sizeof(T);
  const int sms = multiprocessors(device);
  const int64_t want = (n / V + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, int64_t(4) * sms, kMaxBlocks})));
}

// One scratch buffer per (device, stream): kMaxBlocks float2 partials, then the ticket counter.
// Keyed by stream so that stats computed concurrently on two streams never share a counter.
at::Tensor scratch_for(const at::Tensor& like, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, at::Tensor> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(static_cast<int>(like.get_device()), stream);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  at::Tensor buf = at::zeros({2 * kMaxBlocks + 1}, like.options().dtype(at::kFloat));
  cache.emplace(key, buf);
  return buf;
}

template <typename T, Norm N, bool Flags = false>
void launch(const at::Tensor& grad, at::Tensor& out, float p, FlagRows flag_rows = {nullptr, 0, nullptr, 0},
            bool assign = false) {
  const int64_t n = grad.numel();
  const T* g = reinterpret_cast<const T*>(grad.data_ptr());
  const bool vec_ok = reinterpret_cast<uintptr_t>(g) % 16 == 0;
  const int blocks = stats_blocks<T>(n, grad.get_device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor buf = scratch_for(grad, stream);
  float* base = buf.data_ptr<float>();
  stats_kernel<T, N, Flags><<<blocks, kThreads, 0, stream>>>(
      g, n, p, vec_ok, reinterpret_cast<float2*>(base), reinterpret_cast<unsigned int*>(base + 2 * kMaxBlocks),
      out.data_ptr<float>(), flag_rows, assign);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_norm(const at::Tensor& grad, at::Tensor& out, double norm_type) {
  if (std::isinf(norm_type)) return launch<T, Norm::kMax>(grad, out, 0.f);
  if (norm_type == 2.0) return launch<T, Norm::kTwo>(grad, out, 2.f);
  if (norm_type == 1.0) return launch<T, Norm::kOne>(grad, out, 1.f);
  launch<T, Norm::kGeneric>(grad, out, static_cast<float>(norm_type));
}

// ---------------------------------------------------------------------------------------------
// group_partials: each param group's partial of a shard, deterministic in two launches. One block
// per chunk of the shard's chunk map (a chunk lies in one segment, so in one group) writes its
// chunk's partial; then one block per group folds its chunks' partials in a fixed order.

// Grads held where autograd left them (group_partials_held): segment s's elements read from
// base[s] as from the shard (segment_bases; null: no grad there, a landed shard's zeros).
struct SegmentBases {
  const void* base[kHeldSegments];
  bool held;
};

template <typename T, Norm N>
__global__ void __launch_bounds__(kThreads)
chunk_partials_kernel(const T* __restrict__ shard, const int64_t* __restrict__ chunks, float p,
                      float* __restrict__ part, const SegmentBases bases) {
  const int64_t c = blockIdx.x;
  const int64_t first = chunks[2 * c];
  const int64_t len = chunk_length(chunks[2 * c + 1]);
  const T* g = bases.held ? static_cast<const T*>(bases.base[chunk_segment(chunks[2 * c + 1])]) : shard;
  float acc = 0.f;  // no grad: every element 0, whose terms are 0 for every norm
  for (int64_t j = threadIdx.x; g != nullptr && j < len; j += kThreads) acc = combine<N>(acc, to_float(g[first + j]), p);
  const float2 r = block_reduce<N>(acc, 0.f);
  if (threadIdx.x == 0) part[c] = r.x;
}

template <Norm N>
__global__ void __launch_bounds__(kThreads)
fold_groups_kernel(const float* __restrict__ part, const int64_t* __restrict__ chunks, int64_t n_chunks,
                   const int64_t* __restrict__ segments, float* __restrict__ out) {
  const int64_t group = blockIdx.x;
  float acc = 0.f;
  for (int64_t c = threadIdx.x; c < n_chunks; c += kThreads) {
    if (segments[4 * chunk_segment(chunks[2 * c + 1]) + 3] == group) acc = merge<N>(acc, part[c]);
  }
  const float2 r = block_reduce<N>(acc, 0.f);
  if (threadIdx.x == 0) out[group] = merge<N>(out[group], r.x);
}

template <typename T, Norm N>
void launch_groups(const at::Tensor& grad, const at::Tensor& segments, at::Tensor& out, float p,
                   const at::Tensor& chunks, const SegmentBases& bases) {
  const int64_t n_chunks = chunks.size(0);
  if (n_chunks == 0 || out.numel() == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor part = at::empty({n_chunks}, out.options());
  chunk_partials_kernel<T, N><<<static_cast<unsigned int>(n_chunks), kThreads, 0, stream>>>(
      bases.held ? nullptr : reinterpret_cast<const T*>(grad.data_ptr()), chunks.data_ptr<int64_t>(), p,
      part.data_ptr<float>(), bases);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  fold_groups_kernel<N><<<static_cast<unsigned int>(out.numel()), kThreads, 0, stream>>>(
      part.data_ptr<float>(), chunks.data_ptr<int64_t>(), n_chunks, segments.data_ptr<int64_t>(),
      out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_groups(const at::Tensor& grad, const at::Tensor& segments, at::Tensor& out, double norm_type,
                     const at::Tensor& chunks, const SegmentBases& bases) {
  if (std::isinf(norm_type)) return launch_groups<T, Norm::kMax>(grad, segments, out, 0.f, chunks, bases);
  if (norm_type == 2.0) return launch_groups<T, Norm::kTwo>(grad, segments, out, 2.f, chunks, bases);
  if (norm_type == 1.0) return launch_groups<T, Norm::kOne>(grad, segments, out, 1.f, chunks, bases);
  launch_groups<T, Norm::kGeneric>(grad, segments, out, static_cast<float>(norm_type), chunks, bases);
}

// group_partials' launches over `grad` (a shard) or, where bases.held, over the held grads
void groups_of(const at::Tensor& grad, at::ScalarType dtype, const at::Tensor& segments, at::Tensor& out,
               double norm_type, const at::Tensor& chunks, const SegmentBases& bases) {
  switch (dtype) {
    case at::kFloat: return dispatch_groups<float>(grad, segments, out, norm_type, chunks, bases);
    case at::kBFloat16: return dispatch_groups<__nv_bfloat16>(grad, segments, out, norm_type, chunks, bases);
    case at::kHalf: return dispatch_groups<__half>(grad, segments, out, norm_type, chunks, bases);
    default: SHARDAMP_CHECK(false, "group_partials: unsupported grad dtype ", dtype);
  }
}

// ---------------------------------------------------------------------------------------------
// nonfinite_flags: a grid-stride pass over the buffer; an element that is inf or NaN (x - x is
// NaN exactly then) finds its row by binary search (rows sorted by start) and sets its flag and
// the "any" flag. Every writer stores the same 1.0, so the races are benign; no atomics.

template <typename T>
__global__ void __launch_bounds__(kThreads)
nonfinite_flags_kernel(const T* __restrict__ x, int64_t n, const int64_t* __restrict__ rows, int64_t n_rows,
                       float* __restrict__ flags, int64_t any_index) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    flag_nonfinite(to_float(x[i]), i, rows, n_rows, flags, any_index);
  }
}

template <typename T>
void launch_flags(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags) {
  const int64_t n = full.numel();
  const int sms = multiprocessors(full.get_device());
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads,
                                                                          int64_t(8) * sms)));
  nonfinite_flags_kernel<T><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(full.data_ptr()), n, rows.data_ptr<int64_t>(), rows.size(0),
      flags.data_ptr<float>(), flags.numel() - 1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void grad_stats(const at::Tensor& grad, at::Tensor& out, double norm_type) {
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  switch (grad.scalar_type()) {
    case at::kFloat: return dispatch_norm<float>(grad, out, norm_type);
    case at::kBFloat16: return dispatch_norm<__nv_bfloat16>(grad, out, norm_type);
    case at::kHalf: return dispatch_norm<__half>(grad, out, norm_type);
    default: SHARDAMP_CHECK(false, "grad_stats: unsupported grad dtype ", grad.scalar_type());
  }
}

void group_partials(const at::Tensor& grad, const at::Tensor& segments, at::Tensor& out, double norm_type,
                    const at::Tensor& chunks) {
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  groups_of(grad, grad.scalar_type(), segments, out, norm_type, chunks, SegmentBases{});
}

void group_partials_bases(const std::vector<const void*>& bases, at::ScalarType dtype, const at::Tensor& segments,
                          at::Tensor& out, double norm_type, const at::Tensor& chunks) {
  SHARDAMP_CHECK(static_cast<int64_t>(bases.size()) == segments.size(0) && segments.size(0) <= kHeldSegments,
                 "group_partials_parts: one grad address per segment, at most ", kHeldSegments);
  const c10::cuda::CUDAGuard guard(out.device());
  SegmentBases b{};
  b.held = true;
  std::copy(bases.begin(), bases.end(), b.base);
  groups_of(out, dtype, segments, out, norm_type, chunks, b);
}

void nonfinite_flags(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags) {
  if (full.numel() == 0 || rows.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(full.device());
  switch (full.scalar_type()) {
    case at::kFloat: return launch_flags<float>(full, rows, flags);
    case at::kBFloat16: return launch_flags<__nv_bfloat16>(full, rows, flags);
    case at::kHalf: return launch_flags<__half>(full, rows, flags);
    default: SHARDAMP_CHECK(false, "nonfinite_flags: unsupported dtype ", full.scalar_type());
  }
}

// bucket_stats: a landed bucket's L2 partial (into out, assigned or added) and its params' non-finite
// flags (as nonfinite_flags) in one read pass and one launch: grad_stats' kernel, summing in the
// same order (so the same result), with the flag writes for the rare inf/NaN element.
template <typename T>
void launch_bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags, at::Tensor& out,
                         bool assign) {
  const FlagRows flag_rows{rows.data_ptr<int64_t>(), rows.size(0), flags.data_ptr<float>(), flags.numel() - 1};
  launch<T, Norm::kTwo, true>(full, out, 2.f, flag_rows, assign);
}

void bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags, at::Tensor& out, bool assign) {
  const c10::cuda::CUDAGuard guard(full.device());
  if (full.numel() == 0) {
    if (assign) out.zero_();
    return;
  }
  switch (full.scalar_type()) {
    case at::kFloat: return launch_bucket_stats<float>(full, rows, flags, out, assign);
    case at::kBFloat16: return launch_bucket_stats<__nv_bfloat16>(full, rows, flags, out, assign);
    case at::kHalf: return launch_bucket_stats<__half>(full, rows, flags, out, assign);
    default: SHARDAMP_CHECK(false, "bucket_stats: unsupported dtype ", full.scalar_type());
  }
}

namespace {

template <typename T>
void launch_bucket_stats_parts(const PartTable& table, int64_t n, const at::Tensor& rows, at::Tensor& flags,
                               at::Tensor& out, bool assign) {
  const FlagRows flag_rows{rows.data_ptr<int64_t>(), rows.size(0), flags.data_ptr<float>(), flags.numel() - 1};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor buf = scratch_for(out, stream);
  float* base = buf.data_ptr<float>();
  stats_parts_kernel<T><<<stats_blocks<T>(n, out.get_device()), kThreads, 0, stream>>>(
      table, n, reinterpret_cast<float2*>(base), reinterpret_cast<unsigned int*>(base + 2 * kMaxBlocks),
      out.data_ptr<float>(), flag_rows, assign);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool bucket_stats_parts(const std::vector<GradPart>& parts, at::ScalarType dtype, int64_t n, const at::Tensor& rows,
                        at::Tensor& flags, at::Tensor& out, bool assign) {
  if (static_cast<int64_t>(parts.size()) > kHeldSegments) return false;
  const c10::cuda::CUDAGuard guard(out.device());
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return false;
  if (n == 0) {
    if (assign) out.zero_();
    return true;
  }
  PartTable table{};
  table.count = static_cast<int>(parts.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    table.data[k] = parts[k].data;
    table.start[k] = parts[k].start;
    table.len[k] = parts[k].len;
  }
  switch (dtype) {
    case at::kFloat: launch_bucket_stats_parts<float>(table, n, rows, flags, out, assign); break;
    case at::kBFloat16: launch_bucket_stats_parts<__nv_bfloat16>(table, n, rows, flags, out, assign); break;
    case at::kHalf: launch_bucket_stats_parts<__half>(table, n, rows, flags, out, assign); break;
    default: SHARDAMP_CHECK(false, "bucket_stats_parts: unsupported dtype ", dtype);
  }
  return true;
}

}  // namespace cuda
}  // namespace shardamp
