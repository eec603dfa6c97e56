// Python entry points of the fused kernels: argument checks, the chunk table, and dispatch to
// the CPU build (per CPU capability) or the CUDA build. Contract: optim/kernels/reference.py.

#include <torch/extension.h>

#include "common.h"
#include "land_grads.h"

namespace shardamp {

namespace cpu {
void grad_stats(const at::Tensor& grad, at::Tensor& out, double norm_type);
void adam_step(const AdamArgs& args, const at::Tensor& chunks);
void step_scalars(at::Tensor& coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor& steps, const at::Tensor& touched);
void stats_finish(at::Tensor& stats, int64_t end, bool sqrt_root, at::Tensor& out);
}  // namespace cpu

#if defined(SHARDAMP_WITH_CUDA)
namespace cuda {
void grad_stats(const at::Tensor& grad, at::Tensor& out, double norm_type);
void adam_step(const AdamArgs& args, const at::Tensor& chunks, const c10::optional<at::Tensor>& records,
               int64_t record_offset, int64_t shape);
at::Tensor adam_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                        const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                        bool bias_correction);
void step_scalars(at::Tensor& coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor& steps, const at::Tensor& touched);
void stats_finish(at::Tensor& stats, int64_t end, bool sqrt_root, at::Tensor& out);
int64_t event_query_relaxed(int64_t handle);  // event_query.cu
void grad_stats_after(int64_t side, const at::Tensor& grad, at::Tensor& out,
                      const c10::optional<at::Tensor>& zero_first, double norm_type);  // grad_stats.cu
}  // namespace cuda
#endif

void register_grad_stager(py::module& m);  // grad_stager.cpp

namespace {

#define SHARDAMP_STR2(x) #x
#define SHARDAMP_STR(x) SHARDAMP_STR2(x)
#if defined(CPU_CAPABILITY)
const char* cpu_capability() { return SHARDAMP_STR(CPU_CAPABILITY); }
#else
const char* cpu_capability() { return "DEFAULT"; }
#endif

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  SHARDAMP_CHECK(t.device() == ref.device(), "adam_step: ", name, " is on ", t.device(), ", grad on ", ref.device());
}

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

#if defined(SHARDAMP_WITH_CUDA)
// grad_stats on the side stream ``side`` (a cudaStream_t as an integer) after it has joined the
// current one, zeroing ``zero_first`` there first (cuda/grad_stats.cu): CUDA tensors only.
void grad_stats_after(int64_t side, const at::Tensor& grad, at::Tensor out, const c10::optional<at::Tensor>& zero_first,
                      double norm_type) {
  check_stats_args(grad, out, norm_type);
  SHARDAMP_CHECK(grad.is_cuda() && side != 0, "grad_stats_after: CUDA tensors and a side stream only");
  if (zero_first) check_same_device(grad, *zero_first, "zero_first");
  try {
    cuda::grad_stats_after(side, grad, out, zero_first, norm_type);
  } catch (const c10::Error& e) {  // a c10::Error leaving the extension can kill Python (common.h)
    throw std::runtime_error(e.what_without_backtrace());
  }
}
#endif

// The step's scalar inputs, shared by adam_step and adam_prepare: hparams fp64 [G, 5]; steps,
// touched (one per param), grad_coef and found_inf (one element) contiguous, of a supported
// dtype, on ``ref``'s device.
void check_step_scalars(const at::Tensor& ref, const at::Tensor& hparams, const at::Tensor& steps,
                        const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                        const char* fn) {
  SHARDAMP_CHECK(hparams.scalar_type() == at::kDouble && hparams.dim() == 2 && hparams.size(1) == 5 &&
                     hparams.is_contiguous(),
                 fn, ": hparams must be a contiguous fp64 [G, 5] tensor");
  check_same_device(ref, hparams, "hparams");
  const std::pair<const at::Tensor*, const char*> scalars[] = {
      {&steps, "steps"}, {&touched, "touched"}, {&grad_coef, "grad_coef"}, {&found_inf, "found_inf"}};
  for (const auto& [t, name] : scalars) {
    check_same_device(ref, *t, name);
    SHARDAMP_CHECK(t->is_contiguous(), fn, ": ", name, " must be contiguous");
    (void)scalar_code(*t);  // rejects unsupported dtypes before any kernel runs
  }
  SHARDAMP_CHECK(grad_coef.numel() == 1 && found_inf.numel() == 1, fn, ": grad_coef and found_inf must hold one element");
  SHARDAMP_CHECK(touched.numel() == steps.numel(), fn, ": touched and steps must have one entry per param");
}

