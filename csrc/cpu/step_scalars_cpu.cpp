// step_scalars and stats_finish on the CPU (contract: optim/kernels/reference.py; arithmetic: step_scalars.h).

#include "../step_scalars.h"

namespace shardamp {
namespace cpu {

void step_scalars(at::Tensor& coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor& steps, const at::Tensor& touched,
                  const StepHealth* health) {
  const float* n = norm ? norm->data_ptr<float>() : nullptr;
  coef_out.data_ptr<float>()[0] =
      grad_coefficient(base.data_ptr<float>()[0], static_cast<float>(scale), n, static_cast<float>(max_norm));
  const float found = found_inf.data_ptr<float>()[0];
  float live = 1.0f - found;
  if (health != nullptr) {
    update_health(*health, found);
    zero_spare(*health, 0, 1);
    live = 1.0f - *health->skip_out;
  }
  float* s = steps.data_ptr<float>();
  const float* t = touched.data_ptr<float>();
  for (int64_t i = 0, count = steps.numel(); i < count; ++i) s[i] += t[i] * live;
}

void stats_finish(at::Tensor& stats, int64_t end, bool sqrt_root, at::Tensor& out) {
  float* s = stats.data_ptr<float>();
  finish_header(s, sqrt_root, out.data_ptr<float>());
  for (int64_t i = 2; i < end; ++i) s[i] = clamp_touched(s[i]);
}

}  // namespace cpu
}  // namespace shardamp
