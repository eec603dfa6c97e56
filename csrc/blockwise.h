// The arguments of the Adam step over blockwise moments (adam_step_blockwise: binding_blockwise.cpp
// checks them, cpu/adam_blockwise_cpu.cpp and cuda/adam_step_blockwise.cu run them). Contract:
// optim/kernels/reference.py (adam_step over quant.QuantizedShard).
#pragma once

#include "quant.h"

namespace shardamp {

// The CUDA kernel's largest unit: one block of 256 threads, 8 elements each, holds a unit's
// values in registers until its blocks' absmax is known.
constexpr int64_t kBlockwiseCudaTile = 2048;

// One moment as the blockwise step takes it: a float tensor (kind kFloat32 / kBFloat16), or
// codes (kCodes8: one uint8 per element; kCodes4: two per byte) with one fp32 scale per `block`
// elements, the fp32 code map, its midpoints and their search table (quant.h: nearest_code_in).
struct QuantMoment {
  at::Tensor values, scales, map, mids, search;
  int64_t kind = quant::kFloat32;
  int64_t block = 0;
};

// adam_step's arguments with the moments as QuantMoment. `unit`: elements per unit of work, a
// multiple of every blockwise moment's block (their least common multiple): a unit is
// dequantized, updated and requantized by one worker, so no block is split.
struct BlockwiseArgs {
  at::Tensor grad, master;
  QuantMoment exp_avg, exp_avg_sq;
  c10::optional<at::Tensor> model_out;
  at::Tensor segments, hparams, steps, touched, grad_coef, found_inf;
  bool adam_w_mode = true;
  bool bias_correction = true;
  int64_t unit = 0;
};

}  // namespace shardamp
