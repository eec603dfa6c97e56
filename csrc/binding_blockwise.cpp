// Python entry point of the Adam step over blockwise moments ("8bit" / "4bit"): QuantMoment and
// adam_step_blockwise, their argument checks, and dispatch to the CPU or CUDA kernel. Contract:
// optim/kernels/reference.py (adam_step over quant.QuantizedShard); the caller is
// optim/kernels/blockwise.py.

#include <torch/extension.h>

#include <numeric>
#include <utility>

#include "blockwise.h"

namespace shardamp {

namespace cpu {
void adam_step_blockwise(const BlockwiseArgs& args);  // cpu/adam_blockwise_cpu.cpp
}  // namespace cpu

#if defined(SHARDAMP_WITH_CUDA)
namespace cuda {
// cuda/adam_step_blockwise.cu; `units`: int32 [U, 2] segment ranges per unit (blockwise.py)
void adam_step_blockwise(const BlockwiseArgs& args, const at::Tensor& units, const c10::optional<at::Tensor>& records,
                         int64_t record_offset);
}  // namespace cuda
#endif

namespace {

constexpr const char* kFn = "adam_step_blockwise";

bool float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_tensor(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  SHARDAMP_CHECK(t.defined(), kFn, ": ", name, " is missing");
  SHARDAMP_CHECK(t.device() == ref.device(), kFn, ": ", name, " is on ", t.device(), ", grad on ", ref.device());
  SHARDAMP_CHECK(t.is_contiguous(), kFn, ": ", name, " must be contiguous");
}

// A moment's tensors against its kind: a float tensor of n elements, or codes of n elements
// (packed two to a byte at 4 bits), ceil(n / block) fp32 scales, a 2^bits fp32 map and its
// 2^bits - 1 midpoints. Returns the block (0 for a float moment).
int64_t check_moment(const at::Tensor& grad, const QuantMoment& q, const char* name) {
  const int64_t n = grad.numel();
  check_tensor(grad, q.values, name);
  if (q.kind == quant::kFloat32 || q.kind == quant::kBFloat16) {
    const at::ScalarType want = q.kind == quant::kFloat32 ? at::kFloat : at::kBFloat16;
    SHARDAMP_CHECK(q.values.scalar_type() == want && q.values.numel() == n, kFn, ": ", name, " must be ", want,
                   " with ", n, " elements (got ", q.values.scalar_type(), ", ", q.values.numel(), ")");
    return 0;
  }
  SHARDAMP_CHECK(quant::is_codes(static_cast<int>(q.kind)), kFn, ": ", name, ": unknown kind ", q.kind);
  const int bits = q.kind == quant::kCodes8 ? 8 : 4;
  SHARDAMP_CHECK(q.block > 0 && q.block % 2 == 0, kFn, ": ", name, ": block ", q.block, " must be even and > 0");
  const int64_t ncodes = bits == 8 ? n : (n + 1) / 2;
  SHARDAMP_CHECK(q.values.scalar_type() == at::kByte && q.values.numel() == ncodes, kFn, ": ", name,
                 " codes must be uint8 with ", ncodes, " elements");
  const std::pair<const at::Tensor*, const char*> parts[] = {{&q.scales, "scales"}, {&q.map, "map"}, {&q.mids, "mids"}};
  for (const auto& [t, what] : parts) {
    check_tensor(grad, *t, what);
    SHARDAMP_CHECK(t->scalar_type() == at::kFloat, kFn, ": ", name, " ", what, " must be fp32");
  }
  SHARDAMP_CHECK(q.scales.numel() == (n + q.block - 1) / q.block, kFn, ": ", name, " needs one scale per block of ",
                 q.block, " (", (n + q.block - 1) / q.block, "), got ", q.scales.numel());
  SHARDAMP_CHECK(q.map.numel() == (int64_t(1) << bits) && q.mids.numel() == (int64_t(1) << bits) - 1, kFn, ": ",
                 name, ": a ", bits, "-bit map has ", 1 << bits, " values and ", (1 << bits) - 1, " midpoints");
  check_tensor(grad, q.search, "search");
  SHARDAMP_CHECK(q.search.scalar_type() == at::kInt && q.search.numel() == quant::kSearchEntries + 1, kFn, ": ", name,
                 " search must be the int32 table of quant.search_table (", quant::kSearchEntries + 1, " entries)");
  return q.block;
}

// The segment table (CPU tensors: checked against the shard; CUDA: blockwise.py checked the
// host-side rows it built the unit table from, and no step copies a device table back).
void check_segments(const at::Tensor& grad, const at::Tensor& segments, int64_t n_params, int64_t n_groups) {
  check_tensor(grad, segments, "segments");
  SHARDAMP_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 4, kFn,
                 ": segments must be an int64 [S, 4] tensor");
  if (!segments.is_cpu()) return;
  const int64_t* s = segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t start = s[4 * i], len = s[4 * i + 1], param = s[4 * i + 2], group = s[4 * i + 3];
    SHARDAMP_CHECK(start >= 0 && len >= 0 && start + len <= grad.numel(), kFn, ": segment ", i, " [", start, ", ",
                   start + len, ") lies outside the shard of ", grad.numel(), " elements");
    SHARDAMP_CHECK(param >= 0 && param < n_params && group >= 0 && group < n_groups, kFn, ": segment ", i,
                   ": param_index ", param, " / group ", group, " out of range [0, ", n_params, ") / [0, ", n_groups,
                   ")");
  }
}

