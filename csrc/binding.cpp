// Python entry points of the fused kernels: argument checks, the chunk table, and dispatch to
// the CPU build (per CPU capability) or the CUDA build. Contract: optim/kernels/reference.py.

#include <torch/extension.h>

#include <limits>
#include <utility>
#include <vector>

#include "common.h"
#include "land_grads.h"
#include "fused_step.h"
#include "grad_parts.h"
#include "segment_record.h"
#include "step_scalars.h"
#include "view_check.h"

namespace shardamp {

namespace cpu {
void grad_stats(const at::Tensor& grad, at::Tensor& out, double norm_type);
void adam_step(const AdamArgs& args, const at::Tensor& chunks);
void step_scalars(at::Tensor& coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor& steps, const at::Tensor& touched,
                  const StepHealth* health);
void nonfinite_flags(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags);
void bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags, at::Tensor& out, bool assign);
void group_partials(const at::Tensor& grad, const at::Tensor& segments, at::Tensor& out, double norm_type);
const char* capability();  // fused_adam_cpu.cpp: the vector ISA the module's CPU kernels were built for
}  // namespace cpu

#if defined(SHARDAMP_WITH_CUDA)
namespace cuda {
void grad_stats(const at::Tensor& grad, at::Tensor& out, double norm_type);
void adam_step(const AdamArgs& args, const at::Tensor& chunks, const c10::optional<at::Tensor>& records,
               int64_t record_offset, int64_t shape);
void step_scalars(at::Tensor& coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor& steps, const at::Tensor& touched,
                  const StepHealth* health);
void nonfinite_flags(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags);  // grad_stats.cu
void bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags, at::Tensor& out,
                  bool assign);  // grad_stats.cu
void group_partials(const at::Tensor& grad, const at::Tensor& segments, at::Tensor& out, double norm_type,
                    const at::Tensor& chunks);  // grad_stats.cu
int64_t event_query_relaxed(int64_t handle);  // event_query.cu
}  // namespace cuda
#endif

void register_grad_stager(py::module& m);  // grad_stager.cpp

namespace {

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* name, const char* fn = "adam_step",
                       const char* ref_name = "grad") {
  SHARDAMP_CHECK(t.device() == ref.device(), fn, ": ", name, " is on ", t.device(), ", ", ref_name, " on ", ref.device());
}

// The kernels read a segment's record as three float4: 16-byte aligned records.
bool records_aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_flat(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  check_same_device(ref, t, name);
  SHARDAMP_CHECK(t.is_contiguous(), "adam_step: ", name, " must be contiguous");
  SHARDAMP_CHECK(t.numel() == ref.numel(), "adam_step: ", name, " has ", t.numel(), " elements, grad ", ref.numel());
}

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }
bool is_moment_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// Splits every segment into chunks of at most `chunk` elements (default kChunk): rows (start, seg << 32 | len).
// Runs on the host from a host copy of the table (kernels.py caches the result per table, so
// only a table's first use pays the device-to-host copy). Also the place where the table is
// checked against the shard it indexes.
at::Tensor build_chunks(const at::Tensor& segments, int64_t numel, int64_t num_params, int64_t num_groups,
                        int64_t chunk) {
  if (chunk <= 0) chunk = kChunk;
  SHARDAMP_CHECK(chunk < (int64_t(1) << 32), "build_chunks: chunk must fit 32 bits");
  SHARDAMP_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 4,
              "segments must be an int64 [S, 4] tensor, got ", segments.scalar_type(), " ", segments.sizes());
  const at::Tensor t = segments.to(at::kCPU).contiguous();
  const int64_t* s = t.data_ptr<int64_t>();
  const int64_t nseg = t.size(0);
  SHARDAMP_CHECK(nseg < (int64_t(1) << 31), "too many segments");
  int64_t total = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t start = s[4 * i], len = s[4 * i + 1], param = s[4 * i + 2], group = s[4 * i + 3];
    SHARDAMP_CHECK(start >= 0 && len >= 0 && start + len <= numel, "segment ", i, " [", start, ", ", start + len,
                ") lies outside the shard of ", numel, " elements");
    SHARDAMP_CHECK(param >= 0 && param < num_params, "segment ", i, ": param_index ", param, " out of range [0, ",
                num_params, ")");
    SHARDAMP_CHECK(group >= 0 && group < num_groups, "segment ", i, ": group ", group, " out of range [0, ",
                num_groups, ")");
    total += (len + chunk - 1) / chunk;
  }
  at::Tensor chunks = at::empty({total, 2}, at::kLong);
  int64_t* c = chunks.data_ptr<int64_t>();
  for (int64_t i = 0, k = 0; i < nseg; ++i) {
    const int64_t start = s[4 * i], len = s[4 * i + 1];
    for (int64_t off = 0; off < len; off += chunk, ++k) {
      c[2 * k] = start + off;
      c[2 * k + 1] = (i << 32) | std::min(chunk, len - off);
    }
  }
  return chunks;
}

