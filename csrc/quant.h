// Blockwise moments ("8bit" / "4bit", optim/kernels/quant.py): the per-element quantization math
// shared by the CPU and CUDA steps over them, in the reference's operations so both give its bits.
//
// A block stores one fp32 scale (its absmax) and one code per element. A code dequantizes to
// map[code] * scale (one rounded fp32 multiply). An element x quantizes to the number of the map's
// midpoints ((map[i] + map[i + 1]) * 0.5, fp32, handed in as a table) strictly below
// y = x / scale (0 for a zero scale): the nearest code, ties to the lower one, exactly
// torch.searchsorted(midpoints, y) as the reference does (found through a search table). 4-bit codes are packed two to a byte,
// the even element in the low nibble.
#pragma once

#include "common.h"

#include <cstring>

namespace shardamp {
namespace quant {

// Moment kinds the blockwise step takes: a float tensor, or codes plus block scales.
enum MomentKind : int { kFloat32 = 0, kBFloat16 = 1, kCodes8 = 2, kCodes4 = 3 };

SHARDAMP_HD bool is_codes(int kind) { return kind == kCodes8 || kind == kCodes4; }

// The search table (optim/kernels/quant.py: search_table): the top kSearchKeyBits of an
// order-preserving transform of y's fp32 bits name a bucket; entry [key] holds the number of
// midpoints in the buckets below (low 16 bits) and in it (high 16 bits); entry [kSearchEntries] the
// largest power of two not above any bucket's count. -0 is keyed as +0 (they compare equal).
constexpr int kSearchKeyBits = 13;
constexpr int kSearchEntries = 1 << kSearchKeyBits;

SHARDAMP_HD uint32_t search_key(float y) {
  const float c = y == 0.0f ? 0.0f : y;
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(c);
#else
  uint32_t bits;
  std::memcpy(&bits, &c, sizeof(bits));
#endif
  return ((bits >> 31) ? ~bits : (bits | 0x80000000u)) >> (32 - kSearchKeyBits);
}

// The number of the sorted midpoints strictly below y (torch.searchsorted(mids, y)), from the
// search table: midpoints in lower buckets are below y, those in higher ones above it, so only the
// bucket's own few are compared, by halving steps from first_step (table[kSearchEntries]).
SHARDAMP_HD int nearest_code_in(const float* mid, const int32_t* table, int first_step, float y) {
  const int32_t entry = table[search_key(y)];
  int pos = entry & 0xffff;
  const int end = pos + (entry >> 16);
  for (int step = first_step; step > 0; step >>= 1) {
    if (pos + step <= end && mid[pos + step - 1] < y) pos += step;
  }
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