void adam_step_blockwise(const at::Tensor& grad, const at::Tensor& master, const QuantMoment& exp_avg,
                         const QuantMoment& exp_avg_sq, const c10::optional<at::Tensor>& model_out,
                         const at::Tensor& segments, const at::Tensor& hparams, const at::Tensor& steps,
                         const at::Tensor& touched, const at::Tensor& grad_coef, const at::Tensor& found_inf,
                         bool adam_w_mode, bool bias_correction, const c10::optional<at::Tensor>& units,
                         const c10::optional<at::Tensor>& records, int64_t record_offset) {
  SHARDAMP_CHECK(grad.defined() && float_type(grad.scalar_type()) && grad.is_contiguous(), kFn,
                 ": grad must be a contiguous fp32/bf16/fp16 tensor");
  check_tensor(grad, master, "master");
  SHARDAMP_CHECK(master.numel() == grad.numel(), kFn, ": master has ", master.numel(), " elements, grad ",
                 grad.numel());
  const bool remainders = master.scalar_type() == at::kShort;
  SHARDAMP_CHECK(master.scalar_type() == at::kFloat || remainders, kFn,
                 ": master must be fp32, or int16 remainders under a bf16 model_out (got ", master.scalar_type(), ")");
  if (model_out) {
    check_tensor(grad, *model_out, "model_out");
    SHARDAMP_CHECK(float_type(model_out->scalar_type()) && model_out->numel() == grad.numel(), kFn,
                   ": model_out must be fp32/bf16/fp16 with the grad's ", grad.numel(), " elements");
  }
  SHARDAMP_CHECK(!remainders || (model_out && model_out->scalar_type() == at::kBFloat16), kFn,
                 ": int16 master remainders need model_out in bf16 (the masters' high halves)");
  const int64_t bm = check_moment(grad, exp_avg, "exp_avg"), bv = check_moment(grad, exp_avg_sq, "exp_avg_sq");
  SHARDAMP_CHECK(bm || bv, kFn, ": neither moment is blockwise (adam_step takes float moments)");
  SHARDAMP_CHECK(hparams.scalar_type() == at::kDouble && hparams.dim() == 2 && hparams.size(1) == 5, kFn,
                 ": hparams must be an fp64 [G, 5] tensor");
  check_tensor(grad, hparams, "hparams");
  const std::pair<const at::Tensor*, const char*> scalars[] = {
      {&steps, "steps"}, {&touched, "touched"}, {&grad_coef, "grad_coef"}, {&found_inf, "found_inf"}};
  for (const auto& [t, name] : scalars) {
    check_tensor(grad, *t, name);
    (void)scalar_code(*t);  // rejects unsupported dtypes before any kernel runs
  }
  SHARDAMP_CHECK(grad_coef.numel() == 1 && found_inf.numel() == 1, kFn, ": grad_coef and found_inf hold one element");
  SHARDAMP_CHECK(touched.numel() == steps.numel(), kFn, ": touched and steps must have one entry per param");
  check_segments(grad, segments, steps.numel(), hparams.size(0));

  BlockwiseArgs args{grad, master, exp_avg, exp_avg_sq, model_out, segments, hparams, steps, touched, grad_coef,
                     found_inf, adam_w_mode, bias_correction, std::lcm(bm ? bm : bv, bv ? bv : bm)};
  if (grad.numel() == 0) return;
  if (grad.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
    SHARDAMP_CHECK(units.has_value(), kFn, ": CUDA needs the unit table (optim/kernels/blockwise.py: unit_table)");
    check_tensor(grad, *units, "units");
    SHARDAMP_CHECK(units->scalar_type() == at::kInt && units->dim() == 2 && units->size(1) == 2 &&
                       units->size(0) == (grad.numel() + args.unit - 1) / args.unit,
                   kFn, ": units must be int32 [", (grad.numel() + args.unit - 1) / args.unit, ", 2] for a unit of ",
                   args.unit, " elements");
    if (records) {
      check_tensor(grad, *records, "records");
      SHARDAMP_CHECK(records->scalar_type() == at::kFloat && record_offset >= 0 &&
                         (record_offset + segments.size(0)) * kRecordFloats <= records->numel(),
                     kFn, ": records must be adam_prepare's result over a table holding this shard's ",
                     segments.size(0), " segments from record_offset ", record_offset);
    }
    return cuda::adam_step_blockwise(args, *units, records, record_offset);
#else
    SHARDAMP_CHECK(false, kFn, ": this build of the shardamp kernels has no CUDA support");
#endif
  }
  SHARDAMP_CHECK(grad.is_cpu(), kFn, ": unsupported device ", grad.device());
  cpu::adam_step_blockwise(args);
}

}  // namespace

