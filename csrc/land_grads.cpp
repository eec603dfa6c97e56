// land_grads (contract: land_grads.h; reference: optim/kernels/reference.py land_grads).

#include "land_grads.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "common.h"

namespace shardamp {

// ``g`` puts every element where ``p`` does: equal sizes, and equal strides wherever a size is not
// 1 (a size-1 dim's stride moves no element). Autograd hands grads over in exactly this form (its
// layout contract), e.g. a contiguous grad for a channels_last 1x1 conv weight, whose strides
// differ only in the size-1 dims: comparing all strides sent those through a view.
bool same_layout(const at::Tensor& g, const at::Tensor& p) {
  if (g.sizes() != p.sizes()) return false;
  const auto sizes = p.sizes();
  const auto gs = g.strides();
  const auto ps = p.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] != 1 && gs[d] != ps[d]) return false;
  }
  return true;
}

namespace {

// Zeroing ranges (null src) for the bytes of [base, base + total) outside every ``covered``
// (start, bytes) span, appended to ``out``. Spans never overlap (each is one param's slot).
void add_zero_gaps(std::vector<CopyRange>& out, std::vector<std::pair<char*, int64_t>>& covered, char* base,
                   int64_t total) {
  std::sort(covered.begin(), covered.end());
  char* at = base;
  for (const auto& span : covered) {
    if (span.first > at) out.push_back({nullptr, at, span.first - at});
    at = std::max(at, span.first + span.second);
  }
  if (base + total > at) out.push_back({nullptr, at, base + total - at});
}

void land_impl(at::Tensor& full, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& like,
               const std::vector<int64_t>& offsets, bool accumulate, bool zero_rest) {
  SHARDAMP_CHECK(grads.size() == like.size() && grads.size() == offsets.size(),
                 "land_grads: grads, like and offsets must have the same length");
  SHARDAMP_CHECK(!(accumulate && zero_rest), "land_grads: zero_rest is for copies (accumulate=False)");
  SHARDAMP_CHECK(!zero_rest || full.is_contiguous(), "land_grads: zero_rest needs a contiguous buffer");
  std::vector<CopyRange> ranges;
  std::vector<at::Tensor> views, sources;
  views.reserve(grads.size());
  sources.reserve(grads.size());
  char* base = static_cast<char*>(full.data_ptr());
  const int64_t item = static_cast<int64_t>(full.element_size());
  std::vector<std::pair<char*, int64_t>> covered;  // zero_rest: the slots the copies write whole
  // on the CPU a large grad goes through copy_, which uses the thread pool
  const int64_t range_limit = full.is_cuda() ? std::numeric_limits<int64_t>::max() : (int64_t{1} << 20);
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& p = like[i];
    const at::Tensor& g = grads[i];
    SHARDAMP_CHECK(offsets[i] >= 0 && offsets[i] + p.numel() <= full.numel(),
                   "land_grads: param ", i, " does not fit in the bucket buffer");
    const int64_t bytes = p.numel() * item;
    if (bytes == 0) continue;
    // a dense param's copy (a byte range or a view) writes every byte of its slot
    if (zero_rest && p.is_non_overlapping_and_dense()) covered.emplace_back(base + offsets[i] * item, bytes);
    if (!accumulate && bytes <= range_limit && p.is_non_overlapping_and_dense() &&
        g.scalar_type() == full.scalar_type() && g.device() == full.device() && same_layout(g, p)) {
      ranges.push_back({g.data_ptr(), base + offsets[i] * item, bytes});
    } else {
      views.push_back(full.as_strided(p.sizes(), p.strides(), full.storage_offset() + offsets[i]));
      sources.push_back(g);
    }
  }
  if (zero_rest) add_zero_gaps(ranges, covered, base, full.numel() * item);
  if (!ranges.empty()) {
    if (full.is_cuda()) {
#if defined(SHARDAMP_WITH_CUDA)
      cuda::batched_copy(ranges, full.device());
#else
      SHARDAMP_CHECK(false, "land_grads: a CUDA buffer in a build without CUDA");
#endif
    } else {
      for (const auto& r : ranges) {
        if (r.src == nullptr) {
          std::memset(r.dst, 0, static_cast<size_t>(r.bytes));
        } else {
          std::memcpy(r.dst, r.src, static_cast<size_t>(r.bytes));
        }
      }
    }
  }
  if (views.empty()) return;
  if (accumulate) {
    at::_foreach_add_(views, sources);
  } else {
    at::_foreach_copy_(views, sources);
  }
}

}  // namespace

void land_grads(at::Tensor& full, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& like,
                const std::vector<int64_t>& offsets, bool accumulate, bool zero_rest) {
  try {
    land_impl(full, grads, like, offsets, accumulate, zero_rest);
  } catch (const c10::Error& e) {  // a c10::Error leaving the extension can kill Python (common.h)
    throw std::runtime_error(e.what_without_backtrace());
  }
}

}  // namespace shardamp
