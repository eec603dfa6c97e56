// adam_step over blockwise moments ("8bit" / "4bit") on CUDA: one pass, no fp32 copy of a moment in
// global memory (contract: optim/kernels/reference.py, adam_step over quant.QuantizedShard).
//
// One block of 256 threads per tile: whole units (BlockwiseArgs::unit, a multiple of every
// blockwise moment's block) of at most kBlockwiseCudaTile = 2048 elements, 8 consecutive elements
// per thread. A thread first issues every load that needs neither the maps nor its segment (grads,
// masters, codes or float moments, its unit's segment range, found-inf), then the block stages
// the code maps in shared memory; the codes are dequantized through them, the thread updates the
// elements its segments touch, then the block's new absmax is formed in registers (warp shuffles
// among the lanes of one quant block when they are a power of two <= 32, the default 256 /
// 128-element blocks; else a shared-memory atomicMax on the non-negative floats' bits), and each
// thread requantizes and stores its 8 codes (8-bit: one 8-byte store; 4-bit: one 4-byte store),
// each found from the midpoints' search table (quant.h) in a few compares, not one per code bit.
// Loads of grads, params, remainders and float moments are 16 bytes wide where aligned.
//
// Found-inf, the grad coefficient, the step counts and touched flags are read on the device (the
// per-segment records of adam_step.cu's prepare kernel, or the optimizer's, and found-inf directly):
// no host sync, capturable in a CUDA graph. Each unit's range of segments comes from a host-built
// table (optim/kernels/blockwise.py: unit_table). Every operation is an explicitly rounded
// intrinsic (common.h, quant.h), so the arithmetic is the reference's, operation for operation.

#include "../blockwise.h"
#include "../segment_record.h"
#include "vec.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace shardamp {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kE = 8;  // elements per thread
static_assert(kThreads * kE == kBlockwiseCudaTile, "a tile is one block's 8 elements per thread");
constexpr int kMaxBlocksPerTile = kBlockwiseCudaTile / 16;  // blocks are multiples of 16 elements

struct MomentP {
  void* values;   // fp32 / bf16 values, or uint8 codes
  float* scales;  // one per block (codes)
  const float* map;
  const float* mids;
  const int32_t* search;  // the midpoints' search table (quant.h), read through the L1 cache
  int kind;
  int block;
};

struct Params {
  const void* grad;
  void* master;  // fp32, or int16 remainders (R)
  void* model_out;
  MomentP m, v;
  const int32_t* units;     // [U, 2]: each unit's range of segment rows
  const int64_t* segments;  // [S, 4]
  const float4* records;    // 3 float4 per segment (adam_step.cu's SegmentRecord)
  const void* found_inf;
  int found_code;
  int64_t numel;
  int unit, units_per_tile;
  bool adam_w, vec_ok;
};

// A moment's codes as a thread loads them, before the maps are in shared memory: 8 one-byte
// codes in two words, or 8 four-bit codes in one (element k at bits 8k / 4k), and their scale.
struct RawCodes {
  uint32_t lo = 0, hi = 0;
  float scale = 0.0f;
};