void check_stats_args(const at::Tensor& grad, const at::Tensor& out, double norm_type) {
  SHARDAMP_CHECK(is_float_type(grad.scalar_type()), "grad_stats: grad must be fp32/bf16/fp16, got ",
              grad.scalar_type());
  SHARDAMP_CHECK(grad.is_contiguous(), "grad_stats: grad must be contiguous");
  SHARDAMP_CHECK(out.scalar_type() == at::kFloat && out.numel() == 2 && out.is_contiguous(),
              "grad_stats: out must be a contiguous fp32 tensor of 2 elements");
  SHARDAMP_CHECK(out.device() == grad.device(), "grad_stats: out is on ", out.device(), ", grad on ", grad.device());
  SHARDAMP_CHECK(!std::isnan(norm_type), "grad_stats: norm_type is NaN");
}

void grad_stats(const at::Tensor& grad, at::Tensor out, double norm_type) {
  check_stats_args(grad, out, norm_type);
  if (grad.numel() == 0) return;
  if (grad.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    return cuda::grad_stats(grad, out, norm_type);
#else
    SHARDAMP_CHECK(false, "grad_stats: this build of the shardamp kernels has no CUDA support");
#endif
  }
  SHARDAMP_CHECK(grad.is_cpu(), "grad_stats: unsupported device ", grad.device());
  cpu::grad_stats(grad, out, norm_type);
}


// The step's scalar inputs, shared by adam_step and adam_prepare: hparams fp64 [G, 5]; steps,
// touched (one per param), grad_coef and found_inf (one element) contiguous, of a supported
// dtype, on ``ref``'s device (``ref_name``: what the error calls it).
void check_step_scalars(const at::Tensor& ref, const at::Tensor& hparams, const at::Tensor& steps,
                        const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                        const char* fn, const char* ref_name) {
  SHARDAMP_CHECK(hparams.scalar_type() == at::kDouble && hparams.dim() == 2 && hparams.size(1) == 5 &&
                     hparams.is_contiguous(),
                 fn, ": hparams must be a contiguous fp64 [G, 5] tensor");
  check_same_device(ref, hparams, "hparams", fn, ref_name);
  const std::pair<const at::Tensor*, const char*> scalars[] = {
      {&steps, "steps"}, {&touched, "touched"}, {&grad_coef, "grad_coef"}, {&found_inf, "found_inf"}};
  for (const auto& [t, name] : scalars) {
    check_same_device(ref, *t, name, fn, ref_name);
    SHARDAMP_CHECK(t->is_contiguous(), fn, ": ", name, " must be contiguous");
    (void)scalar_code(*t);  // rejects unsupported dtypes before any kernel runs
  }
  SHARDAMP_CHECK(grad_coef.numel() == 1 && found_inf.numel() == 1, fn, ": grad_coef and found_inf must hold one element");
  SHARDAMP_CHECK(touched.numel() == steps.numel(), fn, ": touched and steps must have one entry per param");
}

