// grad_parts (grad_parts.h), the stager's checked flags' pass over the parts, and the Python
// entry points of the kernels over parts (the step's per-group partials; tests).
#include "grad_parts.h"

#include <torch/extension.h>

#include <algorithm>
#include <cmath>

#include "common.h"
#include "land_grads.h"

namespace shardamp {

namespace cpu {  // cpu/grad_stats_cpu.cpp
void group_partials_parts(const std::vector<GradPart>& parts, at::ScalarType dtype, const at::Tensor& segments,
                          at::Tensor& out, double norm_type);
}  // namespace cpu

std::vector<GradPart> grad_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                 at::ScalarType dtype, int64_t numel, const char* what, const at::Device& device) {
  SHARDAMP_CHECK(grads.size() == offsets.size(), what, ": one offset per grad part (", grads.size(), " grads, ",
                 offsets.size(), " offsets)");
  std::vector<GradPart> parts;
  parts.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    SHARDAMP_CHECK(g.defined() && g.device() == device && g.scalar_type() == dtype && g.is_non_overlapping_and_dense(),
                   what, ": grad part ", i, " must be a dense ", device.is_cpu() ? std::string("CPU") : device.str(),
                   " tensor of ", dtype);
    SHARDAMP_CHECK(offsets[i] >= 0 && offsets[i] + g.numel() <= numel, what, ": grad part ", i, " (", g.numel(),
                   " elements at ", offsets[i], ") does not fit in ", numel, " elements");
    // dense: its elements are the numel() from data_ptr on, in its layout's order (the param's)
    if (g.numel() > 0) parts.push_back({g.data_ptr(), offsets[i], g.numel()});
  }
  std::sort(parts.begin(), parts.end(), [](const GradPart& a, const GradPart& b) { return a.start < b.start; });
  for (size_t i = 1; i < parts.size(); ++i) {
    SHARDAMP_CHECK(parts[i - 1].start + parts[i - 1].len <= parts[i].start, what, ": grad parts overlap at element ",
                   parts[i].start);
  }
  return parts;
}

std::vector<const void*> segment_bases(const std::vector<GradPart>& parts, const std::vector<int64_t>& spans,
                                       at::ScalarType dtype, const char* what) {
  SHARDAMP_CHECK(spans.size() % 2 == 0, what, ": spans are (start, length) per segment (got ", spans.size(),
                 " numbers)");
  const uintptr_t item = static_cast<uintptr_t>(c10::elementSize(dtype));
  std::vector<const void*> out(spans.size() / 2, nullptr);
  for (size_t k = 0; k < out.size(); ++k) {
    const int64_t start = spans[2 * k], len = spans[2 * k + 1];
    auto it = part_at(parts, start);
    if (len == 0 || it == parts.end() || it->start > start) continue;  // no grad here: skipped
    SHARDAMP_CHECK(start + len <= it->start + it->len, what, ": segment ", k, " (elements ", start, " to ",
                   start + len, ") is not inside the grad part that holds its start");
    out[k] = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(it->data) -
                                           static_cast<uintptr_t>(it->start) * item);
  }
  return out;
}

bool checked_bucket_stats_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                int64_t numel, at::Tensor partial, bool assign, const c10::optional<at::Tensor>& rows,
                                const c10::optional<at::Tensor>& flags) {
  SHARDAMP_CHECK(!grads.empty(), "bucket_stats_parts: no grads");
  const at::Device device = grads.front().device();
  SHARDAMP_CHECK(partial.device() == device && partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                     partial.numel() >= 2,
                 "bucket_stats_parts: partial must be a contiguous float32 row of at least 2 on the grads' device ",
                 device);
  const at::ScalarType dtype = grads.front().scalar_type();
  const std::vector<GradPart> parts = grad_parts(grads, offsets, dtype, numel, "bucket_stats_parts", device);
  if (device.is_cpu()) return cpu::bucket_stats_parts(parts, dtype, numel, partial.data_ptr<float>(), assign);
#if defined(SHARDAMP_WITH_CUDA)
  SHARDAMP_CHECK(device.is_cuda(), "bucket_stats_parts: unsupported device ", device);
  SHARDAMP_CHECK(rows && flags, "bucket_stats_parts: CUDA grads need the bucket's rows and flags (as bucket_stats)");
  SHARDAMP_CHECK(rows->device() == device && rows->scalar_type() == at::kLong && rows->dim() == 2 &&
                     rows->is_contiguous() && flags->device() == device && flags->scalar_type() == at::kFloat &&
                     flags->is_contiguous() && flags->numel() >= 1,
                 "bucket_stats_parts: rows (contiguous int64 [R, k]) and flags (contiguous float32, the 'any' "
                 "flag last) must be on ", device);
  at::Tensor f = *flags;
  return cuda::bucket_stats_parts(parts, dtype, numel, *rows, f, partial, assign);
#else
  SHARDAMP_CHECK(false, "bucket_stats_parts: this build of the shardamp kernels has no CUDA support");
  return false;
#endif
}

