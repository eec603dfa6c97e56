// A bucket's grads where autograd left them (one process): each param's grad is one part of
// the bucket's flat index space, read in place by the flags' pass and the step instead of being
// copied into the flat grad shard first (the zero-copy landing: optim/sync/merged_landings.py).
// Where no part covers an element it reads as zero, as a landed shard's gaps (land_grads'
// zero_rest) do, so the flags' pass over the parts sums exactly what it sums over the shard.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardamp {

struct GradPart {
  const void* data;  // the part's first element
  int64_t start;     // its first element's index in the flat shard
  int64_t len;       // elements
};

// A bucket's grads held where autograd left them, as the stager's zero-copy landing hands them to
// Python (grad_stager.cpp): one object, no Python object per grad (making those cost the end of
// every backward microseconds a grad). ``grads[i]`` lies in the slot of ``like[i]`` (its param,
// whose layout it has) at element ``offsets[i]`` of the shard. Bound as ``HeldParts``
// (grad_parts.cpp): its shard made from it, the step's and the partials' reads of it.
struct HeldParts {
  std::vector<at::Tensor> grads, like;
  std::vector<int64_t> offsets;
};

// The first of ``parts`` (sorted by start, disjoint: their ends sorted too) that ends after element
// ``i``: the part holding ``i`` if any holds it (then ``it->start <= i``), else the next one.
// Internal linkage: the files using it are compiled once per vector ISA.
static inline std::vector<GradPart>::const_iterator part_at(const std::vector<GradPart>& parts, int64_t i) {
  return std::upper_bound(parts.begin(), parts.end(), i,
                          [](int64_t x, const GradPart& q) { return x < q.start + q.len; });
}

// ``grads[i]`` laid over elements [offsets[i], offsets[i] + numel) of a flat shard of ``numel``
// elements of ``dtype``, sorted by start; each grad must be a dense tensor of ``dtype`` on
// ``device`` and the parts must not overlap. ``what`` names the caller in the errors.
std::vector<GradPart> grad_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                 at::ScalarType dtype, int64_t numel, const char* what,
                                 const at::Device& device = at::kCPU);

// Per segment of ``spans`` (flat: start, length per segment), the address its grads are read
// from as the shard's are (element i of the shard at [i] of a ``dtype`` array: the part's data
// less its start), or null where no part holds the segment (a param without a grad: the step
// skips it). A segment that starts in a part must end in it.
std::vector<const void*> segment_bases(const std::vector<GradPart>& parts, const std::vector<int64_t>& spans,
                                       at::ScalarType dtype, const char* what);

namespace cpu {
// bucket_stats over the parts (cpu/grad_stats_cpu.cpp): the L2 partial folded into out[0:2] (assigned
// where ``assign``) exactly as bucket_stats folds it over the landed shard, and true; false, with
// nothing written, where some element is inf/NaN or the sum overflows (the caller lands the shard
// and its own pass decides).
bool bucket_stats_parts(const std::vector<GradPart>& parts, at::ScalarType dtype, int64_t n, float* out, bool assign);
}  // namespace cpu

#if defined(SHARDAMP_WITH_CUDA) || defined(__CUDACC__)
namespace cuda {  // cuda/grad_stats.cu
// bucket_stats over the parts (on one CUDA device): the L2 partial into out[0:2] and the params'
// non-finite flags (``rows``, ``flags`` as bucket_stats takes them), summed in the order
// bucket_stats sums the landed shard, so bitwise its result; true. False, with nothing launched,
// where they cannot be read in place: more than kHeldSegments parts (their addresses travel in
// the launch's arguments), or the current stream being captured into a CUDA graph (the grads'
// addresses would be baked into the graph; they change every backward).
bool bucket_stats_parts(const std::vector<GradPart>& parts, at::ScalarType dtype, int64_t n, const at::Tensor& rows,
                        at::Tensor& flags, at::Tensor& out, bool assign);
// group_partials over held grads: segment s's read from bases[s] (segment_bases), in the chunks'
// blocks and fold order of group_partials over the landed shard, so bitwise its result
void group_partials_bases(const std::vector<const void*>& bases, at::ScalarType dtype, const at::Tensor& segments,
                          at::Tensor& out, double norm_type, const at::Tensor& chunks);
}  // namespace cuda
#endif

// The stager's zero-copy landing (stager_state.cpp): bucket_stats over ``grads`` at ``offsets``
// of a ``numel``-element shard, read in place, after grad_parts' checks. CPU: the L2 partial
// into ``partial``; false, nothing written, where an element is inf/NaN (``rows`` and ``flags``
// unused: the caller lands the shard and its own pass flags it). CUDA (cuda::bucket_stats_parts):
// the partial and the flags, whatever the values; false only where they cannot be read in place.
bool checked_bucket_stats_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                int64_t numel, at::Tensor partial, bool assign,
                                const c10::optional<at::Tensor>& rows = c10::nullopt,
                                const c10::optional<at::Tensor>& flags = c10::nullopt);

// group_partials over grads held in place: each segment's partial read from the part holding it
// (none: the segment's slot would be zeros, its partial 0), as over the landed shard. CUDA: the
// segments' (start, length) on the host (``spans``) and their chunk map (``chunks``, as
// group_partials takes it) too. Bound as group_partials_parts and group_partials_held; the
// step's one call (fused_step.cpp stats_step) runs it over a launch's held grads.
void checked_group_partials_parts(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& offsets,
                                  int64_t numel, const at::Tensor& segments, at::Tensor out, double norm_type,
                                  const c10::optional<at::Tensor>& chunks,
                                  const c10::optional<std::vector<int64_t>>& spans);

}  // namespace shardamp