// ``parts``: the grads where autograd left them (grad_parts.h), ``grad`` an empty tensor of their
// dtype; the state's sizes are then checked against ``master``. CUDA reads them per segment:
// ``spans`` are the segments' (start, length) on the host (AdamLaunch::segment_spans).
void adam_step_of(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& model_out,
                  const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                  const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                  bool adam_w_mode, bool bias_correction, const c10::optional<at::Tensor>& chunks,
                  const c10::optional<at::Tensor>& records, int64_t record_offset, int64_t shape,
                  const std::vector<GradPart>* parts, const std::vector<int64_t>* spans = nullptr) {
  SHARDAMP_CHECK(is_float_type(grad.scalar_type()), "adam_step: grad must be fp32/bf16/fp16, got ", grad.scalar_type());
  SHARDAMP_CHECK(grad.is_contiguous(), "adam_step: grad must be contiguous");
  SHARDAMP_CHECK(parts == nullptr || (grad.numel() == 0 && grad.device() == master.device()),
                 "adam_step: grad parts come with an empty grad of their dtype on the state's device");
  const at::Tensor& ref = parts == nullptr ? grad : master;  // what the state's sizes are checked against
  SHARDAMP_CHECK(master.scalar_type() == at::kFloat || master.scalar_type() == at::kShort,
                 "adam_step: master must be fp32, or int16 remainders under a bf16 model_out (got ",
                 master.scalar_type(), "); other master dtypes go through the reference (optim/kernels/dispatch.py)");
  SHARDAMP_CHECK(is_moment_type(exp_avg.scalar_type()) && is_moment_type(exp_avg_sq.scalar_type()),
                 "adam_step: exp_avg / exp_avg_sq must be fp32 or bf16 (got ", exp_avg.scalar_type(), "/",
                 exp_avg_sq.scalar_type(), "); other dtypes go through the reference (optim/kernels/dispatch.py)");
  SHARDAMP_CHECK(master.scalar_type() != at::kShort || (model_out && model_out->scalar_type() == at::kBFloat16),
                 "adam_step: int16 master remainders need model_out in bf16 (the masters' high halves)");
  check_flat(ref, master, "master");
  check_flat(ref, exp_avg, "exp_avg");
  check_flat(ref, exp_avg_sq, "exp_avg_sq");
  if (model_out) {
    SHARDAMP_CHECK(is_float_type(model_out->scalar_type()), "adam_step: model_out must be fp32/bf16/fp16, got ",
                model_out->scalar_type());
    check_flat(ref, *model_out, "model_out");
  }
  SHARDAMP_CHECK(segments.is_contiguous(), "adam_step: segments must be contiguous");
  check_same_device(grad, segments, "segments");
  check_step_scalars(grad, hparams, steps, touched, grad_coef, found_inf, "adam_step", "grad");
  if (records) {  // adam_prepare's records of several shards: this shard's start at record_offset
    check_same_device(grad, *records, "records");
    SHARDAMP_CHECK(records->scalar_type() == at::kFloat && records->is_contiguous() && records_aligned(*records) &&
                       record_offset >= 0 && (record_offset + segments.size(0)) * kRecordFloats <= records->numel(),
                   "adam_step: records must be adam_prepare's result over a table holding this shard's ",
                   segments.size(0), " segments from record_offset ", record_offset);
  }

  AdamArgs args{grad, master, exp_avg, exp_avg_sq, model_out, segments, hparams, steps, touched, grad_coef,
                found_inf, adam_w_mode, bias_correction, parts};
  std::vector<const void*> bases;
  if (parts != nullptr && grad.is_cuda()) {
    SHARDAMP_CHECK(spans != nullptr && static_cast<int64_t>(spans->size()) == 2 * segments.size(0),
                   "adam_step: CUDA grads read in place need each segment's (start, length) on the host (the "
                   "launch's segment_spans: ", segments.size(0), " segments)");
    bases = segment_bases(*parts, *spans, grad.scalar_type(), "adam_step");
    args.parts = nullptr;
    args.bases = &bases;
  }
  // Without a cached table, build one now: correct, but it copies the segments to the host.
  at::Tensor table = chunks ? *chunks
                            : build_chunks(segments, ref.numel(), steps.numel(), hparams.size(0),
                                           grad.is_cuda() ? kCudaChunk : kChunk);
  SHARDAMP_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 2 && table.is_contiguous(),
              "adam_step: chunks must be a contiguous int64 [C, 2] tensor from build_chunks");
  if (grad.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    if (!table.is_cuda()) table = table.to(grad.device());
    check_same_device(grad, table, "chunks");
    return cuda::adam_step(args, table, records, record_offset, shape);
#else
    SHARDAMP_CHECK(false, "adam_step: this build of the shardamp kernels has no CUDA support");
#endif
  }
  SHARDAMP_CHECK(grad.is_cpu(), "adam_step: unsupported device ", grad.device());
  SHARDAMP_CHECK(table.is_cpu(), "adam_step: chunks for CPU tensors must be on the CPU");
  cpu::adam_step(args, table);  // forms each chunk's scalars itself: records and shape are CUDA's
}

