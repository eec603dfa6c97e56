// The CPU version of adam_step, whose contract is written at the top of
// optim/kernels/reference.py: one fused pass over the segments of a shard, chunk by chunk with
// at::parallel_for; the grads read from the flat shard or where autograd left them (grad_parts.h).
//
// optim/kernels/build.py compiles this file for the vector ISA torch itself uses (at::vec's
// CPU_CAPABILITY_AVX512 / _AVX2) or baseline x86-64, each into a separately named module.

#include "adam_vec.h"
#include "../grad_parts.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <tuple>
#include <vector>

namespace shardamp {
namespace cpu {
// ---------------------------------------------------------------------------------------------
// adam_step

struct Step {
  int64_t start, len;
  bool skip;
  SegmentScalars sc;
};

// With the grads where autograd left them (AdamArgs::parts): per segment, a pointer indexed as the
// shard is (segment_bases, as CUDA's launch takes them); a segment the step updates must have one.
template <typename G>
std::vector<const G*> segment_grads(const std::vector<GradPart>& parts, const std::vector<Step>& segs) {
  std::vector<int64_t> spans;
  spans.reserve(2 * segs.size());
  for (const Step& s : segs) spans.insert(spans.end(), {s.start, s.len});
  const std::vector<const void*> bases = segment_bases(parts, spans, c10::CppTypeToScalarType<G>::value, "adam_step");
  std::vector<const G*> out(segs.size(), nullptr);
  for (size_t k = 0; k < segs.size(); ++k) {
    const Step& s = segs[k];
    SHARDAMP_CHECK(bases[k] != nullptr || s.skip || s.len == 0, "adam_step: no grad part holds segment ", k,
                   " (elements ", s.start, " to ", s.start + s.len, ")");
    out[k] = static_cast<const G*>(bases[k]);
  }
  return out;
}

template <typename G, typename O, typename M, typename V, bool R>
void adam_impl(const AdamArgs& a, const std::vector<Step>& segs, const int64_t* chunks, int64_t nchunks) {
  const G* g = a.parts == nullptr ? a.grad.data_ptr<G>() : nullptr;
  const std::vector<const G*> seg_g = a.parts == nullptr ? std::vector<const G*>() : segment_grads<G>(*a.parts, segs);
  void* p = a.master.data_ptr();
  M* m = a.exp_avg.data_ptr<M>();
  V* v = a.exp_avg_sq.data_ptr<V>();
  O* o = nullptr;
  if constexpr (!std::is_void_v<O>) o = a.model_out->data_ptr<O>();
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t start = chunks[2 * c], packed = chunks[2 * c + 1];
      const int64_t seg = chunk_segment(packed);
      const Step& s = segs[seg];
      if (s.skip) continue;
      adam_chunk<G, O, M, V, R>(a.parts == nullptr ? g : seg_g[seg], p, m, v, o, start, start + chunk_length(packed), s.sc,
                                a.adam_w_mode);
    }
  });
}

void adam_step(const AdamArgs& a, const at::Tensor& chunk_table) {
  // On the CPU the "device scalars" are host memory: reading them here is free, and lets whole
  // segments (or the whole step) be skipped without touching their data.
  if (read_scalar(a.found_inf, 0) != 0.0) return;
  const at::Tensor seg_table = a.segments.contiguous();
  const int64_t* st = seg_table.data_ptr<int64_t>();
  const int64_t nseg = seg_table.size(0);
  const double grad_coef = read_scalar(a.grad_coef, 0);
  const at::Tensor hp = a.hparams.contiguous();
  std::vector<Step> segs(nseg);
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t pi = st[4 * i + 2], grp = st[4 * i + 3];
    segs[i].start = st[4 * i];
    segs[i].len = st[4 * i + 1];
    segs[i].skip = read_scalar(a.touched, pi) == 0.0;
    segs[i].sc = segment_scalars(hp.data_ptr<double>() + 5 * grp, read_scalar(a.steps, pi), grad_coef,
                                 a.bias_correction);
  }
  const at::Tensor chunks = chunk_table.contiguous();
  const int64_t* c = chunks.data_ptr<int64_t>();
  const int64_t n = chunks.size(0);
  dispatch_step<at::BFloat16, at::Half>(a.grad, a.master, a.exp_avg, a.exp_avg_sq, a.model_out,
                                        [&](auto g, auto o, auto m, auto v, auto r) {
    adam_impl<typename decltype(g)::type, typename decltype(o)::type, typename decltype(m)::type,
              typename decltype(v)::type, decltype(r)::value>(a, segs, c, n);
  });
}

#define SHARDAMP_STR2(x) #x
#define SHARDAMP_STR(x) SHARDAMP_STR2(x)
// Defined here, with the kernels, not in binding.cpp: this file is compiled for each vector ISA,
// binding.cpp once for every CPU module of an ahead-of-time build (setup.py).
#if defined(CPU_CAPABILITY)
const char* capability() { return SHARDAMP_STR(CPU_CAPABILITY); }
#else
const char* capability() { return "DEFAULT"; }
#endif

}  // namespace cpu
}  // namespace shardamp

