// The one-process step's native calls merged where nothing has to run between them
// (optim/kernels/fused_step.py): one Python-to-C++ call instead of several, each of which costs
// the host microseconds on the CPU and tens of them on a GPU host before its kernel is launched.
// Each is the separate calls in the same order with the same checks (binding.cpp), so the
// results are bitwise the same; on CUDA every launch goes to the current stream, as theirs.
#include "fused_step.h"

#include <cstring>

#include "common.h"

namespace shardamp {
namespace {

// ``torch.cat(parts)`` (1-d parts). CPU fp32 parts are copied by memcpy into a new tensor: the
// same bytes without an aten op (a dispatch, microseconds of host time each step); elsewhere
// at::cat, one launch on CUDA where a copy per part would be one each.
at::Tensor cat_parts(const std::vector<at::Tensor>& parts) {
  const at::Tensor& first = parts.front();
  int64_t total = 0;
  bool plain = first.is_cpu() && first.scalar_type() == at::kFloat;
  for (const auto& p : parts) {
    plain = plain && p.is_cpu() && p.scalar_type() == at::kFloat && p.dim() == 1 && p.is_contiguous();
    total += p.numel();
  }
  if (!plain) return at::cat(parts);
  at::Tensor stats = at::empty({total}, first.options());
  float* dst = stats.data_ptr<float>();
  for (const auto& p : parts) {
    std::memcpy(dst, p.data_ptr<float>(), static_cast<size_t>(p.numel()) * sizeof(float));
    dst += p.numel();
  }
  return stats;
}

// ``torch.cat(parts)`` then ``stats_finish``: ``[stats, norm, found_inf, *views]``. One process:
// nothing reduces the stats between their assembly and their finish.
std::vector<at::Tensor> stats_cat_finish(const std::vector<at::Tensor>& parts, int64_t end, double norm_type,
                                         const std::vector<std::pair<int64_t, int64_t>>& views) {
  SHARDAMP_CHECK(!parts.empty(), "stats_cat_finish: no parts");
  at::Tensor stats = cat_parts(parts);
  std::vector<at::Tensor> out = checked_stats_finish(stats, end, norm_type, views);
  out.insert(out.begin(), stats);
  return out;
}

// The step's scalar launch and then every bucket's step kernel, skipping on the skip flag the
// scalar launch wrote (``skip_out``): step_scalars and adam_launch_all in one call (no gathers
// between the buckets' kernels: one shard rank). ``prepare``: as adam_launch_all's (CUDA).
void step_launch(at::Tensor coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                 double max_norm, const at::Tensor& found_inf, at::Tensor steps, const at::Tensor& touched,
                 const at::Tensor& skip_out, const at::Tensor& raw_norm, const c10::optional<at::Tensor>& inv_scale,
                 double avg, double skip_above, const at::Tensor& counters, const at::Tensor& record,
                 const c10::optional<at::Tensor>& ranks, const c10::optional<at::Tensor>& record_host,
                 const std::vector<AdamLaunch*>& launches, const std::vector<at::Tensor>& grads,
                 const at::Tensor& hparams, const c10::optional<at::Tensor>& prepare) {
  checked_step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, skip_out, raw_norm, inv_scale,
                       avg, skip_above, counters, record, ranks, record_host);
  checked_adam_launch_all(launches, grads, hparams, touched, skip_out, c10::nullopt, prepare);
}

// The whole launch sequence of a step whose stats nothing asked for before it (no clip, no
// unscale): stats_cat_finish, then step_launch over its results, ``[stats, norm, found_inf,
// *views]`` returned as stats_cat_finish returns them. The step's touched flags are
// ``views[touched_view]``, the health's count of ranks with inf/NaN grads ``views[ranks_view]``
// (-1: none); the norm is the health's raw norm, found-inf the step's. No clip: the clip's
// norm is handed out before the step, so a clipped step's stats are finished by then.
std::vector<at::Tensor> stats_step(const std::vector<at::Tensor>& parts, int64_t end, double norm_type,
                                   const std::vector<std::pair<int64_t, int64_t>>& views, int64_t touched_view,
                                   int64_t ranks_view, at::Tensor coef_out, const at::Tensor& base, double scale,
                                   at::Tensor steps, const at::Tensor& skip_out,
                                   const c10::optional<at::Tensor>& inv_scale, double avg, double skip_above,
                                   const at::Tensor& counters, const at::Tensor& record,
                                   const c10::optional<at::Tensor>& record_host,
                                   const std::vector<AdamLaunch*>& launches, const std::vector<at::Tensor>& grads,
                                   const at::Tensor& hparams, const c10::optional<at::Tensor>& prepare) {
  const auto n_views = static_cast<int64_t>(views.size());
  SHARDAMP_CHECK(touched_view >= 0 && touched_view < n_views && ranks_view >= -1 && ranks_view < n_views,
                 "stats_step: touched_view and ranks_view must name views (ranks_view -1: none)");
  std::vector<at::Tensor> out = stats_cat_finish(parts, end, norm_type, views);
  const at::Tensor& touched = out[3 + touched_view];
  c10::optional<at::Tensor> ranks;
  if (ranks_view >= 0) ranks = out[3 + ranks_view];
  step_launch(coef_out, base, scale, c10::nullopt, 0.0, out[2], steps, touched, skip_out, out[1], inv_scale, avg,
              skip_above, counters, record, ranks, record_host, launches, grads, hparams, prepare);
  return out;
}

}  // namespace

void register_fused_step(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("stats_cat_finish", &stats_cat_finish,
        "stats_finish over torch.cat(parts) (one process: nothing reduces between): [stats, norm, found_inf, *views]",
        py::arg("parts"), py::arg("end"), py::arg("norm_type"), py::arg("views"));
  m.def("step_launch", &step_launch,
        "step_scalars with the step's health, then adam_launch_all skipping on skip_out: the one-shard-rank step in one "
        "call (positional arguments: step_scalars', then launches, grads, hparams, prepare)");
  m.def("stats_step", &stats_step,
        "stats_cat_finish, then step_launch over its results (touched and the ranks count: views of the stats; no "
        "clip): a one-process step whose stats nothing asked for before it, in one call; returns [stats, norm, "
        "found_inf, *views] (positional arguments)");
}

}  // namespace shardamp