void adam_step(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& model_out,
               const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
               const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
               bool adam_w_mode, bool bias_correction, const c10::optional<at::Tensor>& chunks,
               const c10::optional<at::Tensor>& records, int64_t record_offset, int64_t shape) {
  adam_step_of(grad, master, exp_avg, exp_avg_sq, model_out, segments, hparams, steps, touched, grad_coef, found_inf,
               adam_w_mode, bias_correction, chunks, records, record_offset, shape, nullptr);
}

}  // namespace

// step_scalars' checks of its arguments, and the health they describe (unused without skip_out)
StepHealth checked_step_health(const at::Tensor& coef_out, const at::Tensor& base,
                               const c10::optional<at::Tensor>& norm, const at::Tensor& found_inf,
                               const at::Tensor& steps, const at::Tensor& touched,
                               const c10::optional<at::Tensor>& skip_out, const c10::optional<at::Tensor>& raw_norm,
                               const c10::optional<at::Tensor>& inv_scale, double avg, double skip_above,
                               const c10::optional<at::Tensor>& counters, const c10::optional<at::Tensor>& record,
                               const c10::optional<at::Tensor>& ranks, const c10::optional<at::Tensor>& record_host,
                               const c10::optional<at::Tensor>& spare) {
  auto check = [&](const at::Tensor& t, const char* name, int64_t numel) {
    SHARDAMP_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == coef_out.device(),
                   "step_scalars: ", name, " must be a contiguous fp32 tensor on ", coef_out.device());
    SHARDAMP_CHECK(numel < 0 || t.numel() == numel, "step_scalars: ", name, " must hold ", numel, " element(s)");
  };
  check(coef_out, "coef_out", 1);
  check(base, "base", 1);
  if (norm) check(*norm, "norm", 1);
  check(found_inf, "found_inf", 1);
  check(steps, "steps", -1);
  check(touched, "touched", steps.numel());
  StepHealth health{nullptr, nullptr, nullptr, static_cast<float>(avg), skip_above,
                    nullptr, nullptr, nullptr, false, nullptr, nullptr, 0};
  if (skip_out) {
    SHARDAMP_CHECK(raw_norm.has_value(), "step_scalars: skip_out needs raw_norm");
    check(*skip_out, "skip_out", 1);
    check(*raw_norm, "raw_norm", 1);
    health.skip_out = skip_out->data_ptr<float>();
    health.raw_norm = raw_norm->data_ptr<float>();
    if (inv_scale) {
      check(*inv_scale, "inv_scale", 1);
      health.inv_scale = inv_scale->data_ptr<float>();
    }
    if (counters) {
      SHARDAMP_CHECK(counters->scalar_type() == at::kDouble && counters->is_contiguous() && counters->numel() == 4 &&
                         counters->device() == coef_out.device(),
                     "step_scalars: counters must be a contiguous fp64 tensor of 4 elements on ", coef_out.device());
      health.counters = counters->data_ptr<double>();
    }
    if (record) {
      check(*record, "record", -1);
      SHARDAMP_CHECK(record->numel() == 2 || record->numel() == 4, "step_scalars: record must hold 2 or 4 elements");
      health.record = record->data_ptr<float>();
      health.full_record = record->numel() == 4;
    }
    if (ranks) {
      SHARDAMP_CHECK(health.full_record, "step_scalars: ranks needs a record of 4 elements");
      check(*ranks, "ranks", 1);
      health.ranks = ranks->data_ptr<float>();
    }
    if (record_host) {
      SHARDAMP_CHECK(record.has_value(), "step_scalars: record_host needs a record");
      // page-locked memory: a CUDA kernel writes it itself; other memory gets a copy after the launch
      SHARDAMP_CHECK(record_host->scalar_type() == at::kFloat && record_host->is_contiguous() &&
                         record_host->is_cpu() && record_host->numel() == record->numel(),
                     "step_scalars: record_host must be a contiguous fp32 CPU tensor of the record's size");
      health.record_host = record_host->data_ptr<float>();
    }
    if (spare) {
      check(*spare, "spare", -1);
      health.spare = spare->data_ptr<float>();
      health.spare_count = spare->numel();
    }
  } else {
    SHARDAMP_CHECK(!counters && !record && !ranks && !record_host && !spare,
                   "step_scalars: counters, record, ranks, record_host and spare need skip_out");
  }
  return health;
}