void register_blockwise(py::module& m) {  // module.cpp calls it
  // module_local: each CPU variant (generic, AVX2, AVX-512) binds it, and an ahead-of-time build's
  // modules can be imported into one process (as AdamLaunch in binding.cpp)
  py::class_<QuantMoment>(m, "QuantMoment", py::module_local(),
                          "One moment as adam_step_blockwise takes it: a float tensor (kind 0 fp32, 1 bf16), or codes "
                          "(kind 2: 8-bit, 3: 4-bit packed) with fp32 block scales, code map, midpoints and their search table")
      .def(py::init([](at::Tensor values, int64_t kind, c10::optional<at::Tensor> scales, c10::optional<at::Tensor> map,
                       c10::optional<at::Tensor> mids, c10::optional<at::Tensor> search, int64_t block) {
             return QuantMoment{values, scales.value_or(at::Tensor()), map.value_or(at::Tensor()),
                                mids.value_or(at::Tensor()), search.value_or(at::Tensor()), kind, block};
           }),
           py::kw_only(), py::arg("values"), py::arg("kind"), py::arg("scales") = py::none(),
           py::arg("map") = py::none(), py::arg("mids") = py::none(), py::arg("search") = py::none(),
           py::arg("block") = 0)
      .def_readonly("kind", &QuantMoment::kind)
      .def_readonly("block", &QuantMoment::block);
  m.def("adam_step_blockwise", &adam_step_blockwise,
        "Fused Adam/AdamW step over the segments of a shard with blockwise (8-bit / 4-bit) moments: dequantize, "
        "update, requantize each block against its new absmax, in one pass",
        py::arg("grad"), py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("model_out"),
        py::arg("segments"), py::arg("hparams"), py::arg("steps"), py::arg("touched"), py::arg("grad_coef"),
        py::arg("found_inf"), py::arg("adam_w_mode"), py::arg("bias_correction"), py::arg("units") = py::none(),
        py::arg("records") = py::none(), py::arg("record_offset") = 0);
  m.attr("BLOCKWISE_CUDA_TILE") = kBlockwiseCudaTile;
}

}  // namespace shardamp
