// step_scalars on CUDA: one small launch instead of the ~9 scalar ops that formed the grad
// coefficient and advanced the step counts before the step kernel, and stats_finish: one launch
// instead of grad_stats.finish's four (stats_gather_finish: the parts' concatenation too).
// Contract: optim/kernels/reference.py; arithmetic: step_scalars.h. Graph-capturable: no host
// reads, no allocation.

#include "../step_scalars.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace shardamp {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void step_scalars_kernel(float* coef_out, const float* base, float scale, const float* norm,
                                    float max_norm, const float* found_inf, float* steps, const float* touched,
                                    int64_t count, StepHealth health, bool with_health) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) *coef_out = grad_coefficient(*base, scale, norm, max_norm);
  if (first == 0 && with_health) update_health(health, *found_inf);
  // every thread decides the skip itself from the inputs (no barrier between blocks)
  const float live = with_health ? (step_skipped(health, *found_inf) ? 0.0f : 1.0f) : 1.0f - *found_inf;
  for (int64_t i = first; i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    steps[i] += touched[i] * live;
  }
}

__global__ void stats_finish_kernel(float* stats, int64_t end, bool sqrt_root, float* out) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) finish_header(stats, sqrt_root, out);
  for (int64_t i = 2 + first; i < end; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    stats[i] = clamp_touched(stats[i]);
  }
}

// stats_finish over the concatenation of up to kMaxStatsParts parts, written into `stats` as it
// reads them: the concatenation without an aten op of its own (at::cat's dispatch cost the step
// tens of microseconds of host time on a GPU host, and one launch). Each element is copied as the
// cat copies it and then finished as stats_finish_kernel finishes it: the same bits.
struct StatsParts {
  const float* ptr[kMaxStatsParts];
  int64_t stop[kMaxStatsParts];  // where part k ends in the concatenation
  int count;
};

__device__ float part_value(const StatsParts& parts, int64_t i) {
  int k = 0;
  while (k + 1 < parts.count && i >= parts.stop[k]) ++k;
  return parts.ptr[k][i - (k > 0 ? parts.stop[k - 1] : 0)];
}

__global__ void stats_gather_finish_kernel(StatsParts parts, float* stats, int64_t total, int64_t end, bool sqrt_root,
                                           float* out) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) {
    const float header[2] = {part_value(parts, 0), part_value(parts, 1)};
    finish_header(header, sqrt_root, out);
  }
  for (int64_t i = first; i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = part_value(parts, i);
    stats[i] = i >= 2 && i < end ? clamp_touched(v) : v;
  }
}

// The head of a one-process step (fused_step.cpp's stats_step) in ONE launch of ONE block:
// stats_gather_finish_kernel's work, a barrier, then step_scalars_kernel's (no clip, with the
// health). Every element is the two kernels' element-wise work through the same device
// functions, so the bits are theirs; the barrier makes the finished header, touched flags and
// ranks count visible to the block before the scalars read them. One launch fewer on the step's
// path, where each costs the host ~10 us right after a backward on a GPU host.
__global__ void stats_step_head_kernel(StatsParts parts, float* stats, int64_t total, int64_t end, bool sqrt_root,
                                       float* out, float* coef_out, const float* base, float scale, float* steps,
                                       const float* touched, int64_t count, StepHealth health) {
  const int64_t first = threadIdx.x;
  if (first == 0) {
    const float header[2] = {part_value(parts, 0), part_value(parts, 1)};
    finish_header(header, sqrt_root, out);
  }
  for (int64_t i = first; i < total; i += blockDim.x) {
    const float v = part_value(parts, i);
    stats[i] = i >= 2 && i < end ? clamp_touched(v) : v;
  }
  __syncthreads();
  const float* found_inf = out + 1;
  if (first == 0) {
    *coef_out = grad_coefficient(*base, scale, nullptr, 0.0f);
    update_health(health, *found_inf);
  }
  const float live = step_skipped(health, *found_inf) ? 0.0f : 1.0f;
  for (int64_t i = first; i < count; i += blockDim.x) steps[i] += touched[i] * live;
}