// Issues the loads of a thread's n <= 8 elements [e, e + n) of a moment: float values straight
// into x (fp32), codes into r (decoded by decode_moment once the map is staged).
__device__ __forceinline__ void fetch_moment(const MomentP& q, int64_t e, int n, bool vec, float (&x)[kE],
                                             RawCodes& r) {
  if (n <= 0) return;
  if (q.kind == quant::kFloat32 || q.kind == quant::kBFloat16) {
    if (vec && n == kE) {
      if (q.kind == quant::kFloat32) load8(static_cast<const float*>(q.values) + e, x);
      else load8(static_cast<const __nv_bfloat16*>(q.values) + e, x);
      return;
    }
#pragma unroll
    for (int k = 0; k < kE; ++k) {  // constant bounds: the arrays stay in registers
      if (k < n) {
        x[k] = q.kind == quant::kFloat32 ? static_cast<const float*>(q.values)[e + k]
                                         : __bfloat162float(static_cast<const __nv_bfloat16*>(q.values)[e + k]);
      }
    }
    return;
  }
  r.scale = q.scales[e / q.block];  // 8 elements never straddle a block (a multiple of 16)
  const uint8_t* codes = static_cast<const uint8_t*>(q.values);
  if (q.kind == quant::kCodes8) {
    if (vec && n == kE) {
      const uint2 w = *reinterpret_cast<const uint2*>(codes + e);
      r.lo = w.x;
      r.hi = w.y;
      return;
    }
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      if (k < n) (k < 4 ? r.lo : r.hi) |= uint32_t(codes[e + k]) << (8 * (k & 3));
    }
    return;
  }
  if (vec && n == kE) {
    r.lo = *reinterpret_cast<const uint32_t*>(codes + e / 2);
    return;
  }
#pragma unroll
  for (int k = 0; k < kE; k += 2) {  // a byte holds elements k and k + 1 (its high nibble unread past n)
    if (k < n) r.lo |= uint32_t(codes[(e + k) / 2]) << (4 * k);
  }
}

// The fetched codes of a thread's n elements through the map `smap` (staged in shared memory).
__device__ __forceinline__ void decode_moment(const MomentP& q, const float* smap, int n, const RawCodes& r,
                                              float (&x)[kE]) {
  if (!quant::is_codes(q.kind)) return;
#pragma unroll
  for (int k = 0; k < kE; ++k) {
    const int code = q.kind == quant::kCodes8 ? int(((k < 4 ? r.lo : r.hi) >> (8 * (k & 3))) & 0xffu)
                                               : int((r.lo >> (4 * k)) & 0xfu);
    if (k < n) x[k] = quant::dequantize(smap, code, r.scale);
  }
}

// Issues the 16-byte loads of a thread's 8 grads and fp32 masters (joined from remainders), before
// its segment is known: almost every 8 elements lie inside one segment.
template <typename G, typename O, bool R>
__device__ __forceinline__ void fetch_params(const Params& P, int64_t e, float (&rg)[kE], float (&rp)[kE]) {
  load8(static_cast<const G*>(P.grad) + e, rg);
  if constexpr (R) {
    load8_joined(static_cast<const O*>(P.model_out) + e, static_cast<const int16_t*>(P.master) + e, rp);
  } else {
    load8(static_cast<const float*>(P.master) + e, rp);
  }
}

// The absmax of each quant block over its threads' values: every thread returns its block's.
// Called by every thread of the block (barriers inside on the shared-memory path).
__device__ __forceinline__ float block_absmax(const MomentP& q, float local, unsigned int* smax) {
  const int lanes = q.block / kE;  // threads per quant block
  if ((lanes & (lanes - 1)) == 0 && lanes <= 32) {  // aligned lane groups inside a warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, local, o);
      if (o < lanes) local = fmaxf(local, other);
    }
    return local;
  }
  atomicMax(smax + threadIdx.x / lanes, __float_as_uint(local));  // non-negative floats order as their bits
  __syncthreads();
  return __uint_as_float(smax[threadIdx.x / lanes]);
}

// A thread's elements back into a moment: fp32 / bf16 stored, codes against the block's new absmax.
__device__ __forceinline__ void store_moment(const MomentP& q, const float* smid, unsigned int* smax, int64_t e,
                                             int n, bool vec, const float (&x)[kE]) {
  if (q.kind == quant::kFloat32 || q.kind == quant::kBFloat16) {
    if (n <= 0) return;
    if (vec && n == kE) {
      if (q.kind == quant::kFloat32) store8(static_cast<float*>(q.values) + e, x);
      else store8(static_cast<__nv_bfloat16*>(q.values) + e, x);
      return;
    }
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      if (k >= n) break;
      if (q.kind == quant::kFloat32) static_cast<float*>(q.values)[e + k] = x[k];
      else static_cast<__nv_bfloat16*>(q.values)[e + k] = __float2bfloat16_rn(x[k]);
    }
    return;
  }
  float local = 0.0f;
