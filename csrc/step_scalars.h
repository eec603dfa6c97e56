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

// The most parts the CUDA finish gathers itself (stats_gather_finish: the parts' pointers travel in
// the launch's arguments); a step's stats have 3-6 (grad_stats.py). More: torch.cat, then the finish.
constexpr int kMaxStatsParts = 8;

// The touched counts (SUM over ranks) as 0/1 flags: clamp(max=1), NaN kept as torch's clamp keeps it.
SHARDAMP_HD float clamp_touched(float v) { return v > 1.0f ? 1.0f : v; }

// The step's health (reference.py ``step_scalars`` with ``skip_out``; optim/step/health.py). Null
// pointers where the caller gave no such tensor.
struct StepHealth {
  float* skip_out;         // the step's skip flag: found-inf or a norm spike
  const float* raw_norm;   // the reduced norm, before averaging and unscaling
  const float* inv_scale;  // 1 / loss scale, or null (no scaler)
  float avg;               // the averaging factor
  double skip_above;       // a spike: the unscaled norm above this (inf: never)
  double* counters;        // [applied, skipped non-finite, skipped spike, consecutive skips]
  float* record;           // [reason 0 applied / 1 found-inf / 2 spike, unscaled norm(, ranks, inv scale)]
  const float* ranks;      // with a 4-float record: the ranks whose own grads held inf/NaN, or null (0)
  bool full_record;        // the record holds 4 floats: the two above, then ranks and the inverse scale (1 without)
  // the record written again where the host reads it (page-locked memory the kernel reaches through
  // its mapped address), or null: no device-to-host copy for the record (optim/checks/deferred.py)
  float* record_host;
  // the round flags' spare buffer (optim/step/health.py), zeroed here for the round after this
  // step, or null: the zero_grad that starts the next round then launches nothing for it
  float* spare;
  int64_t spare_count;
};

// The spare flags' elements i = first, first + stride, ... set to zero (``first``: this thread's
// index among ``stride`` threads; one thread on the CPU).
SHARDAMP_HD void zero_spare(const StepHealth& h, int64_t first, int64_t stride) {
  for (int64_t i = first; i < h.spare_count; i += stride) h.spare[i] = 0.0f;
}

// ``raw * avg * inv_scale`` in that order, as StepRound forms the norm grad_norm() hands out.
SHARDAMP_HD float unscaled_norm(const StepHealth& h) {
  const float n = *h.raw_norm * h.avg;
  return h.inv_scale != nullptr ? n * *h.inv_scale : n;
}

// Found-inf or a spike (compared in double: exact; NaN is never a spike).
SHARDAMP_HD bool step_skipped(const StepHealth& h, float found_inf) {
  return found_inf != 0.0f || static_cast<double>(unscaled_norm(h)) > h.skip_above;
}

// Once per step (one thread): the skip flag, the counters and the record.
SHARDAMP_HD void update_health(const StepHealth& h, float found_inf) {
  const float norm = unscaled_norm(h);
  const bool found = found_inf != 0.0f;
  const bool spike = static_cast<double>(norm) > h.skip_above;
  const bool skip = found || spike;
  *h.skip_out = skip ? 1.0f : 0.0f;
  if (h.counters != nullptr) {
    h.counters[0] += skip ? 0.0 : 1.0;
    h.counters[1] += found ? 1.0 : 0.0;
    h.counters[2] += (spike && !found) ? 1.0 : 0.0;
    h.counters[3] = skip ? h.counters[3] + 1.0 : 0.0;
  }
  if (h.record != nullptr) {
    h.record[0] = found ? 1.0f : (spike ? 2.0f : 0.0f);
    h.record[1] = norm;
    if (h.full_record) {  // the whole step report the host reads back (optim/checks/deferred.py): no concatenation
      h.record[2] = h.ranks != nullptr ? *h.ranks : 0.0f;
      h.record[3] = h.inv_scale != nullptr ? *h.inv_scale : 1.0f;
    }
    if (h.record_host != nullptr) {
      for (int i = 0; i < (h.full_record ? 4 : 2); ++i) h.record_host[i] = h.record[i];
    }
  }
}

}  // namespace shardamp
