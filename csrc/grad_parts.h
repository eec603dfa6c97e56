// A bucket's grads where autograd left them (one process, CPU): each param's grad is one part of
// the bucket's flat index space, read in place by the flags' pass and the step instead of being
// copied into the flat grad shard first (the zero-copy landing: optim/sync/merged_landings.py).
// Where no part covers an element it reads as zero, as a landed shard's gaps (land_grads'
// zero_rest) do, so the flags' pass over the parts sums exactly what it sums over the shard.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardamp {

struct GradPart {
  const void* data;  // the part's first element
  int64_t start;     // its first element's index in the flat shard
  int64_t len;       // elements
};

// The first of ``parts`` (sorted by start, disjoint: their ends sorted too) that ends after element
// ``i``: the part holding ``i`` if any holds it (then ``it->start <= i``), else the next one.
// Internal linkage: the files using it are compiled once per vector ISA.
static inline std::vector<GradPart>::const_iterator part_at(const std::vector<GradPart>& parts, int64_t i) {
  return std::upper_bound(parts.begin(), parts.end(), i,
                          [](int64_t x, const GradPart& q) { return x < q.start + q.len; });
}

// ``grads[i]`` laid over elements [offsets[i], offsets[i] + numel) of a flat shard of ``numel``
// elements of ``dtype``, sorted by start; each grad must be a dense CPU tensor of ``dtype`` and
// the parts must not overlap. ``what`` names the caller in the errors.
std::vector<GradPart> grad_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                 at::ScalarType dtype, int64_t numel, const char* what);

namespace cpu {
// bucket_stats over the parts (cpu/grad_stats_cpu.cpp): the L2 partial folded into out[0:2] (assigned
// where ``assign``) exactly as bucket_stats folds it over the landed shard, and true; false, with
// nothing written, where some element is inf/NaN or the sum overflows (the caller lands the shard
// and its own pass decides).
bool bucket_stats_parts(const std::vector<GradPart>& parts, at::ScalarType dtype, int64_t n, float* out, bool assign);
}  // namespace cpu

// The stager's zero-copy landing (stager_state.cpp): bucket_stats_parts over ``grads`` at
// ``offsets`` of a ``numel``-element shard into ``partial``, after grad_parts' checks.
bool checked_bucket_stats_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                int64_t numel, at::Tensor partial, bool assign);

}  // namespace shardamp