void adam_step(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& model_out,
               const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
               const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
               bool adam_w_mode, bool bias_correction, const c10::optional<at::Tensor>& chunks,
               const c10::optional<at::Tensor>& records, int64_t record_offset, int64_t shape) {
  SHARDAMP_CHECK(is_float_type(grad.scalar_type()), "adam_step: grad must be fp32/bf16/fp16, got ", grad.scalar_type());
  SHARDAMP_CHECK(grad.is_contiguous(), "adam_step: grad must be contiguous");
  SHARDAMP_CHECK(master.scalar_type() == at::kFloat || master.scalar_type() == at::kShort,
                 "adam_step: master must be fp32, or int16 remainders under a bf16 model_out (got ",
                 master.scalar_type(), "); other master dtypes go through the reference (optim/kernels/dispatch.py)");
  SHARDAMP_CHECK(is_moment_type(exp_avg.scalar_type()) && is_moment_type(exp_avg_sq.scalar_type()),
                 "adam_step: exp_avg / exp_avg_sq must be fp32 or bf16 (got ", exp_avg.scalar_type(), "/",
                 exp_avg_sq.scalar_type(), "); other dtypes go through the reference (optim/kernels/dispatch.py)");
  SHARDAMP_CHECK(master.scalar_type() != at::kShort || (model_out && model_out->scalar_type() == at::kBFloat16),
                 "adam_step: int16 master remainders need model_out in bf16 (the masters' high halves)");
  check_flat(grad, master, "master");
  check_flat(grad, exp_avg, "exp_avg");
  check_flat(grad, exp_avg_sq, "exp_avg_sq");
  if (model_out) {
    SHARDAMP_CHECK(is_float_type(model_out->scalar_type()), "adam_step: model_out must be fp32/bf16/fp16, got ",
                model_out->scalar_type());
    check_flat(grad, *model_out, "model_out");
  }
  SHARDAMP_CHECK(segments.is_contiguous(), "adam_step: segments must be contiguous");
  check_same_device(grad, segments, "segments");
  check_step_scalars(grad, hparams, steps, touched, grad_coef, found_inf, "adam_step");
  if (records) {  // adam_prepare's records of several shards: this shard's start at record_offset
    check_same_device(grad, *records, "records");
    SHARDAMP_CHECK(records->scalar_type() == at::kFloat && records->is_contiguous() && record_offset >= 0 &&
                       (record_offset + segments.size(0)) * kRecordFloats <= records->numel(),
                   "adam_step: records must be adam_prepare's result over a table holding this shard's ",
                   segments.size(0), " segments from record_offset ", record_offset);
  }

  AdamArgs args{grad, master, exp_avg, exp_avg_sq, model_out, segments, hparams, steps, touched, grad_coef,
                found_inf, adam_w_mode, bias_correction};
  // Without a cached table, build one now: correct, but it copies the segments to the host.
  at::Tensor table = chunks ? *chunks
                            : build_chunks(segments, grad.numel(), steps.numel(), hparams.size(0),
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

// One prepare launch for the segments of several shards (CUDA): the fp64-derived scalars and skip
// flag of every row of `segments` (int64 [S, 4]: only the param and group columns are read; the
// caller validated them on the host, optim/kernels/dispatch.py), kRecordFloats floats each, for adam_step's
// `records` argument.
at::Tensor adam_prepare(const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                        const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                        bool bias_correction) {
  SHARDAMP_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 4 &&
                     segments.is_contiguous(),
                 "adam_prepare: segments must be a contiguous int64 [S, 4] tensor");
  check_step_scalars(segments, hparams, steps, touched, grad_coef, found_inf, "adam_prepare");
#if defined(SHARDAMP_WITH_CUDA)
  SHARDAMP_CHECK(segments.is_cuda(), "adam_prepare: CUDA tensors only (the CPU step forms its scalars per chunk)");
  return cuda::adam_prepare(segments, hparams, steps, touched, grad_coef, found_inf, bias_correction);
#else
  SHARDAMP_CHECK(false, "adam_prepare: this build of the shardamp kernels has no CUDA support");
#endif
}

// The step's scalars in one launch (optim/kernels/dispatch.py checks dtypes and devices before calling:
// fp32 everywhere, one device; these checks are the backstop).
void step_scalars(at::Tensor coef_out, const at::Tensor& base, double scale, const c10::optional<at::Tensor>& norm,
                  double max_norm, const at::Tensor& found_inf, at::Tensor steps, const at::Tensor& touched) {
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
  if (coef_out.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    return cuda::step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched);
#else
    SHARDAMP_CHECK(false, "step_scalars: this build of the shardamp kernels has no CUDA support");
#endif
  }
  SHARDAMP_CHECK(coef_out.is_cpu(), "step_scalars: unsupported device ", coef_out.device());
  cpu::step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched);
}