namespace {

// The step's scalars in one launch (optim/kernels/dispatch.py checks dtypes and devices before calling:
// fp32 everywhere, one device; these checks are the backstop).
// With ``skip_out`` the same launch decides the step's skip (found-inf or a norm spike above
// ``skip_above``) and updates the health ``counters`` (fp64 [4]) and ``record`` (fp32 [2], or [4] with the ranks and inverse scale).
void step_scalars(at::Tensor coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor steps, const at::Tensor& touched,
                  const c10::optional<at::Tensor>& skip_out, const c10::optional<at::Tensor>& raw_norm,
                  const c10::optional<at::Tensor>& inv_scale, double avg, double skip_above,
                  const c10::optional<at::Tensor>& counters, const c10::optional<at::Tensor>& record,
                  const c10::optional<at::Tensor>& ranks, const c10::optional<at::Tensor>& record_host,
                  const c10::optional<at::Tensor>& spare) {
  const StepHealth health = checked_step_health(coef_out, base, norm, found_inf, steps, touched, skip_out, raw_norm,
                                                inv_scale, avg, skip_above, counters, record, ranks, record_host,
                                                spare);
  const StepHealth* h = skip_out ? &health : nullptr;
  if (coef_out.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    return cuda::step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, h);
#else
    SHARDAMP_CHECK(false, "step_scalars: this build of the shardamp kernels has no CUDA support");
#endif
  }
  SHARDAMP_CHECK(coef_out.is_cpu(), "step_scalars: unsupported device ", coef_out.device());
  cpu::step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, h);
}

void check_flag_args(const at::Tensor& full, const at::Tensor& rows, const at::Tensor& flags, const char* op) {
  SHARDAMP_CHECK(is_float_type(full.scalar_type()) && full.is_contiguous(), op,
                 ": full must be a contiguous fp32/bf16/fp16 tensor");
  SHARDAMP_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 2 && rows.size(1) == 3 &&
                     rows.device() == full.device(),
                 op, ": rows must be a contiguous int64 [k, 3] tensor on ", full.device());
  SHARDAMP_CHECK(flags.scalar_type() == at::kFloat && flags.is_contiguous() && flags.numel() >= 1 &&
                     flags.device() == full.device(),
                 op, ": flags must be a contiguous fp32 tensor on ", full.device());
  SHARDAMP_CHECK(full.is_cpu() || full.is_cuda(), op, ": unsupported device ", full.device());
#if !defined(SHARDAMP_WITH_CUDA)
  SHARDAMP_CHECK(!full.is_cuda(), op, ": this build of the shardamp kernels has no CUDA support");
#endif
}