StatsParts stats_parts(const std::vector<at::Tensor>& parts, int64_t* total) {
  TORCH_CHECK(!parts.empty() && parts.size() <= static_cast<size_t>(kMaxStatsParts), "stats_gather_finish: 1 to ",
              kMaxStatsParts, " parts");
  StatsParts p{};
  int64_t at = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    p.ptr[k] = parts[k].data_ptr<float>();
    at += parts[k].numel();
    p.stop[k] = at;
  }
  p.count = static_cast<int>(parts.size());
  *total = at;
  return p;
}

// ``host``'s address in the device's space (page-locked memory is mapped under unified
// addressing: a kernel writes it itself), or null where the device cannot reach it.
float* mapped_record(float* host) {
  void* mapped = nullptr;
  if (cudaHostGetDevicePointer(&mapped, host, 0) == cudaSuccess && mapped != nullptr) return static_cast<float*>(mapped);
  (void)cudaGetLastError();  // the query's error is not the launch's
  return nullptr;
}

int blocks_for(int64_t count) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((count + kThreads - 1) / kThreads, 64)));
}

}  // namespace

void stats_finish(at::Tensor& stats, int64_t end, bool sqrt_root, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(stats.device());
  stats_finish_kernel<<<blocks_for(end - 2), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      stats.data_ptr<float>(), end, sqrt_root, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void stats_gather_finish(const std::vector<at::Tensor>& parts, at::Tensor& stats, int64_t end, bool sqrt_root,
                         at::Tensor& out) {
  int64_t at = 0;
  const StatsParts p = stats_parts(parts, &at);
  const c10::cuda::CUDAGuard guard(stats.device());
  stats_gather_finish_kernel<<<blocks_for(at), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p, stats.data_ptr<float>(), at, end, sqrt_root, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void step_scalars(at::Tensor& coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor& steps, const at::Tensor& touched,
                  const StepHealth* health) {
  const c10::cuda::CUDAGuard guard(coef_out.device());
  const int64_t count = steps.numel();
  const StepHealth none{nullptr, nullptr, nullptr, 1.0f, 0.0, nullptr, nullptr, nullptr, false, nullptr};
  StepHealth h = health != nullptr ? *health : none;
  float* host_record = h.record_host;
  if (host_record != nullptr) {
    // the kernel writes page-locked memory itself; memory the device cannot reach gets a copy after it
    h.record_host = mapped_record(host_record);
    if (h.record_host != nullptr) host_record = nullptr;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  step_scalars_kernel<<<blocks_for(count), kThreads, 0, stream>>>(
      coef_out.data_ptr<float>(), base.data_ptr<float>(), static_cast<float>(scale),
      norm ? norm->data_ptr<float>() : nullptr, static_cast<float>(max_norm), found_inf.data_ptr<float>(),
      steps.data_ptr<float>(), touched.data_ptr<float>(), count, h, health != nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (host_record != nullptr) {
    C10_CUDA_CHECK(cudaMemcpyAsync(host_record, h.record, (h.full_record ? 4 : 2) * sizeof(float),
                                   cudaMemcpyDeviceToHost, stream));
  }
}

void stats_step_head(const std::vector<at::Tensor>& parts, at::Tensor& stats, int64_t end, bool sqrt_root,
                     at::Tensor& out, at::Tensor& coef_out, const at::Tensor& base, double scale, at::Tensor& steps,
                     const at::Tensor& touched, const StepHealth& health) {
  int64_t total = 0;
  const StatsParts p = stats_parts(parts, &total);
  const c10::cuda::CUDAGuard guard(stats.device());
  StepHealth h = health;
  float* host_record = h.record_host;
  if (host_record != nullptr) {
    h.record_host = mapped_record(host_record);
    if (h.record_host != nullptr) host_record = nullptr;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  stats_step_head_kernel<<<1, kThreads, 0, stream>>>(p, stats.data_ptr<float>(), total, end, sqrt_root,
                                                      out.data_ptr<float>(), coef_out.data_ptr<float>(),
                                                      base.data_ptr<float>(), static_cast<float>(scale),
                                                      steps.data_ptr<float>(), touched.data_ptr<float>(),
                                                      steps.numel(), h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (host_record != nullptr) {
    C10_CUDA_CHECK(cudaMemcpyAsync(host_record, h.record, (h.full_record ? 4 : 2) * sizeof(float),
                                   cudaMemcpyDeviceToHost, stream));
  }
}

}  // namespace cuda
}  // namespace shardamp
