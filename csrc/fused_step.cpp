// The one-process step's native calls merged where nothing has to run between them
// (optim/kernels/fused_step.py): one Python-to-C++ call instead of several, each of which costs
// the host microseconds on the CPU and tens of them on a GPU host before its kernel is launched.
// Each is the separate calls in the same order with the same checks (binding.cpp), so the
// results are bitwise the same; on CUDA every launch goes to the current stream, as theirs.
// Also the bucket launch objects' runs (adam_launch, adam_launch_all), which every step path takes.
#include "fused_step.h"

#include <cmath>
#include <cstring>

#include "common.h"
#include "grad_parts.h"
#include "segment_record.h"
#include "step_scalars.h"

namespace shardamp {

void adam_launch(const AdamLaunch& l) {
  std::vector<GradPart> parts;
  if (!l.part_grads.empty()) parts = grad_parts(l.part_grads, l.part_offsets, l.grad.scalar_type(), l.master.numel(),
                                                "adam_launch", l.master.device());
  checked_adam_step(l, l.part_grads.empty() ? nullptr : &parts);
}

namespace {

// Every launch lets go of its grad and its held grads when the call that took them returns or
// raises: a held bucket's grads left on its launch object would be read by a later step that
// lands that bucket in its shard instead (set before the call: adam_launch.native_launches).
struct ReleaseGrads {
  const std::vector<AdamLaunch*>& launches;
  ~ReleaseGrads() {
    for (AdamLaunch* l : launches) {
      l->grad = at::Tensor();
      l->part_grads.clear();
      l->part_offsets.clear();
    }
  }
};

// adam_launch_all's work (below); ``prepare_checked``: the caller made adam_prepare's checks of
// ``prepare`` and ``records`` before the step's first kernel (check_step_records), so the
// records are formed without making them again (microseconds of host time a step, right after a
// backward on a GPU host).
void launch_all(const std::vector<AdamLaunch*>& launches, const std::vector<at::Tensor>& grads,
                const at::Tensor& hparams, const at::Tensor& touched, const at::Tensor& found_inf,
                c10::optional<at::Tensor> records, const c10::optional<at::Tensor>& prepare, bool prepare_checked) {
  const ReleaseGrads release{launches};
  SHARDAMP_CHECK(launches.size() == grads.size(), "adam_launch_all: one grad per launch (", launches.size(),
                 " launches, ", grads.size(), " grads)");
  if (prepare && !launches.empty()) {
    const AdamLaunch& first = *launches.front();
#if defined(SHARDAMP_WITH_CUDA)
    if (prepare_checked) {
      records = cuda::adam_prepare(*prepare, hparams, first.steps, touched, first.grad_coef, found_inf,
                                   first.bias_correction, records);
    } else {
      records = checked_adam_prepare(*prepare, hparams, first.steps, touched, first.grad_coef, found_inf,
                                     first.bias_correction, records);
    }
#else
    (void)prepare_checked;  // the checks refuse a CPU table: this build forms no records
    records = checked_adam_prepare(*prepare, hparams, first.steps, touched, first.grad_coef, found_inf,
                                   first.bias_correction, records);
#endif
  }
  for (size_t i = 0; i < launches.size(); ++i) {
    AdamLaunch& l = *launches[i];
    l.grad = grads[i];
    l.hparams = hparams;
    l.touched = touched;
    l.found_inf = found_inf;
    l.records = records;
    adam_launch(l);
  }
}

}  // namespace

// The step's launches in one call (optim/kernels/dispatch.py ``launch_adam_all``): each prepared
// launch in turn with its grad shard and this step's hyperparameter table, touched pattern, skip
// flag and records (CUDA; None on the CPU). With ``prepare`` (CUDA: the segments of every launch,
// kernels.StepRecords' table) the records are formed first by adam_prepare over the step counts,
// grad coefficient and bias correction the launches share (the optimizer's): into ``records``
// where given (StepRecords' persistent buffer), else into a new tensor. Every launch lets go of
// its grad afterwards, also when a launch or the prepare raises: the grad shards are released
// between steps.
void adam_launch_all(const std::vector<AdamLaunch*>& launches, const std::vector<at::Tensor>& grads,
                     const at::Tensor& hparams, const at::Tensor& touched, const at::Tensor& found_inf,
                     c10::optional<at::Tensor> records, const c10::optional<at::Tensor>& prepare) {
  launch_all(launches, grads, hparams, touched, found_inf, std::move(records), prepare, false);
}

namespace cpu {
void stats_finish(at::Tensor& stats, int64_t end, bool sqrt_root, at::Tensor& out);  // cpu/grad_stats_cpu.cpp
}  // namespace cpu
#if defined(SHARDAMP_WITH_CUDA)
namespace cuda {  // cuda/step_scalars.cu
void stats_finish(at::Tensor& stats, int64_t end, bool sqrt_root, at::Tensor& out);
void stats_gather_finish(const std::vector<at::Tensor>& parts, at::Tensor& stats, int64_t end, bool sqrt_root,
                         at::Tensor& out);
void stats_step_head(const std::vector<at::Tensor>& parts, at::Tensor& stats, int64_t end, bool sqrt_root,
                     at::Tensor& out, at::Tensor& coef_out, const at::Tensor& base, double scale, at::Tensor& steps,
                     const at::Tensor& touched, const StepHealth& health, const PrepareArgs* prepare);
}  // namespace cuda
#endif

namespace {

#if defined(SHARDAMP_WITH_CUDA)
// The most stats plus step counts one block's launch finishes and advances (stats_step's head):
// beyond it (tens of thousands of params) the separate launches spread them over more blocks.
constexpr int64_t kHeadElements = int64_t{1} << 16;
// The most segment records the head forms too: 8 a thread of its 256, each two fp64 powers, a
// few microseconds of one SM at most, where the prepare launch it saves costs the host ~10 us
// right after a backward; beyond it the prepare kernel spreads them over the GPU.
constexpr int64_t kHeadSegments = 2048;
#endif

// The checks of the records' prepare of a step's launches (``prepare``: the segment table;
// ``records``: the buffer it forms them into), made before the step's first kernel so that a
// refused argument leaves the step counts and the health untouched; ``records`` without
// ``prepare`` would be last step's records, read as this step's.
void check_step_records(const char* fn, const std::vector<AdamLaunch*>& launches, const at::Tensor& hparams,
                        const at::Tensor& touched, const at::Tensor& skip_out,
                        const c10::optional<at::Tensor>& prepare, const c10::optional<at::Tensor>& records) {
  SHARDAMP_CHECK(!records || prepare, fn, ": records is the buffer prepare forms them into (pass the segment table "
                 "as prepare too)");
  if (!prepare || launches.empty()) return;
  const AdamLaunch& first = *launches.front();
  check_prepare(*prepare, hparams, first.steps, touched, first.grad_coef, skip_out, records);
}

void check_finish(int64_t numel, int64_t end, double norm_type, const std::vector<std::pair<int64_t, int64_t>>& views) {
  SHARDAMP_CHECK(end >= 2 && end <= numel, "stats_finish: end must lie in [2, stats.numel()]");
  SHARDAMP_CHECK(norm_type == 2.0 || std::isinf(norm_type), "stats_finish: norm_type must be 2 or inf");
  for (const auto& v : views) {
    SHARDAMP_CHECK(v.first >= 0 && v.second >= 0 && v.first + v.second <= numel,
                   "stats_finish: each view (start, length) must lie within stats");
  }
}

// ``sizes`` (contiguous) of ``base``'s storage from its element ``offset``, as a new tensor made
// without the dispatcher. select and narrow go through autograd's view bookkeeping (the base,
// the shared version counter, the view's replay function): microseconds of host time a view
// right after a backward, when the step's thread runs with cold caches (a step makes 4-6). The
// stats never take part in autograd (made and read with grad off, never requiring grad); the
// alias shares the base's storage, so torch's storage-based aliasing checks still see it. A base
// that requires grad (a caller's own tensor) gets autograd's view.
at::Tensor storage_alias(const at::Tensor& base, int64_t offset, c10::IntArrayRef sizes) {
  if (base.requires_grad()) return base.flatten().narrow(0, offset, c10::multiply_integers(sizes)).view(sizes);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_storage_offset(base.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

// [norm, found_inf, *views of stats]: the finish's results as the step reads them
std::vector<at::Tensor> finish_results(const at::Tensor& stats, const at::Tensor& out,
                                       const std::vector<std::pair<int64_t, int64_t>>& views) {
  std::vector<at::Tensor> result{storage_alias(out, 0, {}), storage_alias(out, 1, {})};
  result.reserve(2 + views.size());
  for (const auto& v : views) result.push_back(storage_alias(stats, v.first, {v.second}));
  return result;
}

#if defined(SHARDAMP_WITH_CUDA)
// What a gathered finish writes, ``[stats, norm, found_inf, *views]`` (finish_results), its
// arguments checked: the ``total``-element stats and the 2-element ``header`` after them in ONE
// allocation (each is microseconds of host time right after a backward).
std::vector<at::Tensor> gathered_outputs(const std::vector<at::Tensor>& parts, int64_t total, int64_t end,
                                         double norm_type, const std::vector<std::pair<int64_t, int64_t>>& views,
                                         at::Tensor* header) {
  check_finish(total, end, norm_type, views);
  const at::Tensor both = at::empty({total + 2}, parts.front().options());
  at::Tensor stats = storage_alias(both, 0, {total});
  *header = storage_alias(both, total, {2});
  std::vector<at::Tensor> out = finish_results(stats, *header, views);
  out.insert(out.begin(), stats);
  return out;
}

// The parts' total element count where one CUDA launch can gather them (fp32 1-d contiguous
// parts of one CUDA device, at most kMaxStatsParts: their pointers travel in the launch's
// arguments), else -1.
int64_t gathered_numel(const std::vector<at::Tensor>& parts) {
  if (parts.empty() || parts.size() > static_cast<size_t>(kMaxStatsParts) || !parts.front().is_cuda()) return -1;
  const at::Device device = parts.front().device();
  int64_t total = 0;
  for (const auto& p : parts) {
    if (p.device() != device || p.scalar_type() != at::kFloat || p.dim() != 1 || !p.is_contiguous()) return -1;
    total += p.numel();
  }
  return total;
}
#endif

// [stats, norm, found_inf, *views] of stats_finish over the parts' concatenation in one CUDA
// launch that also concatenates (fp32 1-d contiguous parts of one CUDA device, at most
// kMaxStatsParts: their pointers travel in the launch's arguments); empty where they do not
// qualify (the caller concatenates them, then finishes). at::cat's dispatch and launch cost the
// step tens of microseconds of host time on a GPU host.
std::vector<at::Tensor> gathered_stats_finish(const std::vector<at::Tensor>& parts, int64_t end, double norm_type,
                                              const std::vector<std::pair<int64_t, int64_t>>& views) {
#if defined(SHARDAMP_WITH_CUDA)
  const int64_t total = gathered_numel(parts);
  if (total < 0) return {};
  at::Tensor header;
  std::vector<at::Tensor> out = gathered_outputs(parts, total, end, norm_type, views, &header);
  cuda::stats_gather_finish(parts, out[0], end, norm_type == 2.0, header);
  return out;
#else
  (void)parts, (void)end, (void)norm_type, (void)views;
  return {};
#endif
}

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
// nothing reduces the stats between their assembly and their finish. On CUDA one launch does both
// (gathered_stats_finish) where the parts qualify.
std::vector<at::Tensor> stats_cat_finish(const std::vector<at::Tensor>& parts, int64_t end, double norm_type,
                                         const std::vector<std::pair<int64_t, int64_t>>& views) {
  SHARDAMP_CHECK(!parts.empty(), "stats_cat_finish: no parts");
  std::vector<at::Tensor> gathered = gathered_stats_finish(parts, end, norm_type, views);
  if (!gathered.empty()) return gathered;
  at::Tensor stats = cat_parts(parts);
  std::vector<at::Tensor> out = stats_finish(stats, end, norm_type, views);
  out.insert(out.begin(), stats);
  return out;
}

// The step's scalar launch and then every bucket's step kernel, skipping on the skip flag the
// scalar launch wrote (``skip_out``): step_scalars and adam_launch_all in one call (no gathers
// between the buckets' kernels: one shard rank). ``prepare``, ``records``: as adam_launch_all's (CUDA).
void step_launch(at::Tensor coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                 double max_norm, const at::Tensor& found_inf, at::Tensor steps, const at::Tensor& touched,
                 const at::Tensor& skip_out, const at::Tensor& raw_norm, const c10::optional<at::Tensor>& inv_scale,
                 double avg, double skip_above, const at::Tensor& counters, const at::Tensor& record,
                 const c10::optional<at::Tensor>& ranks, const c10::optional<at::Tensor>& record_host,
                 const c10::optional<at::Tensor>& spare, const std::vector<AdamLaunch*>& launches,
                 const std::vector<at::Tensor>& grads, const at::Tensor& hparams,
                 const c10::optional<at::Tensor>& prepare,
                 const c10::optional<at::Tensor>& records) {
  const ReleaseGrads release{launches};  // also where a check or the scalars raise before the launches
  check_step_records("step_launch", launches, hparams, touched, skip_out, prepare, records);
  checked_step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, skip_out, raw_norm, inv_scale,
                       avg, skip_above, counters, record, ranks, record_host, spare);
  launch_all(launches, grads, hparams, touched, skip_out, records, prepare, true);
}

// Each param group's norm partial of every launch's grads, added into ``out`` (the stats' group
// view) in the launches' order, as optim/kernels/dispatch.py ``group_partials_all`` adds them:
// over the held grads where a launch holds them (set_held), else over its grad shard. Before the
// launches run, which let go of the held grads.
void launch_group_partials(const std::vector<AdamLaunch*>& launches, const std::vector<at::Tensor>& grads,
                           const at::Tensor& out, double norm_type) {
  SHARDAMP_CHECK(launches.size() == grads.size(), "stats_step: one grad per launch (", launches.size(),
                 " launches, ", grads.size(), " grads)");
  for (size_t i = 0; i < launches.size(); ++i) {
    const AdamLaunch& l = *launches[i];
    if (l.part_grads.empty()) {
      checked_group_partials(grads[i], l.segments, out, norm_type, l.group_chunks);
      continue;
    }
    c10::optional<std::vector<int64_t>> spans;
    if (!l.master.device().is_cpu()) spans = l.segment_spans;
    checked_group_partials_parts(l.part_grads, l.part_offsets, l.master.numel(), l.segments, out, norm_type,
                                 l.group_chunks, spans);
  }
}

// The whole launch sequence of a step whose stats nothing asked for before it (no clip, no
// unscale): stats_cat_finish, then step_launch over its results, ``[stats, norm, found_inf,
// *views]`` returned as stats_cat_finish returns them. On CUDA, where the parts gather in one
// launch, the finish, the scalars and (with ``prepare`` and ``records``) the buckets' records are
// one launch of one block (cuda::stats_step_head: their kernels' element-wise work, so the same
// bits) with step_scalars' and adam_prepare's checks made before it: two launches fewer, each
// ~10 us of host time right after a backward on a GPU host. The step's touched flags are
// ``views[touched_view]``, the health's count of ranks with inf/NaN grads ``views[ranks_view]``
// (-1: none); the norm is the health's raw norm, found-inf the step's. With several param
// groups, ``views[groups_view]`` (-1: none) takes each group's partial of every launch's grads
// (launch_group_partials: one Python call less per bucket). No clip: the clip's norm is handed
// out before the step, so a clipped step's stats are finished by then.
std::vector<at::Tensor> stats_step(const std::vector<at::Tensor>& parts, int64_t end, double norm_type,
                                   const std::vector<std::pair<int64_t, int64_t>>& views, int64_t touched_view,
                                   int64_t ranks_view, int64_t groups_view, at::Tensor coef_out,
                                   const at::Tensor& base, double scale, at::Tensor steps, const at::Tensor& skip_out,
                                   const c10::optional<at::Tensor>& inv_scale, double avg, double skip_above,
                                   const at::Tensor& counters, const at::Tensor& record,
                                   const c10::optional<at::Tensor>& record_host,
                                   const c10::optional<at::Tensor>& spare,
                                   const std::vector<AdamLaunch*>& launches, const std::vector<at::Tensor>& grads,
                                   const at::Tensor& hparams, const c10::optional<at::Tensor>& prepare,
                                   c10::optional<at::Tensor> records) {
  const ReleaseGrads release{launches};  // also where the finish or a check raises before the launches
  const auto n_views = static_cast<int64_t>(views.size());
  SHARDAMP_CHECK(touched_view >= 0 && touched_view < n_views && ranks_view >= -1 && ranks_view < n_views &&
                     groups_view >= -1 && groups_view < n_views,
                 "stats_step: touched_view, ranks_view and groups_view must name views (ranks_view and groups_view "
                 "-1: none)");
#if defined(SHARDAMP_WITH_CUDA)
  const int64_t total = gathered_numel(parts);
  if (total >= 0 && total + steps.numel() <= kHeadElements) {  // the finish and the scalars in one launch
    at::Tensor header;
    std::vector<at::Tensor> out = gathered_outputs(parts, total, end, norm_type, views, &header);
    const at::Tensor& touched = out[3 + touched_view];
    c10::optional<at::Tensor> ranks;
    if (ranks_view >= 0) ranks = out[3 + ranks_view];
    const StepHealth health = checked_step_health(coef_out, base, c10::nullopt, out[2], steps, touched, skip_out,
                                                  out[1], inv_scale, avg, skip_above, counters, record, ranks,
                                                  record_host, spare);
    check_step_records("stats_step", launches, hparams, touched, skip_out, prepare, records);
    // the records too where they go to the optimizer's buffer and are few enough for one block
    const bool with_records = prepare && records && !launches.empty() && prepare->size(0) <= kHeadSegments;
    PrepareArgs prep;
    if (with_records) {
      const AdamLaunch& first = *launches.front();
      prep = cuda::prepare_args(*prepare, hparams, first.steps, touched, first.grad_coef, skip_out,
                                first.bias_correction, *records);
    }
    cuda::stats_step_head(parts, out[0], end, norm_type == 2.0, header, coef_out, base, scale, steps, touched, health,
                          with_records ? &prep : nullptr);
    if (groups_view >= 0) launch_group_partials(launches, grads, out[3 + groups_view], norm_type);
    launch_all(launches, grads, hparams, touched, skip_out, records, with_records ? c10::nullopt : prepare, true);
    return out;
  }
#endif
  std::vector<at::Tensor> out = stats_cat_finish(parts, end, norm_type, views);
  if (groups_view >= 0) launch_group_partials(launches, grads, out[3 + groups_view], norm_type);
  const at::Tensor& touched = out[3 + touched_view];
  c10::optional<at::Tensor> ranks;
  if (ranks_view >= 0) ranks = out[3 + ranks_view];
  step_launch(coef_out, base, scale, c10::nullopt, 0.0, out[2], steps, touched, skip_out, out[1], inv_scale, avg,
              skip_above, counters, record, ranks, record_host, spare, launches, grads, hparams, prepare, records);
  return out;
}

}  // namespace

// The reduced stats' header and touched flags in one launch (bound as stats_finish; contract:
// reference.py ``stats_finish``; optim/kernels/dispatch.py checks first, these checks are the
// backstop): [norm, found_inf] (0-d views of one new 2-float tensor), stats[2:end] clamped to <= 1,
// then stats[start : start + length] for each of ``views``: the step's views of its stats made
// here, where each costs no Python call.
std::vector<at::Tensor> stats_finish(at::Tensor stats, int64_t end, double norm_type,
                                     const std::vector<std::pair<int64_t, int64_t>>& views) {
  SHARDAMP_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.dim() == 1,
                 "stats_finish: stats must be a contiguous 1-d fp32 tensor");
  check_finish(stats.numel(), end, norm_type, views);
  const bool sqrt_root = norm_type == 2.0;
  at::Tensor out = at::empty({2}, stats.options());
  if (stats.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    cuda::stats_finish(stats, end, sqrt_root, out);
#else
    SHARDAMP_CHECK(false, "stats_finish: this build of the shardamp kernels has no CUDA support");
#endif
  } else {
    SHARDAMP_CHECK(stats.is_cpu(), "stats_finish: unsupported device ", stats.device());
    cpu::stats_finish(stats, end, sqrt_root, out);
  }
  return finish_results(stats, out, views);
}

void register_fused_step(pybind11::module_& m) {
  namespace py = pybind11;
  // module_local: the CPU and CUDA modules (one process may load both) each register this type
  // (fused_step.h: shared by two files, so not in an anonymous namespace as the other types are)
  py::class_<shardamp::AdamLaunch>(m, "AdamLaunch", py::module_local(), "One bucket's step launch: adam_step's arguments by name")
      .def(py::init([](at::Tensor grad, at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                       c10::optional<at::Tensor> model_out, at::Tensor segments, at::Tensor hparams, at::Tensor steps,
                       at::Tensor touched, at::Tensor grad_coef, at::Tensor found_inf, bool adam_w_mode,
                       bool bias_correction) {
             return shardamp::AdamLaunch{grad, master, exp_avg, exp_avg_sq, model_out, segments, hparams, steps,
                                         touched, grad_coef, found_inf, adam_w_mode, bias_correction};
           }),
           py::kw_only(), py::arg("grad"), py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
           py::arg("model_out"), py::arg("segments"), py::arg("hparams"), py::arg("steps"), py::arg("touched"),
           py::arg("grad_coef"), py::arg("found_inf"), py::arg("adam_w_mode"), py::arg("bias_correction"))
      .def_readwrite("grad", &shardamp::AdamLaunch::grad)
      .def_readwrite("touched", &shardamp::AdamLaunch::touched)
      .def_readwrite("found_inf", &shardamp::AdamLaunch::found_inf)
      .def_readwrite("grad_coef", &shardamp::AdamLaunch::grad_coef)
      .def_readwrite("hparams", &shardamp::AdamLaunch::hparams)
      .def_readwrite("chunks", &shardamp::AdamLaunch::chunks)
      .def_readwrite("records", &shardamp::AdamLaunch::records)
      .def_readwrite("record_offset", &shardamp::AdamLaunch::record_offset)
      .def_readwrite("shape", &shardamp::AdamLaunch::shape)
      .def_readwrite("segment_spans", &shardamp::AdamLaunch::segment_spans)
      .def_readwrite("group_chunks", &shardamp::AdamLaunch::group_chunks)
      .def("set_held", [](shardamp::AdamLaunch& l, const shardamp::HeldParts& held) {
             l.part_grads = held.grads;
             l.part_offsets = held.offsets;
           }, "The next launch's grads where autograd left them (a HeldParts): each at its offset in the shard, grad "
              "then an empty tensor of their dtype (CUDA: read per segment, segment_spans set); dropped after the "
              "launch", py::arg("held"));
  m.def("adam_launch", &adam_launch, "adam_step over a prepared AdamLaunch", py::arg("launch"));
  m.def("adam_launch_all", &adam_launch_all,
        "adam_launch over each prepared launch in turn with its grad and the step's hparams, touched, found_inf and "
        "records; every launch's grad is released afterwards",
        py::arg("launches"), py::arg("grads"), py::arg("hparams"), py::arg("touched"), py::arg("found_inf"),
        py::arg("records"), py::arg("prepare") = py::none());
  m.def("stats_cat_finish", &stats_cat_finish,
        "stats_finish over torch.cat(parts) (one process: nothing reduces between): [stats, norm, found_inf, *views]",
        py::arg("parts"), py::arg("end"), py::arg("norm_type"), py::arg("views"));
  m.def("step_launch", &step_launch,
        "step_scalars with the step's health, then adam_launch_all skipping on skip_out: the one-shard-rank step in one "
        "call (positional arguments: step_scalars', then launches, grads, hparams, prepare, records)");
  m.def("stats_step", &stats_step,
        "stats_cat_finish, then step_launch over its results (touched, the ranks count and the group partials: "
        "views of the stats; no clip), each launch's group partials formed before its step: a one-process step "
        "whose stats nothing asked for before it, in one call; returns [stats, norm, found_inf, *views] "
        "(positional arguments)");
}

}  // namespace shardamp