#pragma unroll
  for (int k = 0; k < kE; ++k) {
    if (k < n) local = fmaxf(local, fabsf(x[k]));
  }
  const float absmax = block_absmax(q, local, smax);  // every thread: it may hold a barrier
  if (n <= 0) return;
  if (e % q.block == 0) q.scales[e / q.block] = absmax;
  uint8_t* codes = static_cast<uint8_t*>(q.values);
  const int first = __ldg(q.search + quant::kSearchEntries);
  int c[kE];
#pragma unroll
  for (int k = 0; k < kE; ++k) c[k] = quant::nearest_code_in(smid, q.search, first, quant::scaled(x[k], absmax));
  if (q.kind == quant::kCodes8) {
    if (vec && n == kE) {
      uint2 w;
      w.x = uint32_t(c[0]) | (uint32_t(c[1]) << 8) | (uint32_t(c[2]) << 16) | (uint32_t(c[3]) << 24);
      w.y = uint32_t(c[4]) | (uint32_t(c[5]) << 8) | (uint32_t(c[6]) << 16) | (uint32_t(c[7]) << 24);
      *reinterpret_cast<uint2*>(codes + e) = w;
      return;
    }
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      if (k < n) codes[e + k] = static_cast<uint8_t>(c[k]);
    }
    return;
  }
  if (vec && n == kE) {
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < kE; ++k) w |= uint32_t(c[k]) << (4 * k);
    *reinterpret_cast<uint32_t*>(codes + e / 2) = w;
    return;
  }
#pragma unroll
  for (int k = 0; k < kE; k += 2) {
    if (k < n) codes[(e + k) / 2] = quant::pack4(c[k], k + 1 < n ? c[k + 1] : 0);
  }
}

__device__ __forceinline__ SegmentScalars record_scalars(const float4* rec, bool& skip) {
  const float4 ra = __ldg(rec), rb = __ldg(rec + 1), rd = __ldg(rec + 2);
  skip = rd.y != 0.0f;
  return SegmentScalars{ra.x, ra.y, ra.z, ra.w, rb.x, rb.y, rb.z, rb.w, rd.x};
}

// The update of a thread's elements [e, e + n) that a segment covers, m / v in registers; segment
// rows [s, s_end) overlap the thread's unit. `vec`: rg / rp hold the 8 grads and masters
// (fetch_params), used where one segment covers all 8.
template <typename G, typename O, bool R>
__device__ __forceinline__ void update(const Params& P, int64_t e, int n, int s, int s_end, bool vec,
                                       const float (&rg)[kE], float (&rp)[kE], float (&m)[kE], float (&v)[kE]) {
  using PT = std::conditional_t<R, int16_t, float>;
  const G* __restrict__ g = static_cast<const G*>(P.grad);
  PT* __restrict__ p = static_cast<PT*>(P.master);
  O* __restrict__ o = static_cast<O*>(P.model_out);
  auto seg_end = [&](int i) { return __ldg(P.segments + 4 * i) + __ldg(P.segments + 4 * i + 1); };
  while (s < s_end && seg_end(s) <= e) ++s;
  if (s >= s_end) return;  // padding after the unit's last segment
  if (vec && __ldg(P.segments + 4 * s) <= e && e + kE <= seg_end(s)) {  // one segment: 16-byte path
    bool skip;
    const SegmentScalars sc = record_scalars(P.records + 3 * s, skip);
    if (skip) return;
#pragma unroll
    for (int k = 0; k < kE; ++k) adam_scalar(rg[k], rp[k], m[k], v[k], sc, P.adam_w);
    if constexpr (R) {
      store8_split(o + e, p + e, rp);
    } else {
      store8(p + e, rp);
      if constexpr (!std::is_void_v<O>) store8(o + e, rp);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kE; ++k) {  // segment edges, padding, unaligned tensors: element by element
    if (k >= n) break;  // (constant bounds: m / v stay in registers)
    const int64_t i = e + k;
    while (s < s_end && seg_end(s) <= i) ++s;
    if (s >= s_end) break;
    if (__ldg(P.segments + 4 * s) > i) continue;  // padding before the next segment
    bool skip;
    const SegmentScalars sc = record_scalars(P.records + 3 * s, skip);
    if (skip) continue;
    float pi;
    if constexpr (R) {
      pi = join_remainder(reinterpret_cast<const uint16_t*>(o)[i], p[i]);
    } else {
      pi = p[i];
    }
    adam_scalar(to_float(g[i]), pi, m[k], v[k], sc, P.adam_w);
    if constexpr (R) {
      split_remainder(pi, reinterpret_cast<uint16_t*>(o)[i], p[i]);
    } else {
      p[i] = pi;
      if constexpr (!std::is_void_v<O>) o[i] = from_float<O>(pi);
    }
  }
}

__device__ __forceinline__ void map_to_shared(const MomentP& q, float* smap, float* smid) {
  if (!quant::is_codes(q.kind)) return;
  const int n = q.kind == quant::kCodes8 ? 256 : 16;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    smap[i] = q.map[i];
    if (i + 1 < n) smid[i] = q.mids[i];
  }
}