// Backward: the per-param non-finite flags of this rank's grads before their reduction
// (optim/step/health.py). flags[rows[i, 2]] = 1 (and flags[-1] = 1) where the row's elements hold
// an inf or NaN.
void nonfinite_flags(const at::Tensor& full, const at::Tensor& rows, at::Tensor flags) {
  check_flag_args(full, rows, flags, "nonfinite_flags");
#if defined(SHARDAMP_WITH_CUDA)
  if (full.is_cuda()) return cuda::nonfinite_flags(full, rows, flags);
#endif
  cpu::nonfinite_flags(full, rows, flags);
}

// Backward at one process: a landed bucket's flags (as nonfinite_flags) and its L2 partial (as
// grad_stats with norm_type 2, assigned to out when ``assign``, else added), in one read pass (one
// launch on CUDA).
void bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor flags, at::Tensor out, bool assign) {
  check_flag_args(full, rows, flags, "bucket_stats");
  check_stats_args(full, out, 2.0);
#if defined(SHARDAMP_WITH_CUDA)
  if (full.is_cuda()) return cuda::bucket_stats(full, rows, flags, out, assign);
#endif
  cpu::bucket_stats(full, rows, flags, out, assign);
}

// Each param group's norm partial of a shard (optim/step/health.py: grad_norms_by_group), from
// its segment table; CUDA also takes the table's chunk map (chunk_table()).
void group_partials(const at::Tensor& grad, const at::Tensor& segments, at::Tensor out, double norm_type,
                    const c10::optional<at::Tensor>& chunks) {
  SHARDAMP_CHECK(is_float_type(grad.scalar_type()) && grad.is_contiguous(),
                 "group_partials: grad must be a contiguous fp32/bf16/fp16 tensor");
  SHARDAMP_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() && segments.dim() == 2 &&
                     segments.size(1) == 4 && segments.device() == grad.device(),
                 "group_partials: segments must be a contiguous int64 [S, 4] tensor on ", grad.device());
  SHARDAMP_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device() == grad.device(),
                 "group_partials: out must be a contiguous fp32 tensor on ", grad.device());
  SHARDAMP_CHECK(!std::isnan(norm_type), "group_partials: norm_type is NaN");
  if (grad.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    SHARDAMP_CHECK(chunks.has_value() && chunks->scalar_type() == at::kLong && chunks->is_contiguous() &&
                       chunks->device() == grad.device(),
                   "group_partials: CUDA needs the segments' chunk map (int64 [C, 2]) on ", grad.device());
    return cuda::group_partials(grad, segments, out, norm_type, *chunks);
#else
    SHARDAMP_CHECK(false, "group_partials: this build of the shardamp kernels has no CUDA support");
#endif
  }
  SHARDAMP_CHECK(grad.is_cpu(), "group_partials: unsupported device ", grad.device());
  cpu::group_partials(grad, segments, out, norm_type);
}
}  // namespace

// stager_state.cpp's planned landing: bucket_stats with the binding's own checks.
void checked_bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor flags, at::Tensor out,
                          bool assign) {
  bucket_stats(full, rows, flags, out, assign);
}
// fused_step.cpp's stats_step: group_partials with the binding's own checks.
void checked_group_partials(const at::Tensor& grad, const at::Tensor& segments, at::Tensor out, double norm_type,
                            const c10::optional<at::Tensor>& chunks) {
  group_partials(grad, segments, out, norm_type, chunks);
}
// fused_step.cpp's merged calls: the same entry points, with the same checks (fused_step.h)
void checked_step_scalars(at::Tensor coef_out, const at::Tensor& base, double scale,
                          const c10::optional<at::Tensor>& norm, double max_norm, const at::Tensor& found_inf,
                          at::Tensor steps, const at::Tensor& touched, const c10::optional<at::Tensor>& skip_out,
                          const c10::optional<at::Tensor>& raw_norm, const c10::optional<at::Tensor>& inv_scale,
                          double avg, double skip_above, const c10::optional<at::Tensor>& counters,
                          const c10::optional<at::Tensor>& record, const c10::optional<at::Tensor>& ranks,
                          const c10::optional<at::Tensor>& record_host, const c10::optional<at::Tensor>& spare) {
  step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, skip_out, raw_norm, inv_scale, avg,
               skip_above, counters, record, ranks, record_host, spare);
}
void checked_adam_step(const AdamLaunch& l, const std::vector<GradPart>* parts) {
  adam_step_of(l.grad, l.master, l.exp_avg, l.exp_avg_sq, l.model_out, l.segments, l.hparams, l.steps, l.touched,
               l.grad_coef, l.found_inf, l.adam_w_mode, l.bias_correction, l.chunks, l.records, l.record_offset,
               l.shape, parts, &l.segment_spans);
}

