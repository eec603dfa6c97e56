// Blockwise moments ("8bit" / "4bit", optim/kernels/quant.py): the per-element quantization math
// shared by the CPU and CUDA steps over them, in the reference's operations so both give its bits.
//
// A block stores one fp32 scale (its absmax) and one code per element. A code dequantizes to
// map[code] * scale (one rounded fp32 multiply). An element x quantizes to the number of the map's
// midpoints ((map[i] + map[i + 1]) * 0.5, fp32, handed in as a table) strictly below
// y = x / scale (0 for a zero scale): the nearest code, ties to the lower one, exactly
// torch.searchsorted(midpoints, y) as the reference does. 4-bit codes are packed two to a byte,
// the even element in the low nibble.
#pragma once

#include "common.h"

namespace shardamp {
namespace quant {

// Moment kinds the blockwise step takes: a float tensor, or codes plus block scales.
enum MomentKind : int { kFloat32 = 0, kBFloat16 = 1, kCodes8 = 2, kCodes4 = 3 };

SHARDAMP_HD bool is_codes(int kind) { return kind == kCodes8 || kind == kCodes4; }

// The number of the 2^Bits - 1 sorted midpoints strictly below y (a branch-free binary search:
// every step compares against one table entry). NaN gives 0 (inputs are finite: the step skips
// on a non-finite grad).
template <int Bits>
SHARDAMP_HD int nearest_code(const float* mid, float y) {
  int pos = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int step = 1 << (Bits - 1); step > 0; step >>= 1) pos += mid[pos + step - 1] < y ? step : 0;
  return pos;
}

// What the code search takes for x in a block of absmax `scale`: x / scale, 0 for a zero scale
// (a block of zeros).
SHARDAMP_HD float scaled(float x, float scale) { return scale > 0.0f ? SHARDAMP_DIV(x, scale) : 0.0f; }

SHARDAMP_HD float dequantize(const float* map, int code, float scale) { return SHARDAMP_MUL(map[code], scale); }

// The code of element i (shard-relative) of 4-bit codes packed two to a byte.
SHARDAMP_HD int code4(const uint8_t* packed, int64_t i) {
  const int byte = packed[i >> 1];
  return (i & 1) ? (byte >> 4) : (byte & 15);
}

SHARDAMP_HD uint8_t pack4(int even, int odd) { return static_cast<uint8_t>(even | (odd << 4)); }

}  // namespace quant
}  // namespace shardamp
