// The CUDA step's per-segment records (adam_prepare -> adam_step's `records`): what forms one, for
// the prepare kernel (cuda/adam_step.cu) and for the one-process step's head launch
// (cuda/step_scalars.cu), which forms them after the step's scalars in the same launch. Plain
// pointers and flags (cuda::prepare_args fills them), so the host code that hands them to the
// head (fused_step.cpp) needs no CUDA headers.
#pragma once

#include "common.h"

namespace shardamp {

// What the prepare forms per segment, read by adam_kernel as three float4 (kRecordFloats).
struct alignas(16) SegmentRecord {
  SegmentScalars sc;  // 9 floats
  float skip;         // 1: found_inf set or the param untouched: write nothing
  float pad[2];
};
static_assert(sizeof(SegmentRecord) == 48 && kRecordFloats * sizeof(float) == 48, "three float4 per record");

// The prepare's inputs: the segment table (int64 [S, 4]: start, length, param, group), the fp64
// hparams table, the per-param step counts and touched flags, the grad coefficient and the skip
// flag (each of any dtype load_scalar reads: its code), and where the S records go.
struct PrepareArgs {
  const int64_t* segments = nullptr;
  int64_t count = 0;  // S
  SegmentRecord* records = nullptr;
  const double* hparams = nullptr;
  const void* steps = nullptr;
  const void* touched = nullptr;
  const void* grad_coef = nullptr;
  const void* found_inf = nullptr;
  int steps_code = 0, touched_code = 0, coef_code = 0, found_code = 0;
  bool bias_correction = true;
};

// Segment ``i``'s record: skipped where the step is skipped or the param got no grad, else its
// scalars derived in fp64 (segment_scalars).
SHARDAMP_HD void prepare_segment(const PrepareArgs& a, int64_t i) {
  const int64_t param = a.segments[4 * i + 2], group = a.segments[4 * i + 3];
  SegmentRecord r{};
  r.skip = (load_scalar(a.found_inf, a.found_code, 0) != 0.0 || load_scalar(a.touched, a.touched_code, param) == 0.0)
               ? 1.0f
               : 0.0f;
  if (r.skip == 0.0f) {
    r.sc = segment_scalars(a.hparams + 5 * group, load_scalar(a.steps, a.steps_code, param),
                           load_scalar(a.grad_coef, a.coef_code, 0), a.bias_correction);
  }
  a.records[i] = r;
}

#if defined(SHARDAMP_WITH_CUDA) || defined(__CUDACC__)  // (nvcc compiles the .cu files without the define)
namespace cuda {  // cuda/adam_step.cu
// The records of every row of `segments` in one launch, into `out` where given (kRecordFloats
// floats a row, contiguous fp32 on the segments' device), else into a new tensor; returned.
at::Tensor adam_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                        const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                        bool bias_correction, const c10::optional<at::Tensor>& out = c10::nullopt);
// The same inputs as arguments for a launch that forms the records itself (the step's head),
// written into `records`.
PrepareArgs prepare_args(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                         const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                         bool bias_correction, at::Tensor& records);
}  // namespace cuda
#endif

}  // namespace shardamp