// Every load a thread can issue without the maps or its segment (its grads, masters, codes or float
// moments, its unit's segment range, found-inf) is issued first, so their latencies overlap the
// maps' staging and the barrier instead of following them.
template <typename G, typename O, bool R>
__global__ void __launch_bounds__(kThreads) blockwise_kernel(const Params P) {
  __shared__ float smap[2][256], smid[2][256];
  __shared__ unsigned int smax[2][kMaxBlocksPerTile];
  const int64_t tile_lo = int64_t(blockIdx.x) * P.units_per_tile * P.unit;
  const int64_t tile_hi = min(P.numel, tile_lo + int64_t(P.units_per_tile) * P.unit);
  const int64_t e = tile_lo + int64_t(threadIdx.x) * kE;
  const int n = e < tile_hi ? static_cast<int>(min(int64_t(kE), tile_hi - e)) : 0;
  const bool vec = P.vec_ok && n == kE;
  float m[kE], v[kE], rg[kE], rp[kE];
#pragma unroll
  for (int k = 0; k < kE; ++k) m[k] = v[k] = rg[k] = rp[k] = 0.0f;
  RawCodes cm, cv;
  if (vec) fetch_params<G, O, R>(P, e, rg, rp);
  fetch_moment(P.m, e, n, P.vec_ok, m, cm);
  fetch_moment(P.v, e, n, P.vec_ok, v, cv);
  int s = 0, s_end = 0;  // the unit's range of segment rows
  if (n > 0) {
    s = __ldg(P.units + 2 * (e / P.unit));
    s_end = __ldg(P.units + 2 * (e / P.unit) + 1);
  }
  if (load_scalar(P.found_inf, P.found_code, 0) != 0.0) return;  // the whole step is skipped: nothing written
  map_to_shared(P.m, smap[0], smid[0]);
  map_to_shared(P.v, smap[1], smid[1]);
  for (int i = threadIdx.x; i < 2 * kMaxBlocksPerTile; i += kThreads) (&smax[0][0])[i] = 0u;
  __syncthreads();
  decode_moment(P.m, smap[0], n, cm, m);
  decode_moment(P.v, smap[1], n, cv, v);
  if (n > 0) update<G, O, R>(P, e, n, s, s_end, vec, rg, rp, m, v);
  store_moment(P.m, smid[0], smax[0], e, n, P.vec_ok, m);
  store_moment(P.v, smid[1], smax[1], e, n, P.vec_ok, v);
}

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