// The reduced stats' header and touched flags in one launch (optim/kernels/dispatch.py checks first;
// these checks are the backstop): out = [norm, found_inf], stats[2:end] clamped to <= 1.
void stats_finish(at::Tensor stats, int64_t end, double norm_type, at::Tensor out) {
  SHARDAMP_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && out.scalar_type() == at::kFloat &&
                     out.is_contiguous() && out.numel() == 2 && out.device() == stats.device(),
                 "stats_finish: stats and out must be contiguous fp32 tensors on one device, out of 2 elements");
  SHARDAMP_CHECK(end >= 2 && end <= stats.numel(), "stats_finish: end must lie in [2, stats.numel()]");
  SHARDAMP_CHECK(norm_type == 2.0 || std::isinf(norm_type), "stats_finish: norm_type must be 2 or inf");
  const bool sqrt_root = norm_type == 2.0;
  if (stats.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    return cuda::stats_finish(stats, end, sqrt_root, out);
#else
    SHARDAMP_CHECK(false, "stats_finish: this build of the shardamp kernels has no CUDA support");
#endif
  }
  SHARDAMP_CHECK(stats.is_cpu(), "stats_finish: unsupported device ", stats.device());
  cpu::stats_finish(stats, end, sqrt_root, out);
}

// One bucket's step launch as a named structure (Python: kernels.AdamLaunch builds it once per
// bucket). The shard's tensors, the persistent step scalars and the flags are set at
// construction; what changes between steps (the grad shard, released between steps; touched,
// found_inf, the records row, the chunk map and launch shape) is assigned before each launch. Every launch is validated as adam_step is.
struct AdamLaunch {
  at::Tensor grad, master, exp_avg, exp_avg_sq;
  c10::optional<at::Tensor> model_out;
  at::Tensor segments, hparams, steps, touched, grad_coef, found_inf;
  bool adam_w_mode = true;
  bool bias_correction = true;
  c10::optional<at::Tensor> chunks, records;
  int64_t record_offset = 0;
  int64_t shape = 0;
};

void adam_launch(const AdamLaunch& l) {
  adam_step(l.grad, l.master, l.exp_avg, l.exp_avg_sq, l.model_out, l.segments, l.hparams, l.steps, l.touched,
            l.grad_coef, l.found_inf, l.adam_w_mode, l.bias_correction, l.chunks, l.records, l.record_offset,
            l.shape);
}

// The per-step "do the model params still live in the buffers" check (optim/shards/buffers.py): true
// iff every param has its ref's data pointer, dtype, sizes and strides and no .grad. (Python
// re-checks in detail, to name the param, whenever this says false.)
bool same_view(const at::Tensor& p, const at::Tensor& r) {
  return p.data_ptr() == r.data_ptr() && p.scalar_type() == r.scalar_type() && p.sizes() == r.sizes() &&
         p.strides() == r.strides() && !p.grad().defined();
}

// The refs are held here (the optimizer's, fixed at construction) and the params read from the
// Python list as they are (no conversion into a vector of tensors: converting two lists was
// most of the check's time, 14.8 against 3.4 us a step for 161 params on the CPU). Each param is
// unpacked from its Python object every call, so a param whose object now holds another tensor
// is seen.
class ViewCheck {
 public:
  explicit ViewCheck(std::vector<at::Tensor> refs) : refs_(std::move(refs)) {}
  bool intact(const py::list& params) const {
    if (static_cast<size_t>(py::len(params)) != refs_.size()) return false;
    for (size_t i = 0; i < refs_.size(); ++i) {
      PyObject* obj = PyList_GET_ITEM(params.ptr(), static_cast<Py_ssize_t>(i));
      if (!THPVariable_Check(obj) || !same_view(THPVariable_Unpack(obj), refs_[i])) return false;
    }
    return true;
  }

