// step_scalars on CUDA: one small launch instead of the ~9 scalar ops that formed the grad
// coefficient and advanced the step counts before the step kernel, and stats_finish: one launch
// instead of grad_stats.finish's four (stats_gather_finish: the parts' concatenation too).
// Contract: optim/kernels/reference.py; arithmetic: step_scalars.h. Graph-capturable: no host
// reads, no allocation.

#include "../segment_record.h"
#include "../step_scalars.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace shardamp {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// The scalars' work of thread ``first`` of ``stride`` threads (step_scalars_kernel: the grid;
// stats_step_head_kernel: its one block): thread 0 the coefficient and the health, each thread
// the step counts and the spare flags (with the health) i = first, first + stride, ...
__device__ __forceinline__ void form_scalars(float* coef_out, const float* base, float scale, const float* norm,
                                             float max_norm, const float* found_inf, float* steps,
                                             const float* touched, int64_t count, const StepHealth& health,
                                             bool with_health, int64_t first, int64_t stride) {
  if (first == 0) *coef_out = grad_coefficient(*base, scale, norm, max_norm);
  if (first == 0 && with_health) update_health(health, *found_inf);
  if (with_health) zero_spare(health, first, stride);  // nothing in the launch reads it
  // every thread decides the skip itself from the inputs (no barrier between blocks)
  const float live = with_health ? (step_skipped(health, *found_inf) ? 0.0f : 1.0f) : 1.0f - *found_inf;
  for (int64_t i = first; i < count; i += stride) steps[i] += touched[i] * live;
}

__global__ void step_scalars_kernel(float* coef_out, const float* base, float scale, const float* norm,
                                    float max_norm, const float* found_inf, float* steps, const float* touched,
                                    int64_t count, StepHealth health, bool with_health) {
  form_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, count, health, with_health,
               static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
               static_cast<int64_t>(gridDim.x) * blockDim.x);
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

// The gathered finish's work of thread ``first`` of ``stride`` threads (as form_scalars): thread
// 0 the header, each thread the elements i = first, first + stride, ...
__device__ __forceinline__ void gather_finish(const StatsParts& parts, float* stats, int64_t total, int64_t end,
                                              bool sqrt_root, float* out, int64_t first, int64_t stride) {
  if (first == 0) {
    const float header[2] = {part_value(parts, 0), part_value(parts, 1)};
    finish_header(header, sqrt_root, out);
  }
  for (int64_t i = first; i < total; i += stride) {
    const float v = part_value(parts, i);
    stats[i] = i >= 2 && i < end ? clamp_touched(v) : v;
  }
}

__global__ void stats_gather_finish_kernel(StatsParts parts, float* stats, int64_t total, int64_t end, bool sqrt_root,
                                           float* out) {
  gather_finish(parts, stats, total, end, sqrt_root, out, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// The head of a one-process step (fused_step.cpp's stats_step) in ONE launch of ONE block:
// stats_gather_finish_kernel's work, a barrier, then step_scalars_kernel's (no clip, with the
// health), and where ``prep.count`` > 0 a barrier and prepare_kernel's (adam_step.cu), each the
// same device function over the block's threads, so every element's bits are the separate
// launches'. The barriers make what each part wrote visible to the block before the next reads
// it: the finished header, touched flags and ranks count; then the grad coefficient, the skip
// flag and the advanced step counts. Two launches fewer on the step's path, where each costs the
// host ~10 us right after a backward on a GPU host.
__global__ void stats_step_head_kernel(StatsParts parts, float* stats, int64_t total, int64_t end, bool sqrt_root,
                                       float* out, float* coef_out, const float* base, float scale, float* steps,
                                       const float* touched, int64_t count, StepHealth health, PrepareArgs prep) {
  gather_finish(parts, stats, total, end, sqrt_root, out, threadIdx.x, blockDim.x);
  __syncthreads();
  form_scalars(coef_out, base, scale, nullptr, 0.0f, out + 1, steps, touched, count, health, true, threadIdx.x,
               blockDim.x);
  if (prep.count == 0) return;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < prep.count; i += blockDim.x) prepare_segment(prep, i);
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

// Points ``h.record_host`` at its device address (page-locked memory is mapped under unified
// addressing: the kernel writes the record there itself). Returns the host record that still
// needs a copy after the launch (memory the device cannot reach: h.record_host is then null), or
// null.
float* map_record(StepHealth& h) {
  float* host = h.record_host;
  if (host == nullptr) return nullptr;
  void* mapped = nullptr;
  if (cudaHostGetDevicePointer(&mapped, host, 0) == cudaSuccess && mapped != nullptr) {
    h.record_host = static_cast<float*>(mapped);
    return nullptr;
  }
  (void)cudaGetLastError();  // the query's error is not the launch's
  h.record_host = nullptr;
  return host;
}

// map_record's copy after the launch, where it returned a host record
void copy_record(float* host, const StepHealth& h, cudaStream_t stream) {
  if (host == nullptr) return;
  C10_CUDA_CHECK(cudaMemcpyAsync(host, h.record, (h.full_record ? 4 : 2) * sizeof(float), cudaMemcpyDeviceToHost,
                                 stream));
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
  const StepHealth none{nullptr, nullptr, nullptr, 1.0f, 0.0, nullptr, nullptr, nullptr, false, nullptr, nullptr, 0};
  StepHealth h = health != nullptr ? *health : none;
  float* host_record = map_record(h);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  step_scalars_kernel<<<blocks_for(count), kThreads, 0, stream>>>(
      coef_out.data_ptr<float>(), base.data_ptr<float>(), static_cast<float>(scale),
      norm ? norm->data_ptr<float>() : nullptr, static_cast<float>(max_norm), found_inf.data_ptr<float>(),
      steps.data_ptr<float>(), touched.data_ptr<float>(), count, h, health != nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  copy_record(host_record, h, stream);
}

void stats_step_head(const std::vector<at::Tensor>& parts, at::Tensor& stats, int64_t end, bool sqrt_root,
                     at::Tensor& out, at::Tensor& coef_out, const at::Tensor& base, double scale, at::Tensor& steps,
                     const at::Tensor& touched, const StepHealth& health, const PrepareArgs* prepare) {
  int64_t total = 0;
  const StatsParts p = stats_parts(parts, &total);
  const c10::cuda::CUDAGuard guard(stats.device());
  StepHealth h = health;
  float* host_record = map_record(h);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  stats_step_head_kernel<<<1, kThreads, 0, stream>>>(p, stats.data_ptr<float>(), total, end, sqrt_root,
                                                      out.data_ptr<float>(), coef_out.data_ptr<float>(),
                                                      base.data_ptr<float>(), static_cast<float>(scale),
                                                      steps.data_ptr<float>(), touched.data_ptr<float>(),
                                                      steps.numel(), h,
                                                      prepare != nullptr ? *prepare : PrepareArgs{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  copy_record(host_record, h, stream);
}

}  // namespace cuda
}  // namespace shardamp
