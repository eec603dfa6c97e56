// The byte ranges of land_grads (land_grads.h) on CUDA: each grad that has its param's strides
// and the buffer's dtype is one contiguous byte range, copied into its slot of the flat buffer by
// one batched kernel (up to kBatch grads a launch; cudaMemcpyAsync above kKernelMaxBytes). It
// replaces, for those grads, an as_strided view and a multi-tensor copy entry each: host work
// per param is a few pointer reads. Capturable (no host sync, no allocation).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common.h"
#include "../land_grads.h"

namespace shardamp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 48;           // 48 x 24 B of kernel arguments: well inside 4 KiB
constexpr int kMaxBlocksPerGrad = 64;
// Larger grads are one cudaMemcpyAsync each: the copy runs at full bandwidth, where 64 blocks of
// this kernel would keep too few bytes in flight; there are few of them, so their host cost is small.
constexpr int64_t kKernelMaxBytes = int64_t{1} << 20;

struct Batch {
  const char* src[kBatch];
  char* dst[kBatch];
  int64_t bytes[kBatch];
};

__global__ void batched_copy_kernel(Batch batch) {
  const int g = blockIdx.y;
  const char* src = batch.src[g];
  char* dst = batch.dst[g];
  const int64_t n = batch.bytes[g];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if (align % 16 == 0) {
    const int64_t vecs = n / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = first; i < vecs; i += stride) d[i] = s[i];
    for (int64_t i = vecs * 16 + first; i < n; i += stride) dst[i] = src[i];
  } else if (align % 4 == 0) {
    const int64_t words = n / 4;
    const int32_t* s = reinterpret_cast<const int32_t*>(src);
    int32_t* d = reinterpret_cast<int32_t*>(dst);
    for (int64_t i = first; i < words; i += stride) d[i] = s[i];
    for (int64_t i = words * 4 + first; i < n; i += stride) dst[i] = src[i];
  } else {
    for (int64_t i = first; i < n; i += stride) dst[i] = src[i];
  }
}

}  // namespace

void batched_copy(const std::vector<CopyRange>& ranges, const at::Device& device) {
  if (ranges.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<const CopyRange*> small;
  small.reserve(ranges.size());
  for (const CopyRange& r : ranges) {
    if (r.bytes > kKernelMaxBytes) {
      const cudaError_t err = cudaMemcpyAsync(r.dst, r.src, static_cast<size_t>(r.bytes), cudaMemcpyDeviceToDevice, stream);
      SHARDAMP_CHECK(err == cudaSuccess, "GradStager.land: cudaMemcpyAsync failed: ", cudaGetErrorString(err));
    } else {
      small.push_back(&r);
    }
  }
  for (size_t start = 0; start < small.size(); start += kBatch) {
    Batch batch;
    const int count = static_cast<int>(std::min<size_t>(kBatch, small.size() - start));
    int64_t largest = 0;
    for (int k = 0; k < count; ++k) {
      const CopyRange& r = *small[start + k];
      batch.src[k] = static_cast<const char*>(r.src);
      batch.dst[k] = static_cast<char*>(r.dst);
      batch.bytes[k] = r.bytes;
      largest = std::max(largest, r.bytes);
    }
    const int64_t per_block = static_cast<int64_t>(kThreads) * 16 * 4;  // 4 vectors a thread
    const int blocks_x = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((largest + per_block - 1) / per_block, kMaxBlocksPerGrad)));
    batched_copy_kernel<<<dim3(blocks_x, count), kThreads, 0, stream>>>(batch);
    const cudaError_t err = cudaGetLastError();
    SHARDAMP_CHECK(err == cudaSuccess, "GradStager.land: copy kernel launch failed: ", cudaGetErrorString(err));
  }
}

}  // namespace cuda
}  // namespace shardamp
