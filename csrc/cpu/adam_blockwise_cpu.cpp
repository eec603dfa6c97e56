// The CPU Adam step over blockwise moments ("8bit" / "4bit"; contract: optim/kernels/reference.py,
// adam_step over quant.QuantizedShard), bitwise the reference.
//
// The shard is cut into units of whole blocks of every blockwise moment (BlockwiseArgs::unit),
// handed to at::parallel_for. A worker takes a unit in one pass: both moments into two
// unit-sized fp32 buffers of its own (codes dequantized, bf16 widened), the update of every
// segment crossing the unit (adam_chunk, the float-moment step's vectorized loop, over the
// buffers), then the buffers stored back (each block against its new absmax, bf16 rounded to
// nearest even). The code map lookups and the nearest-code search (its table, quant.h) run a
// vector of elements at a time through gathers (at::vec, the module's ISA): the same compares and rounded operations as
// the scalar quant.h functions the tails use, so the same bits. Every element of a unit is stored again, those of untouched params and padding
// too, as the reference does. The buffers live for one unit: no fp32 copy of a moment outlives
// the call. Found-inf and the touched flags are host memory here: read directly.

#include "../blockwise.h"
#include "adam_vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace shardamp {
namespace cpu {
namespace {

struct Seg {
  int64_t start, end;
  bool skip;
  SegmentScalars sc;
};

using iVec = Vectorized<int32_t>;
static_assert(iVec::size() == kW, "one int32 lane per float lane");

// out[k] = map[codes[k]] * scale for k < n (codes widened to int32 in idx first): the table
// lookups as vector gathers, the multiply rounded as the scalar one.
inline void dequantize_run(const float* map, const int32_t* idx, int64_t n, float scale, float* out) {
  const fVec s(scale);
  int64_t k = 0;
  for (; k + kW <= n; k += kW) (at::vec::gather<4>(map, iVec::loadu(idx + k)) * s).store(out + k);
  for (; k < n; ++k) out[k] = quant::dequantize(map, idx[k], scale);
}

// codes[k] = quant::nearest_code_in(mids, table, ..., scaled(x[k], absmax)) for k < n: the table
// search run on a vector of elements at once (gathers), the same keys and compares as the scalar
// one, so the same codes. last: the index of the last midpoint (a gather never reads past it).
inline void codes_run(const float* mids, const int32_t* table, int last, const float* x, int64_t n, float absmax,
                      int32_t* codes) {
  const int first = table[quant::kSearchEntries];
  int64_t k = 0;
  if (absmax > 0.0f) {
    const fVec s(absmax), zero(0.0f);
    for (; k + kW <= n; k += kW) {
      fVec y = fVec::loadu(x + k) / s;
      y = fVec::blendv(y, zero, y == zero);  // -0 keyed as +0
      const iVec bits = at::vec::cast<int32_t>(y);  // the float's bits
      const iVec ordered = bits ^ ((bits >> iVec(31)) | iVec(std::numeric_limits<int32_t>::min()));
      const iVec key = (ordered >> iVec(32 - quant::kSearchKeyBits)) & iVec(quant::kSearchEntries - 1);
      const iVec entry = at::vec::gather<4>(table, key);
      iVec pos = entry & iVec(0xffff);
      const iVec end = pos + (entry >> iVec(16));
      for (int step = first; step > 0; step >>= 1) {
        const iVec next = pos + iVec(step);
        const fVec mid = at::vec::gather<4>(mids, at::vec::minimum(next - iVec(1), iVec(last)));
        pos = pos + (at::vec::cast<int32_t>(mid < y) & (next <= end) & iVec(step));  // masks: all ones
      }
      pos.store(codes + k);
    }
  }
  for (; k < n; ++k) codes[k] = quant::nearest_code_in(mids, table, first, quant::scaled(x[k], absmax));
}

inline float absmax_run(const float* x, int64_t n) {
  fVec acc(0.0f);
  int64_t k = 0;
  for (; k + kW <= n; k += kW) acc = at::vec::maximum(acc, fVec::loadu(x + k).abs());
  alignas(64) float lanes[kW];
  acc.store(lanes);
  float m = 0.0f;
  for (int64_t j = 0; j < kW; ++j) m = std::max(m, lanes[j]);
  for (; k < n; ++k) m = std::max(m, std::fabs(x[k]));
  return m;
}

// Elements [lo, lo + n) of a moment as fp32 into buf (lo on the moment's block grid).
void load_moment(const QuantMoment& q, int64_t lo, int64_t n, float* buf, int32_t* idx) {
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
  if (q.kind == quant::kCodes8) {
    const uint8_t* c = codes + lo;
    for (int64_t k = 0; k < n; ++k) idx[k] = c[k];
  } else {  // blocks and units are even: a byte never straddles two
    const uint8_t* c = codes + lo / 2;
    for (int64_t k = 0; k < n; ++k) idx[k] = (c[k / 2] >> (4 * (k & 1))) & 15;
  }
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    dequantize_run(map, idx + b0, std::min(n, b0 + block) - b0, scales[(lo + b0) / block], buf + b0);
  }
}

// buf back into elements [lo, lo + n) of a moment: each block's absmax its new scale.
void store_moment(const QuantMoment& q, int64_t lo, int64_t n, const float* buf, int32_t* idx) {
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
  const int32_t* table = q.search.data_ptr<int32_t>();
  const int last = static_cast<int>(q.mids.numel()) - 1;
  float* scales = q.scales.data_ptr<float>();
  uint8_t* codes = q.values.data_ptr<uint8_t>();
  const int64_t block = q.block;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = std::min(n, b0 + block) - b0;
    const float absmax = absmax_run(buf + b0, len);
    scales[(lo + b0) / block] = absmax;
    codes_run(mids, table, last, buf + b0, len, absmax, idx + b0);
  }
  if (q.kind == quant::kCodes8) {
    uint8_t* c = codes + lo;
    for (int64_t k = 0; k < n; ++k) c[k] = static_cast<uint8_t>(idx[k]);
  } else {
    uint8_t* c = codes + lo / 2;
    int64_t k = 0;
    for (; k + 1 < n; k += 2) c[k / 2] = quant::pack4(idx[k], idx[k + 1]);
    if (k < n) c[k / 2] = quant::pack4(idx[k], 0);  // a shard's odd last element: pack4's padding code
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
    std::vector<int32_t> idx(unit);  // codes widened to int32: the gathers' indices
    // the first segment ending after the task's first unit (segments sorted, disjoint)
    auto first = std::upper_bound(segs.begin(), segs.end(), u0 * unit,
                                  [](int64_t x, const Seg& s) { return x < s.end; });
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t lo = u * unit, hi = std::min(n, lo + unit);
      load_moment(a.exp_avg, lo, hi - lo, mbuf.data(), idx.data());
      load_moment(a.exp_avg_sq, lo, hi - lo, vbuf.data(), idx.data());
      while (first != segs.end() && first->end <= lo) ++first;
      for (auto s = first; s != segs.end() && s->start < hi; ++s) {
        if (s->skip) continue;
        const int64_t i0 = std::max(lo, s->start), i1 = std::min(hi, s->end);
        O* oi = nullptr;
        if constexpr (!std::is_void_v<O>) oi = o + i0;
        adam_chunk<G, O, float, float, R>(g + i0, p + i0, mbuf.data() + (i0 - lo), vbuf.data() + (i0 - lo), oi, 0,
                                          i1 - i0, s->sc, adam_w);
      }
      store_moment(a.exp_avg, lo, hi - lo, mbuf.data(), idx.data());
      store_moment(a.exp_avg_sq, lo, hi - lo, vbuf.data(), idx.data());
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
