// The step's scalars in one launch (optim/kernels/reference.py ``step_scalars``): the grad coefficient
// ``base * scale * clip`` with torch.nn.utils.clip_grad_norm_'s coefficient of one clip (never
// NaN), and the per-param step counts advanced where a param got a grad and the step is not
// skipped. The same arithmetic, in the same order, as the torch ops of the reference.
#pragma once

#include "common.h"

namespace shardamp {

// ``max_norm / (norm + 1e-6)`` as torch forms it (reciprocal, then times max_norm), clamped to
// at most 1, NaN and infinities -> 1 (grad_stats.clip_coef).
SHARDAMP_HD float clip_coefficient(float norm, float max_norm) {
  float k = (1.0f / (norm + 1e-6f)) * max_norm;
  if (k != k || k == -INFINITY || k == INFINITY) return 1.0f;
  return k < 1.0f ? k : 1.0f;
}

SHARDAMP_HD float grad_coefficient(float base, float scale, const float* norm, float max_norm) {
  float c = base * scale;
  return norm != nullptr ? c * clip_coefficient(*norm, max_norm) : c;
}

// The reduced stats' header as grad_stats.finish forms it (reference.py ``stats_finish``):
// out[0] the norm (sqrt of the partial for norm_type 2, the partial itself for inf), out[1]
// found-inf: 1 iff the non-finite flag is set or the partial is inf/NaN (flag + 0 * partial != 0).
SHARDAMP_HD void finish_header(const float* stats, bool sqrt_root, float* out) {
  const float partial = stats[0];
  out[0] = sqrt_root ? sqrtf(partial) : partial;
  out[1] = (stats[1] + 0.0f * partial) != 0.0f ? 1.0f : 0.0f;
}

// The touched counts (SUM over ranks) as 0/1 flags: clamp(max=1), NaN kept as torch's clamp keeps it.
SHARDAMP_HD float clamp_touched(float v) { return v > 1.0f ? 1.0f : v; }

}  // namespace shardamp
