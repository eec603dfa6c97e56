// Backward's grad landing: copy (or add) grads into their slots of a flat bucket buffer. Called
// from Python (binding.cpp, kernels.land_grads) and by GradStager.land (grad_stager.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace shardamp {

// A byte range to copy: a staged grad into its slot of the flat buffer; a null ``src`` zeroes it.
struct CopyRange {
  const void* src;
  void* dst;
  int64_t bytes;
};

// View ``full`` as each param (``like[i]``'s sizes and strides at element ``offsets[i]``) and
// copy (or add) ``grads[i]`` into it. A copy whose grad puts its elements where the param does
// (equal sizes, equal strides wherever a size is not 1: autograd's layout contract) and has the
// buffer's dtype and device, for a dense param (its slot is one range), is a byte range (memcpy
// on the CPU up to 1 MiB, cuda::batched_copy on CUDA), no view; the others, and every add, go
// through views and one multi-tensor op. ``zero_rest`` (copies only): every byte of ``full`` no
// byte range writes is zeroed in the same pass (a buffer allocated uninitialized: the zero fill
// is not a launch of its own). Throws std::runtime_error only.
// ``g`` puts every element where ``p`` does: equal sizes, and equal strides wherever a size is not 1.
bool same_layout(const at::Tensor& g, const at::Tensor& p);

void land_grads(at::Tensor& full, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& like,
                const std::vector<int64_t>& offsets, bool accumulate, bool zero_rest = false);

#if defined(SHARDAMP_WITH_CUDA)
namespace cuda {
void batched_copy(const std::vector<CopyRange>& ranges, const at::Device& device);  // cuda/land_copy.cu
}  // namespace cuda
#endif

}  // namespace shardamp
