// The byte ranges of land_grads (land_grads.h) on CUDA: each grad that has its param's strides
// and the buffer's dtype is one contiguous byte range, copied into its slot of the flat buffer by
// one batched kernel launch per kBatch (112) grads, whatever their sizes. It replaces, for those grads,
// an as_strided view and a multi-tensor copy entry each (host work per param is a few pointer
// reads), and a cudaMemcpyAsync per large grad (~16 us of host time each on an H200 host, against
// ~10 us for a whole launch). A range without a source is zeroed (the gaps of a buffer allocated
// uninitialized). Capturable (no host sync, no allocation).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common.h"
#include "../land_grads.h"
#include "device_info.cuh"

namespace shardamp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 112;  // 112 x 32 B of kernel arguments: inside the portable 4 KiB
constexpr int kUnroll = 4;  // 16-byte vectors a thread loads before it stores
// The unit of work: a block copies one chunk, then takes the grid's next. Equal chunks spread a
// batch of one 9 MiB grad and forty 64 KiB ones over every SM alike, and keep 16 KiB a block in
// flight, which is what a copy needs to reach the memory bandwidth.
constexpr int64_t kChunk = int64_t{64} << 10;
constexpr int kBlocksPerSM = 8;

struct Batch {
  const char* src[kBatch];
  char* dst[kBatch];
  int64_t bytes[kBatch];
  int64_t first_chunk[kBatch + 1];  // prefix sums of the ranges' chunk counts
  int count;
};

template <typename V>
__device__ __forceinline__ void zero_span(char* dst, int64_t n) {
  const int64_t items = n / static_cast<int64_t>(sizeof(V));
  V* d = reinterpret_cast<V*>(dst);
  const V zero{};
  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) d[i] = zero;
  for (int64_t b = items * static_cast<int64_t>(sizeof(V)) + threadIdx.x; b < n; b += blockDim.x) dst[b] = 0;
}

template <typename V>
__device__ __forceinline__ void copy_span(const char* src, char* dst, int64_t n) {
  const int64_t items = n / static_cast<int64_t>(sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * blockDim.x < items; i += step) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * blockDim.x] = v[u];
  }
  for (; i < items; i += blockDim.x) d[i] = s[i];
  for (int64_t b = items * static_cast<int64_t>(sizeof(V)) + threadIdx.x; b < n; b += blockDim.x) dst[b] = src[b];
}

__global__ void batched_copy_kernel(Batch batch) {
  const int64_t total = batch.first_chunk[batch.count];
  int g = 0;
  // a block's chunks only grow, so its range index only moves forward
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    while (batch.first_chunk[g + 1] <= c) ++g;
    const int64_t offset = (c - batch.first_chunk[g]) * kChunk;
    const int64_t left = batch.bytes[g] - offset;
    const int64_t n = left < kChunk ? left : kChunk;
    char* dst = batch.dst[g] + offset;
    if (batch.src[g] == nullptr) {  // a gap of a buffer allocated uninitialized (land_grads' zero_rest)
      if (reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
        zero_span<int4>(dst, n);
      } else {
        zero_span<char>(dst, n);
      }
      continue;
    }
    const char* src = batch.src[g] + offset;
    const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
    if (align % 16 == 0) {
      copy_span<int4>(src, dst, n);
    } else if (align % 4 == 0) {
      copy_span<int32_t>(src, dst, n);
    } else {
      copy_span<char>(src, dst, n);
    }
  }
}

}  // namespace

void batched_copy(const std::vector<CopyRange>& ranges, const at::Device& device) {
  if (ranges.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int sms = multiprocessors(device.index());
  for (size_t start = 0; start < ranges.size(); start += kBatch) {
    Batch batch;
    const int count = static_cast<int>(std::min<size_t>(kBatch, ranges.size() - start));
    batch.count = count;
    batch.first_chunk[0] = 0;
    for (int k = 0; k < count; ++k) {
      const CopyRange& r = ranges[start + k];
      batch.src[k] = static_cast<const char*>(r.src);
      batch.dst[k] = static_cast<char*>(r.dst);
      batch.bytes[k] = r.bytes;
      batch.first_chunk[k + 1] = batch.first_chunk[k] + (r.bytes + kChunk - 1) / kChunk;
    }
    const int64_t chunks = batch.first_chunk[count];
    if (chunks == 0) continue;
    const int blocks = static_cast<int>(std::min<int64_t>(chunks, static_cast<int64_t>(sms) * kBlocksPerSM));
    batched_copy_kernel<<<blocks, kThreads, 0, stream>>>(batch);
    const cudaError_t err = cudaGetLastError();
    SHARDAMP_CHECK(err == cudaSuccess, "land_grads: copy kernel launch failed: ", cudaGetErrorString(err));
  }
}

}  // namespace cuda
}  // namespace shardamp