MomentP moment_params(const QuantMoment& q) {
  MomentP p{};
  p.values = q.values.data_ptr();
  p.kind = static_cast<int>(q.kind);
  if (quant::is_codes(p.kind)) {
    p.scales = q.scales.data_ptr<float>();
    p.map = q.map.data_ptr<float>();
    p.mids = q.mids.data_ptr<float>();
    p.search = q.search.data_ptr<int32_t>();
    p.block = static_cast<int>(q.block);
  }
  return p;
}

// 16 bytes for float values, 8 for 8-bit codes (8 per thread), 4 for 4-bit ones.
bool moment_aligned(const QuantMoment& q) {
  const int bytes = q.kind == quant::kCodes8 ? 8 : (q.kind == quant::kCodes4 ? 4 : 16);
  return aligned(q.values.data_ptr(), bytes);
}

}  // namespace

void adam_step_blockwise(const BlockwiseArgs& a, const at::Tensor& units, const c10::optional<at::Tensor>& records,
                         int64_t record_offset) {
  SHARDAMP_CHECK(a.unit <= kBlockwiseCudaTile, "adam_step_blockwise: blocks of ", a.unit,
                 " elements (their least common multiple) exceed the CUDA tile of ", kBlockwiseCudaTile,
                 "; pass a smaller quant_block_size");
  for (const QuantMoment* q : {&a.exp_avg, &a.exp_avg_sq}) {
    SHARDAMP_CHECK(!quant::is_codes(static_cast<int>(q->kind)) || q->block % 16 == 0,
                   "adam_step_blockwise: CUDA takes blocks of a multiple of 16 elements, got ", q->block);
  }
  const c10::cuda::CUDAGuard guard(a.grad.device());
  Params P{};
  P.grad = a.grad.data_ptr();
  P.master = a.master.data_ptr();
  P.model_out = a.model_out ? a.model_out->data_ptr() : nullptr;
  P.m = moment_params(a.exp_avg);
  P.v = moment_params(a.exp_avg_sq);
  P.units = units.data_ptr<int32_t>();
  P.segments = a.segments.data_ptr<int64_t>();
  P.found_inf = a.found_inf.data_ptr();
  P.found_code = scalar_code(a.found_inf);
  P.numel = a.grad.numel();
  P.unit = static_cast<int>(a.unit);
  P.units_per_tile = static_cast<int>(std::max<int64_t>(1, kBlockwiseCudaTile / a.unit));
  P.adam_w = a.adam_w_mode;
  P.vec_ok = aligned(P.grad, 16) && aligned(P.master, 16) && (P.model_out == nullptr || aligned(P.model_out, 16)) &&
             moment_aligned(a.exp_avg) && moment_aligned(a.exp_avg_sq);
  at::Tensor own;  // without the optimizer's records: this shard's own prepare launch
  if (records) {
    P.records = reinterpret_cast<const float4*>(records->data_ptr<float>() + record_offset * kRecordFloats);
  } else {
    own = adam_prepare(a.segments, a.hparams, a.steps, a.touched, a.grad_coef, a.found_inf, a.bias_correction);
    P.records = reinterpret_cast<const float4*>(own.data_ptr<float>());
  }
  const int64_t nunits = units.size(0);
  const int64_t tiles = (nunits + P.units_per_tile - 1) / P.units_per_tile;
  SHARDAMP_CHECK(tiles < (int64_t(1) << 31), "adam_step_blockwise: too many tiles for one launch");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool remainders = a.master.scalar_type() == at::kShort;
  dispatch_float<__nv_bfloat16, __half>(a.grad.scalar_type(), "grad", [&](auto gt) {
    using G = typename decltype(gt)::type;
    if (remainders) {
      blockwise_kernel<G, __nv_bfloat16, true><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(P);
    } else if (!a.model_out) {
      blockwise_kernel<G, void, false><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(P);
    } else {
      dispatch_float<__nv_bfloat16, __half>(a.model_out->scalar_type(), "model_out", [&](auto ot) {
        using O = typename decltype(ot)::type;
        blockwise_kernel<G, O, false><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(P);
      });
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace shardamp