// adam_prepare's checks of its arguments (fused_step.h).
void check_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                   const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                   const c10::optional<at::Tensor>& out) {
  SHARDAMP_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 4 &&
                     segments.is_contiguous(),
                 "adam_prepare: segments must be a contiguous int64 [S, 4] tensor");
  check_step_scalars(segments, hparams, steps, touched, grad_coef, found_inf, "adam_prepare", "segments");
  if (out) {
    check_same_device(segments, *out, "out", "adam_prepare", "segments");
    SHARDAMP_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && records_aligned(*out) &&
                       out->numel() >= segments.size(0) * kRecordFloats,
                   "adam_prepare: out must be a contiguous, 16-byte aligned fp32 tensor of at least ",
                   segments.size(0) * kRecordFloats, " elements (", kRecordFloats,
                   " a segment): StepRecords.records");
  }
  // last: the checks above are the same on every device (a CPU build tests them)
  SHARDAMP_CHECK(segments.is_cuda(), "adam_prepare: CUDA tensors only (the CPU step forms its scalars per chunk)");
}

// One prepare launch for the segments of several shards (CUDA): the fp64-derived scalars and skip
// flag of every row of `segments` (int64 [S, 4]: only the param and group columns are read; the
// caller validated them on the host, optim/kernels/dispatch.py), kRecordFloats floats each, for adam_step's
// `records` argument: into `out` where given (the optimizer's persistent buffer), else a new tensor.
at::Tensor checked_adam_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                                const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                                bool bias_correction, const c10::optional<at::Tensor>& out) {
  check_prepare(segments, hparams, steps, touched, grad_coef, found_inf, out);
#if defined(SHARDAMP_WITH_CUDA)
  return cuda::adam_prepare(segments, hparams, steps, touched, grad_coef, found_inf, bias_correction, out);
#else
  SHARDAMP_CHECK(false, "adam_prepare: this build of the shardamp kernels has no CUDA support");
#endif
}

void register_bindings(py::module& m);
}  // namespace shardamp

