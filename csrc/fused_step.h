// The one-process step's merged calls (fused_step.cpp) and what they are made of: the bucket's
// launch structure, its runs and binding.cpp's checked entry points (each merged call runs the same
// checks and the same kernels, in the same order, as the separate calls: bitwise the same).
#pragma once

#include <torch/extension.h>

#include <utility>
#include <vector>

namespace shardamp {

// One bucket's step launch as a named structure (Python: kernels.AdamLaunch builds it once per
// bucket). The shard's tensors, the persistent step scalars and the flags are set at
// construction; what changes between steps (the grad shard, released between steps; touched,
// found_inf, the records row, the chunk map and launch shape) is assigned before each launch.
// Every launch is validated as adam_step is.
struct AdamLaunch {
  at::Tensor grad, master, exp_avg, exp_avg_sq;
  c10::optional<at::Tensor> model_out;
  at::Tensor segments, hparams, steps, touched, grad_coef, found_inf;
  bool adam_w_mode = true;
  bool bias_correction = true;
  c10::optional<at::Tensor> chunks, records;
  int64_t record_offset = 0;
  int64_t shape = 0;
  // One process: the grads where autograd left them, each at its offset in the shard
  // (grad_parts.h; ``grad`` is then an empty tensor of their dtype), assigned before a launch
  std::vector<at::Tensor> part_grads;
  std::vector<int64_t> part_offsets;
  // (start, length) of each row of ``segments``, on the host: where a CUDA launch reads each
  // segment's grads when they are held in place (segment_bases); set once
  std::vector<int64_t> segment_spans;
  // CUDA: the chunk map of the param groups' partials over ``segments`` (group_partials'
  // ``chunks``), set once where the step's one call forms them (stats_step's ``groups_view``)
  c10::optional<at::Tensor> group_chunks;
};

// fused_step.cpp: the stats' finish, bound as stats_finish (binding.cpp)
std::vector<at::Tensor> stats_finish(at::Tensor stats, int64_t end, double norm_type,
                                     const std::vector<std::pair<int64_t, int64_t>>& views);
// binding.cpp: step_scalars, adam_step and adam_prepare as bound (checks included)
void checked_step_scalars(at::Tensor coef_out, const at::Tensor& base, double scale,
                          const c10::optional<at::Tensor>& norm, double max_norm, const at::Tensor& found_inf,
                          at::Tensor steps, const at::Tensor& touched, const c10::optional<at::Tensor>& skip_out,
                          const c10::optional<at::Tensor>& raw_norm, const c10::optional<at::Tensor>& inv_scale,
                          double avg, double skip_above, const c10::optional<at::Tensor>& counters,
                          const c10::optional<at::Tensor>& record, const c10::optional<at::Tensor>& ranks,
                          const c10::optional<at::Tensor>& record_host, const c10::optional<at::Tensor>& spare);
struct StepHealth;  // step_scalars.h
// checked_step_scalars' checks of its arguments and the health they describe (binding.cpp)
StepHealth checked_step_health(const at::Tensor& coef_out, const at::Tensor& base,
                               const c10::optional<at::Tensor>& norm, const at::Tensor& found_inf,
                               const at::Tensor& steps, const at::Tensor& touched,
                               const c10::optional<at::Tensor>& skip_out, const c10::optional<at::Tensor>& raw_norm,
                               const c10::optional<at::Tensor>& inv_scale, double avg, double skip_above,
                               const c10::optional<at::Tensor>& counters, const c10::optional<at::Tensor>& record,
                               const c10::optional<at::Tensor>& ranks, const c10::optional<at::Tensor>& record_host,
                               const c10::optional<at::Tensor>& spare);
// binding.cpp: group_partials as bound (checks included)
void checked_group_partials(const at::Tensor& grad, const at::Tensor& segments, at::Tensor out, double norm_type,
                            const c10::optional<at::Tensor>& chunks);
struct GradPart;  // grad_parts.h
// adam_step over ``l``'s arguments with its checks (``parts``: the grads where autograd left them)
void checked_adam_step(const AdamLaunch& l, const std::vector<GradPart>* parts);
at::Tensor checked_adam_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                                const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                                bool bias_correction, const c10::optional<at::Tensor>& out);
// adam_prepare's checks (CUDA segments; ``out``, where given, a contiguous 16-byte aligned fp32
// tensor of a record per segment on their device), made before any kernel of a step runs
void check_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                   const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                   const c10::optional<at::Tensor>& out);

// fused_step.cpp: the launch objects' runs (bound as adam_launch, adam_launch_all)
void adam_launch(const AdamLaunch& l);
void adam_launch_all(const std::vector<AdamLaunch*>& launches, const std::vector<at::Tensor>& grads,
                     const at::Tensor& hparams, const at::Tensor& touched, const at::Tensor& found_inf,
                     c10::optional<at::Tensor> records, const c10::optional<at::Tensor>& prepare);

void register_fused_step(pybind11::module_& m);  // fused_step.cpp

}  // namespace shardamp
