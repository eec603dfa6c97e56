// The CPU Adam step over blockwise moments ("8bit" / "4bit"; contract: optim/kernels/reference.py,
// adam_step over quant.QuantizedShard), bitwise the reference.
//
// The shard is cut into units of whole blocks of every blockwise moment (BlockwiseArgs::unit),
// handed to at::parallel_for. A worker takes a unit in one pass: both moments into two
// unit-sized fp32 buffers of its own (codes dequantized, bf16 widened), the update of every
// segment crossing the unit (adam_chunk, the float-moment step's vectorized loop, over the
// buffers), then the buffers stored back (each block against its new absmax, bf16 rounded to
// nearest even). Every element of a unit is stored again, those of untouched params and padding
// too, as the reference does. The buffers live for one unit: no fp32 copy of a moment outlives
// the call. Found-inf and the touched flags are host memory here: read directly.

#include "../blockwise.h"
#include "adam_vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace shardamp {
namespace cpu {
namespace {

struct Seg {
  int64_t start, end;
  bool skip;
  SegmentScalars sc;
};

// Elements [lo, lo + n) of a moment as fp32 into buf (lo on the moment's block grid).
void load_moment(const QuantMoment& q, int64_t lo, int64_t n, float* buf) {
  if (q.kind == quant::kFloat32) {
    std::memcpy(buf, q.values.data_ptr<float>() + lo, n * sizeof(float));
    return;
  }
  if (q.kind == quant::kBFloat16) {
    const at::BFloat16* s = q.values.data_ptr<at::BFloat16>() + lo;
    for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<float>(s[k]);
    return;
  }
  const float* map = q.map.data_ptr<float>();
  const float* scales = q.scales.data_ptr<float>();
  const uint8_t* codes = q.values.data_ptr<uint8_t>();
  const int64_t block = q.block;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const float s = scales[(lo + b0) / block];
    const int64_t b1 = std::min(n, b0 + block);
    if (q.kind == quant::kCodes8) {
      const uint8_t* c = codes + lo;
      for (int64_t k = b0; k < b1; ++k) buf[k] = quant::dequantize(map, c[k], s);
    } else {  // blocks are even: a byte never straddles two (or two units)
      const uint8_t* c = codes + lo / 2;
      int64_t k = b0;
      for (; k + 1 < b1; k += 2) {
        const int byte = c[k / 2];
        buf[k] = quant::dequantize(map, byte & 15, s);
        buf[k + 1] = quant::dequantize(map, byte >> 4, s);
      }
      if (k < b1) buf[k] = quant::dequantize(map, c[k / 2] & 15, s);  // a shard's odd last element
    }
  }
}

template <int Bits>
inline int code_of(const float* mids, float x, float absmax) {
  return quant::nearest_code<Bits>(mids, quant::scaled(x, absmax));
}

// buf back into elements [lo, lo + n) of a moment: each block's absmax its new scale.
void store_moment(const QuantMoment& q, int64_t lo, int64_t n, const float* buf) {
  if (q.kind == quant::kFloat32) {
    std::memcpy(q.values.data_ptr<float>() + lo, buf, n * sizeof(float));
    return;
  }
  if (q.kind == quant::kBFloat16) {
    at::BFloat16* d = q.values.data_ptr<at::BFloat16>() + lo;
    for (int64_t k = 0; k < n; ++k) d[k] = static_cast<at::BFloat16>(buf[k]);  // to nearest even
    return;
  }
  const float* mids = q.mids.data_ptr<float>();
  float* scales = q.scales.data_ptr<float>();
  uint8_t* codes = q.values.data_ptr<uint8_t>();
  const int64_t block = q.block;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t b1 = std::min(n, b0 + block);
    float absmax = 0.0f;
    for (int64_t k = b0; k < b1; ++k) absmax = std::max(absmax, std::fabs(buf[k]));
    scales[(lo + b0) / block] = absmax;
    if (q.kind == quant::kCodes8) {
      uint8_t* c = codes + lo;
      for (int64_t k = b0; k < b1; ++k) c[k] = static_cast<uint8_t>(code_of<8>(mids, buf[k], absmax));
    } else {
      uint8_t* c = codes + lo / 2;
      int64_t k = b0;
      for (; k + 1 < b1; k += 2) {
        c[k / 2] = quant::pack4(code_of<4>(mids, buf[k], absmax), code_of<4>(mids, buf[k + 1], absmax));
      }
      if (k < b1) c[k / 2] = quant::pack4(code_of<4>(mids, buf[k], absmax), 0);  // pack4's padding code
    }
  }
}