 private:
  std::vector<at::Tensor> refs_;
};

}  // namespace
}  // namespace shardamp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "shardamp fused kernels: grad_stats and adam_step (contract: shardamp/optim/kernels/reference.py)";
  m.def("grad_stats", &shardamp::grad_stats, "Accumulate sum|g|^p (or max|g|) and a non-finite flag into out[2]",
        py::arg("grad"), py::arg("out"), py::arg("norm_type"));
  m.def("adam_step", &shardamp::adam_step, "Fused Adam/AdamW step over the segments of a shard",
        py::arg("grad"), py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("model_out"),
        py::arg("segments"), py::arg("hparams"), py::arg("steps"), py::arg("touched"), py::arg("grad_coef"),
        py::arg("found_inf"), py::arg("adam_w_mode"), py::arg("bias_correction"), py::arg("chunks") = py::none(),
        py::arg("records") = py::none(), py::arg("record_offset") = 0, py::arg("shape") = 0);
  py::class_<shardamp::AdamLaunch>(m, "AdamLaunch", "One bucket's step launch: adam_step's arguments by name")
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
      .def_readwrite("shape", &shardamp::AdamLaunch::shape);
  m.def("adam_launch", &shardamp::adam_launch, "adam_step over a prepared AdamLaunch", py::arg("launch"));
  m.def("adam_prepare", &shardamp::adam_prepare,
        "CUDA: the step's per-segment records of several shards in one launch (adam_step's records)",
        py::arg("segments"), py::arg("hparams"), py::arg("steps"), py::arg("touched"), py::arg("grad_coef"),
        py::arg("found_inf"), py::arg("bias_correction"));
  m.def("build_chunks", &shardamp::build_chunks,
        "Chunk table (int64 [C, 2], host) for adam_step, from a segments table; validates the table",
        py::arg("segments"), py::arg("numel"), py::arg("num_params"), py::arg("num_groups"), py::arg("chunk") = 0);
  m.def("land_grads", &shardamp::land_grads, "Copy (or add) grads into their slots of a flat bucket buffer (byte ranges where the layouts match)",
        py::arg("full"), py::arg("grads"), py::arg("like"), py::arg("offsets"), py::arg("accumulate"));
  m.def("step_scalars", &shardamp::step_scalars,
        "coef_out = base * scale * clip_coef(max_norm, norm); steps += touched * (1 - found_inf)",
        py::arg("coef_out"), py::arg("base"), py::arg("scale"), py::arg("norm"), py::arg("max_norm"),
        py::arg("found_inf"), py::arg("steps"), py::arg("touched"));
  m.def("stats_finish", &shardamp::stats_finish,
        "out = [root(stats[0]), found_inf]; stats[2:end] clamped to <= 1 (norm_type 2 or inf)",
        py::arg("stats"), py::arg("end"), py::arg("norm_type"), py::arg("out"));
  py::class_<shardamp::ViewCheck>(m, "ViewCheck",
                                  "intact(params: list): params still are their buffer views (pointer, dtype, shape, "
                                  "strides) without .grad")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("refs"))
      .def("intact", &shardamp::ViewCheck::intact, py::arg("params"));
  shardamp::register_grad_stager(m);
#if defined(SHARDAMP_WITH_CUDA)
  m.def("grad_stats_after", &shardamp::grad_stats_after,
        "grad_stats on a side stream once it has joined the current one, zeroing zero_first there first",
        py::arg("side"), py::arg("grad"), py::arg("out"), py::arg("zero_first"), py::arg("norm_type"));
  m.def("event_query_relaxed", &shardamp::cuda::event_query_relaxed,
        "cudaEventQuery in relaxed capture mode (safe while another thread captures): 1 done, 0 not yet, -1 error",
        py::arg("handle"));
#endif
  m.attr("CHUNK") = shardamp::kChunk;
  m.attr("CUDA_CHUNK") = shardamp::kCudaChunk;
  m.def("cpu_capability", &shardamp::cpu_capability, "Which CPU kernel build runs here");
  m.attr("WITH_CUDA") =
#if defined(SHARDAMP_WITH_CUDA)
      true;
#else
      false;
#endif
}