void checked_group_partials_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                  int64_t numel, const at::Tensor& segments, at::Tensor out, double norm_type,
                                  const c10::optional<at::Tensor>& chunks,
                                  const c10::optional<std::vector<int64_t>>& spans) {
  SHARDAMP_CHECK(!grads.empty(), "group_partials_parts: no grads");
  const at::Device device = grads.front().device();
  SHARDAMP_CHECK(segments.device() == device && segments.scalar_type() == at::kLong && segments.dim() == 2 &&
                     segments.size(1) == 4 && segments.is_contiguous(),
                 "group_partials_parts: segments must be a contiguous int64 [S, 4] tensor on ", device);
  SHARDAMP_CHECK(out.device() == device && out.scalar_type() == at::kFloat && out.is_contiguous(),
                 "group_partials_parts: out must be a contiguous float32 tensor on ", device);
  SHARDAMP_CHECK(!std::isnan(norm_type), "group_partials_parts: norm_type is NaN");
  const at::ScalarType dtype = grads.front().scalar_type();
  const std::vector<GradPart> parts = grad_parts(grads, offsets, dtype, numel, "group_partials_parts", device);
  if (!device.is_cpu()) {
#if defined(SHARDAMP_WITH_CUDA)
    SHARDAMP_CHECK(device.is_cuda() && chunks && spans && chunks->device() == device &&
                       chunks->scalar_type() == at::kLong && chunks->dim() == 2 && chunks->size(1) == 2 &&
                       chunks->is_contiguous(),
                   "group_partials_parts: CUDA grads need the segments' spans (host) and chunk map (int64 [C, 2] on ",
                   device, ")");
    SHARDAMP_CHECK(static_cast<int64_t>(spans->size()) == 2 * segments.size(0),
                   "group_partials_parts: one (start, length) per segment");
    cuda::group_partials_bases(segment_bases(parts, *spans, dtype, "group_partials_parts"), dtype, segments, out,
                               norm_type, *chunks);
    return;
#else
    SHARDAMP_CHECK(false, "group_partials_parts: this build of the shardamp kernels has no CUDA support");
#endif
  }
  const int64_t* rows = segments.data_ptr<int64_t>();
  for (int64_t r = 0; r < segments.size(0); ++r) {
    SHARDAMP_CHECK(rows[4 * r] >= 0 && rows[4 * r + 1] >= 0 && rows[4 * r] + rows[4 * r + 1] <= numel &&
                       rows[4 * r + 3] >= 0 && rows[4 * r + 3] < out.numel(),
                   "group_partials_parts: segment ", r, " lies outside the shard or names no group of out");
  }
  cpu::group_partials_parts(parts, dtype, segments, out, norm_type);
}

namespace {

// bucket_stats over grads held in place (tests): CPU, false where some element is inf/NaN
bool bucket_stats_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets, int64_t numel,
                        at::Tensor partial, bool assign, const c10::optional<at::Tensor>& rows,
                        const c10::optional<at::Tensor>& flags) {
  return checked_bucket_stats_parts(grads, offsets, numel, partial, assign, rows, flags);
}

}  // namespace

void register_grad_parts(pybind11::module_& m) {  // module.cpp calls it
  namespace py = pybind11;
  // module_local: the CPU and CUDA modules (one process may load both) each register it
  py::class_<HeldParts, std::shared_ptr<HeldParts>>(m, "HeldParts", py::module_local(),
                                                    "A bucket's grads held where autograd left them (grad_parts.h)")
      .def("__len__", [](const HeldParts& h) { return h.grads.size(); })
      .def_property_readonly("nbytes", [](const HeldParts& h) {
             int64_t n = 0;
             for (const auto& g : h.grads) n += g.numel() * static_cast<int64_t>(g.element_size());
             return n;
           }, "the grads' bytes")
      .def("land", [](const HeldParts& h, at::Tensor full) {
             land_grads(full, h.grads, h.like, h.offsets, /*accumulate=*/false, /*zero_rest=*/true);
           }, "Copy the grads into their slots of the flat shard `full` (allocated uninitialized: every byte no grad "
              "writes is zeroed), as the landing would have", py::arg("full"));
  m.def("group_partials_held", [](const HeldParts& h, int64_t numel, const at::Tensor& segments, at::Tensor out,
                                  double norm_type, const c10::optional<at::Tensor>& chunks,
                                  const c10::optional<std::vector<int64_t>>& spans) {
          checked_group_partials_parts(h.grads, h.offsets, numel, segments, out, norm_type, chunks, spans);
        }, "group_partials_parts over a HeldParts", py::arg("held"), py::arg("numel"), py::arg("segments"),
        py::arg("out"), py::arg("norm_type"), py::arg("chunks") = py::none(), py::arg("spans") = py::none());
  m.def("group_partials_parts", &checked_group_partials_parts,
        "group_partials over grads held in place: grads[i] at element offsets[i] of a numel-element shard",
        py::arg("grads"), py::arg("offsets"), py::arg("numel"), py::arg("segments"), py::arg("out"),
        py::arg("norm_type"), py::arg("chunks") = py::none(), py::arg("spans") = py::none());
  m.def("bucket_stats_parts", &bucket_stats_parts,
        "bucket_stats' L2 partial over grads held in place into partial[0:2] (assigned where assign). CPU: False, "
        "writing nothing, where an element is inf/NaN. CUDA: the params' non-finite flags too (rows and flags as "
        "bucket_stats takes them); False, launching nothing, under CUDA-graph capture",
        py::arg("grads"), py::arg("offsets"), py::arg("numel"), py::arg("partial"), py::arg("assign"),
        py::arg("rows") = py::none(), py::arg("flags") = py::none());
  m.attr("HELD_SEGMENTS") = py::int_(kHeldSegments);
}

}  // namespace shardamp
