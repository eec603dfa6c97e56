// A byte range to copy (a staged grad into its slot of a flat bucket buffer): GradStager.land
// (grad_stager.cpp) batches them; CPU: memcpy; CUDA: one kernel per batch (cuda/land_copy.cu).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace shardamp {

struct CopyRange {
  const void* src;
  void* dst;
  int64_t bytes;
};

#if defined(SHARDAMP_WITH_CUDA)
namespace cuda {
void batched_copy(const std::vector<CopyRange>& ranges, const at::Device& device);
}  // namespace cuda
#endif

}  // namespace shardamp