template <typename G, typename O, bool R>
void blockwise_impl(const BlockwiseArgs& a, const std::vector<Seg>& segs) {
  using P = std::conditional_t<R, int16_t, float>;
  const int64_t n = a.grad.numel(), unit = a.unit;
  const int64_t nunits = (n + unit - 1) / unit;
  const G* g = a.grad.data_ptr<G>();
  P* p = static_cast<P*>(a.master.data_ptr());
  O* o = nullptr;
  if constexpr (!std::is_void_v<O>) o = static_cast<O*>(a.model_out->data_ptr());
  const bool adam_w = a.adam_w_mode;
  at::parallel_for(0, nunits, std::max<int64_t>(1, kChunk / unit), [&](int64_t u0, int64_t u1) {
    std::vector<float> mbuf(unit), vbuf(unit);
    // the first segment ending after the task's first unit (segments sorted, disjoint)
    auto first = std::upper_bound(segs.begin(), segs.end(), u0 * unit,
                                  [](int64_t x, const Seg& s) { return x < s.end; });
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t lo = u * unit, hi = std::min(n, lo + unit);
      load_moment(a.exp_avg, lo, hi - lo, mbuf.data());
      load_moment(a.exp_avg_sq, lo, hi - lo, vbuf.data());
      while (first != segs.end() && first->end <= lo) ++first;
      for (auto s = first; s != segs.end() && s->start < hi; ++s) {
        if (s->skip) continue;
        const int64_t i0 = std::max(lo, s->start), i1 = std::min(hi, s->end);
        O* oi = nullptr;
        if constexpr (!std::is_void_v<O>) oi = o + i0;
        adam_chunk<G, O, float, float, R>(g + i0, p + i0, mbuf.data() + (i0 - lo), vbuf.data() + (i0 - lo), oi, 0,
                                          i1 - i0, s->sc, adam_w);
      }
      store_moment(a.exp_avg, lo, hi - lo, mbuf.data());
      store_moment(a.exp_avg_sq, lo, hi - lo, vbuf.data());
    }
  });
}

}  // namespace

void adam_step_blockwise(const BlockwiseArgs& a) {
  if (read_scalar(a.found_inf, 0) != 0.0) return;  // the skip flag: nothing is written
  const at::Tensor table = a.segments.contiguous();
  const int64_t* st = table.data_ptr<int64_t>();
  const int64_t nseg = table.size(0);
  const double grad_coef = read_scalar(a.grad_coef, 0);
  const at::Tensor hp = a.hparams.contiguous();
  std::vector<Seg> segs;
  segs.reserve(nseg);
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t param = st[4 * i + 2], group = st[4 * i + 3];
    if (st[4 * i + 1] == 0) continue;
    segs.push_back(Seg{st[4 * i], st[4 * i] + st[4 * i + 1], read_scalar(a.touched, param) == 0.0,
                       segment_scalars(hp.data_ptr<double>() + 5 * group, read_scalar(a.steps, param), grad_coef,
                                       a.bias_correction)});
  }
  std::sort(segs.begin(), segs.end(), [](const Seg& x, const Seg& y) { return x.start < y.start; });
  const bool remainders = a.master.scalar_type() == at::kShort;
  dispatch_float<at::BFloat16, at::Half>(a.grad.scalar_type(), "grad", [&](auto gt) {
    using G = typename decltype(gt)::type;
    if (remainders) return blockwise_impl<G, at::BFloat16, true>(a, segs);
    if (!a.model_out) return blockwise_impl<G, void, false>(a, segs);
    dispatch_float<at::BFloat16, at::Half>(a.model_out->scalar_type(), "model_out", [&](auto ot) {
      blockwise_impl<G, typename decltype(ot)::type, false>(a, segs);
    });
  });
}

}  // namespace cpu
}  // namespace shardamp