void shardamp::register_bindings(py::module& m) {  // module.cpp's PYBIND11_MODULE calls it
  m.doc() = "shardamp fused kernels: grad_stats and adam_step (contract: shardamp/optim/kernels/reference.py)";
  m.def("grad_stats", &shardamp::grad_stats, "Accumulate sum|g|^p (or max|g|) and a non-finite flag into out[2]",
        py::arg("grad"), py::arg("out"), py::arg("norm_type"));
  m.def("adam_step", &shardamp::adam_step, "Fused Adam/AdamW step over the segments of a shard",
        py::arg("grad"), py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("model_out"),
        py::arg("segments"), py::arg("hparams"), py::arg("steps"), py::arg("touched"), py::arg("grad_coef"),
        py::arg("found_inf"), py::arg("adam_w_mode"), py::arg("bias_correction"), py::arg("chunks") = py::none(),
        py::arg("records") = py::none(), py::arg("record_offset") = 0, py::arg("shape") = 0);
  m.def("adam_prepare", &shardamp::checked_adam_prepare,
        "CUDA: the step's per-segment records of several shards in one launch (adam_step's records)",
        py::arg("segments"), py::arg("hparams"), py::arg("steps"), py::arg("touched"), py::arg("grad_coef"),
        py::arg("found_inf"), py::arg("bias_correction"), py::arg("out") = py::none());
  m.def("build_chunks", &shardamp::build_chunks,
        "Chunk table (int64 [C, 2], host) for adam_step, from a segments table; validates the table",
        py::arg("segments"), py::arg("numel"), py::arg("num_params"), py::arg("num_groups"), py::arg("chunk") = 0);
  m.def("land_grads", &shardamp::land_grads, "Copy (or add) grads into their slots of a flat bucket buffer (byte ranges where the layouts match)",
        py::arg("full"), py::arg("grads"), py::arg("like"), py::arg("offsets"), py::arg("accumulate"),
        py::arg("zero_rest") = false);
  m.def("step_scalars", &shardamp::step_scalars,
        "coef_out = base * scale * clip_coef(max_norm, norm); steps += touched * (1 - skip); with skip_out the "
        "step's skip (found-inf or a norm spike) and the health counters (and spare zeroed)",
        py::arg("coef_out"), py::arg("base"), py::arg("scale"), py::arg("norm"), py::arg("max_norm"),
        py::arg("found_inf"), py::arg("steps"), py::arg("touched"), py::arg("skip_out") = py::none(),
        py::arg("raw_norm") = py::none(), py::arg("inv_scale") = py::none(), py::arg("avg") = 1.0,
        py::arg("skip_above") = std::numeric_limits<double>::infinity(), py::arg("counters") = py::none(),
        py::arg("record") = py::none(), py::arg("ranks") = py::none(), py::arg("record_host") = py::none(),
        py::arg("spare") = py::none());
  m.def("nonfinite_flags", &shardamp::nonfinite_flags,
        "flags[index] = 1 (and flags[-1] = 1) for each (start, length, index) row of full holding an inf or NaN",
        py::arg("full"), py::arg("rows"), py::arg("flags"));
  m.def("bucket_stats", &shardamp::bucket_stats,
        "nonfinite_flags(full, rows, flags) and out (= if assign, else +=) full's L2 partial, in one pass",
        py::arg("full"), py::arg("rows"), py::arg("flags"), py::arg("out"), py::arg("assign"));
  m.def("group_partials", &shardamp::group_partials,
        "out[group] += each param group's norm partial of a shard (sum |g|^p, max for inf)",
        py::arg("grad"), py::arg("segments"), py::arg("out"), py::arg("norm_type"), py::arg("chunks") = py::none());
  m.def("stats_finish", &shardamp::stats_finish,
        "[root(stats[0]), found_inf, *views of stats]; stats[2:end] clamped to <= 1 (norm_type 2 or inf)",
        py::arg("stats"), py::arg("end"), py::arg("norm_type"), py::arg("views"));
  shardamp::register_fused_step(m);  // fused_step.cpp: the one-process step's merged calls
  py::class_<shardamp::ViewCheck>(m, "ViewCheck",
                                  "intact(params: list): params still are their buffer views (pointer, dtype, shape, "
                                  "strides) without .grad")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("refs"))
      .def("intact", &shardamp::ViewCheck::intact, py::arg("params"));
  // the optimizer's step takes torch's record_function wrapper only where something records it
  m.def("record_function_observed", [] { return at::hasCallbacks(); },
        "Whether any RecordFunction callback is registered, global or for this thread (a profiler in any thread, an "
        "execution-trace observer, CUDA memory-history annotations)");
  shardamp::register_grad_stager(m);
#if defined(SHARDAMP_WITH_CUDA)
  m.def("event_query_relaxed", &shardamp::cuda::event_query_relaxed,
        "cudaEventQuery in relaxed capture mode (safe while another thread captures): 1 done, 0 not yet, -1 error",
        py::arg("handle"));
#endif
  m.attr("CHUNK") = shardamp::kChunk;
  m.attr("CUDA_CHUNK") = shardamp::kCudaChunk;
  m.attr("RECORD_FLOATS") = shardamp::kRecordFloats;
  m.def("cpu_capability", &shardamp::cpu::capability, "Which CPU kernel build runs here");
  m.attr("WITH_CUDA") =
#if defined(SHARDAMP_WITH_CUDA)
      true;
#else
      false;
#endif
}
