// CPU versions of the statistics kernels whose contract is written at the top of
// optim/kernels/reference.py: grad_stats (sum |g|^p or max|g|, plus a non-finite flag, in one read
// pass), group_partials (per param group), nonfinite_flags and bucket_stats (a landed bucket's
// flags and L2 partial in one pass), and the last two over grads held where autograd left them
// (grad_parts.h).
//
// They split their work into fixed-size chunks and hand chunks to at::parallel_for. The chunk
// size, not the thread count, decides the summation order, so a result is the same bit for bit
// on 1 or N threads, and over the parts of a bucket as over its landed shard.
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
// grad_stats

constexpr int64_t kStatsChunk = 1 << 16;

// Finite p: accumulate |g|^p; kMax: NaN-propagating max of |g| (torch.maximum semantics).
enum class Norm { kTwo, kOne, kGeneric, kMax };

template <Norm N>
inline fVec stat_combine(const fVec& acc, const fVec& x, const fVec& p) {
  if constexpr (N == Norm::kTwo) return acc + x * x;
  if constexpr (N == Norm::kOne) return acc + x.abs();
  if constexpr (N == Norm::kGeneric) return acc + x.abs().pow(p);
  return at::vec::maximum(acc, x.abs());  // propagates NaN
}

template <Norm N>
inline float stat_combine(float acc, float x, float p) {
  if constexpr (N == Norm::kTwo) return acc + x * x;
  if constexpr (N == Norm::kOne) return acc + std::fabs(x);
  if constexpr (N == Norm::kGeneric) return acc + std::pow(std::fabs(x), p);
  return nan_max(acc, std::fabs(x));
}

// A type of this namespace, so that std::vector<Partial> is instantiated once per CPU build.
struct Partial {
  float acc, bad;
};

// Where a chunk's elements are read from: the flat shard (FlatSrc), or the grads of a bucket left
// where autograd put them (PartsSrc, grad_parts.h). ``run(i, hi, n)``: the elements from index i
// on, ``n`` >= 1 whole blocks of kV of them readable from there in a row (i + n * kV <= hi);
// ``at(i)``: one element. Reads go up within a chunk.
template <typename T>
struct FlatSrc {
  const T* g;
  const T* run(int64_t i, int64_t hi, int64_t& n) const {
    n = (hi - i) / kV;
    return g + i;
  }
  T at(int64_t i) const { return g[i]; }
};

template <typename T>
struct PartsSrc {
  const GradPart* parts;
  int64_t n_parts;
  int64_t cur;  // the first part ending after the last index read
  alignas(64) T tmp[kV];

  PartsSrc(const std::vector<GradPart>& p, int64_t from)
      : parts(p.data()), n_parts(static_cast<int64_t>(p.size())), cur(0) {
    // parts are sorted and disjoint, so their ends are sorted too
    cur = part_at(p, from) - p.begin();
  }
  const T* data(int64_t k) const { return static_cast<const T*>(parts[k].data); }
  const T* run(int64_t i, int64_t hi, int64_t& n) {
    while (cur < n_parts && parts[cur].start + parts[cur].len <= i) ++cur;
    if (cur < n_parts && parts[cur].start <= i && i + kV <= parts[cur].start + parts[cur].len) {
      n = (std::min(hi, parts[cur].start + parts[cur].len) - i) / kV;
      return data(cur) + (i - parts[cur].start);
    }
    for (int64_t k = 0; k < kV; ++k) tmp[k] = at(i + k);  // across a part's edge, or a gap (zeros)
    n = 1;
    return tmp;
  }
  T at(int64_t i) const {
    for (int64_t k = cur; k < n_parts && parts[k].start <= i; ++k) {
      if (i < parts[k].start + parts[k].len) return data(k)[i - parts[k].start];
    }
    return T(0.f);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// chunk_partial's L2 sums of fp32 grads at 256 bits in the AVX-512 build, lane for lane its
// 512-bit loop's (a0's 16 lanes are acc[0] and acc[1], a1's acc[2] and acc[3]; the same adds in
// the same order), so the bits are the same; why 256: as the step's update (adam_vec.h,
// update_fp32_256), the loop measured faster in the iteration at this width.
template <bool Bad, typename Src>
inline Partial chunk_partial_l2_256(Src& src, int64_t lo, int64_t hi) {
  __m256 acc[4], bad[4];
  for (int k = 0; k < 4; ++k) acc[k] = bad[k] = _mm256_setzero_ps();
  int64_t i = lo;
  while (i + kV <= hi) {
    int64_t n;
    const float* g = src.run(i, hi, n);
    for (const float* end = g + n * kV; g != end; g += kV) {
      for (int k = 0; k < 4; ++k) {
        const __m256 x = _mm256_loadu_ps(g + 8 * k);
        acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(x, x));
        if constexpr (Bad) bad[k] = _mm256_add_ps(bad[k], _mm256_sub_ps(x, x));
      }
    }
    i += n * kV;
  }
  alignas(64) float la[2 * 8], lb[2 * 8];
  _mm256_store_ps(la, _mm256_add_ps(acc[0], acc[2]));
  _mm256_store_ps(la + 8, _mm256_add_ps(acc[1], acc[3]));
  _mm256_store_ps(lb, _mm256_add_ps(bad[0], bad[2]));
  _mm256_store_ps(lb + 8, _mm256_add_ps(bad[1], bad[3]));
  float s = 0.f, f = 0.f;
  for (int64_t k = 0; k < 16; ++k) {
    s = s + la[k];
    f += lb[k];
  }
  for (; i < hi; ++i) {
    const float x = src.at(i);
    s = s + x * x;
    if constexpr (Bad) f += x - x;
  }
  return Partial{s, f};
}
static_assert(kW == 16 && kV == 32, "chunk_partial_l2_256 mirrors the 512-bit loop: two vectors of 16 lanes a step");
#endif

// One chunk's partial [lo, hi) read from ``src``: the unit of grad_stats' fixed summation order.
// ``Bad`` false: no non-finite sum (``bad`` 0), for a caller that treats a non-finite ``acc`` (an
// inf/NaN element, or an overflow) as "read it again with the sum" (the same ``acc`` either way).
template <typename T, Norm N, typename Src, bool Bad = true>
inline Partial chunk_partial_src(Src& src, int64_t lo, int64_t hi, float p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && N == Norm::kTwo) return chunk_partial_l2_256<Bad>(src, lo, hi);
#endif
  const fVec vp(p);
  // Two accumulators per lane keep two independent dependency chains in flight. `bad`
  // sums x - x, which is 0 for finite x and NaN for inf/NaN, and stays NaN once it is.
  fVec a0(0.f), a1(0.f), b0(0.f), b1(0.f);
  int64_t i = lo;
  while (i + kV <= hi) {
    int64_t n;
    const T* g = src.run(i, hi, n);
    for (const T* end = g + n * kV; g != end; g += kV) {
      fVec x0, x1;
      load2(g, x0, x1);
      a0 = stat_combine<N>(a0, x0, vp);
      a1 = stat_combine<N>(a1, x1, vp);
      if constexpr (Bad) {
        b0 = b0 + (x0 - x0);
        b1 = b1 + (x1 - x1);
      }
    }
    i += n * kV;
  }
  float s = 0.f, f = 0.f;
  alignas(64) float la[kW], lb[kW];
  if constexpr (N == Norm::kMax) {
    at::vec::maximum(a0, a1).store(la);
  } else {
    (a0 + a1).store(la);
  }
  (b0 + b1).store(lb);
  for (int64_t k = 0; k < kW; ++k) {
    s = N == Norm::kMax ? nan_max(s, la[k]) : s + la[k];
    f += lb[k];
  }
  for (; i < hi; ++i) {
    const float x = static_cast<float>(src.at(i));
    s = stat_combine<N>(s, x, p);
    if constexpr (Bad) f += x - x;
  }
  return Partial{s, f};
}

template <typename T, Norm N>
inline Partial chunk_partial(const T* g, int64_t lo, int64_t hi, float p) {
  FlatSrc<T> src{g};
  return chunk_partial_src<T, N>(src, lo, hi, p);
}

// Every chunk's partial, in parallel, in chunk order.
template <typename T, Norm N>
std::vector<Partial> chunk_partials(const T* g, int64_t n, float p) {
  const int64_t nchunks = (n + kStatsChunk - 1) / kStatsChunk;
  std::vector<Partial> part(nchunks);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      part[c] = chunk_partial<T, N>(g, c * kStatsChunk, std::min(n, (c + 1) * kStatsChunk), p);
    }
  });
  return part;
}

// The chunks' partials folded in chunk order into out (assigned instead of added to if `assign`).
template <Norm N>
void fold_partials(const std::vector<Partial>& part, float* out, bool assign) {
  const float before0 = assign ? 0.f : out[0];
  float s = N == Norm::kMax ? before0 : 0.f, f = 0.f;
  for (const Partial& q : part) {
    s = N == Norm::kMax ? nan_max(s, q.acc) : s + q.acc;
    f += q.bad;
  }
  out[0] = N == Norm::kMax ? s : before0 + s;
  const float before1 = assign ? 0.f : out[1];
  out[1] = f != 0.f ? std::fmax(before1, 1.f) : before1;  // NaN != 0 too
}

template <typename T, Norm N>
void stats_impl(const T* g, int64_t n, float p, float* out) {
  fold_partials<N>(chunk_partials<T, N>(g, n, p), out, false);
}

template <typename T>
void stats_dispatch_norm(const T* g, int64_t n, double norm_type, float* out) {
  if (std::isinf(norm_type)) return stats_impl<T, Norm::kMax>(g, n, 0.f, out);
  if (norm_type == 2.0) return stats_impl<T, Norm::kTwo>(g, n, 2.f, out);
  if (norm_type == 1.0) return stats_impl<T, Norm::kOne>(g, n, 1.f, out);
  stats_impl<T, Norm::kGeneric>(g, n, static_cast<float>(norm_type), out);
}

void grad_stats(const at::Tensor& grad, at::Tensor& out, double norm_type) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  float* o = out.data_ptr<float>();
  switch (grad.scalar_type()) {
    case at::kFloat: return stats_dispatch_norm(grad.data_ptr<float>(), n, norm_type, o);
    case at::kBFloat16: return stats_dispatch_norm(grad.data_ptr<at::BFloat16>(), n, norm_type, o);
    case at::kHalf: return stats_dispatch_norm(grad.data_ptr<at::Half>(), n, norm_type, o);
    default: SHARDAMP_CHECK(false, "grad_stats: unsupported grad dtype ", grad.scalar_type());
  }
}

// ---------------------------------------------------------------------------------------------
// group_partials: each param group's partial of a shard, segment by segment, with grad_stats'
// arithmetic: a segment of at most one chunk is one chunk's partial (many small segments are
// computed in parallel, each by one thread), a longer one goes through stats_impl; folded into
// out[group] in segment order, so the result does not depend on the thread count.
// ``row_data(r)``: row r's first element, or null where no grad holds it (grads held in place: a
// param with no grad, whose landed slot would be zeros; its partial is then 0, as theirs).
template <typename T, Norm N, typename RowData>
void groups_impl(const RowData& row_data, const int64_t* rows, int64_t count, float p, float* o) {
  std::vector<float> part(count, 0.f);
  at::parallel_for(0, count, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t len = rows[4 * r + 1];
      const T* g = row_data(r);
      if (g != nullptr && len > 0 && len <= kStatsChunk) part[r] = chunk_partial<T, N>(g, 0, len, p).acc;
    }
  });
  for (int64_t r = 0; r < count; ++r) {
    const int64_t len = rows[4 * r + 1], group = rows[4 * r + 3];
    if (len == 0) continue;
    const T* g = row_data(r);
    if (g != nullptr && len > kStatsChunk) {
      float big[2] = {0.f, 0.f};
      stats_impl<T, N>(g, len, p, big);
      part[r] = big[0];
    }
    o[group] = N == Norm::kMax ? nan_max(o[group], part[r]) : o[group] + part[r];
  }
}

template <typename T, typename RowData>
void groups_dispatch_norm(const RowData& row_data, const int64_t* rows, int64_t count, double norm_type, float* o) {
  if (std::isinf(norm_type)) return groups_impl<T, Norm::kMax>(row_data, rows, count, 0.f, o);
  if (norm_type == 2.0) return groups_impl<T, Norm::kTwo>(row_data, rows, count, 2.f, o);
  if (norm_type == 1.0) return groups_impl<T, Norm::kOne>(row_data, rows, count, 1.f, o);
  groups_impl<T, Norm::kGeneric>(row_data, rows, count, static_cast<float>(norm_type), o);
}

template <typename T>
void groups_flat(const T* g, const int64_t* rows, int64_t count, double norm_type, float* o) {
  groups_dispatch_norm<T>([g, rows](int64_t r) { return g + rows[4 * r]; }, rows, count, norm_type, o);
}

template <typename T>
void groups_parts(const std::vector<GradPart>& parts, const int64_t* rows, int64_t count, double norm_type, float* o) {
  std::vector<const T*> first(count, nullptr);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t start = rows[4 * r], len = rows[4 * r + 1];
    auto it = part_at(parts, start);
    if (len > 0 && it != parts.end() && it->start <= start) {
      SHARDAMP_CHECK(start + len <= it->start + it->len, "group_partials_parts: segment ", r,
                     " crosses the end of its grad part");
      first[r] = static_cast<const T*>(it->data) + (start - it->start);
    }
  }
  groups_dispatch_norm<T>([&first](int64_t r) { return first[r]; }, rows, count, norm_type, o);
}

void group_partials(const at::Tensor& grad, const at::Tensor& segments, at::Tensor& out, double norm_type) {
  const int64_t* rows = segments.data_ptr<int64_t>();
  const int64_t count = segments.size(0);
  float* o = out.data_ptr<float>();
  switch (grad.scalar_type()) {
    case at::kFloat: return groups_flat(grad.data_ptr<float>(), rows, count, norm_type, o);
    case at::kBFloat16: return groups_flat(grad.data_ptr<at::BFloat16>(), rows, count, norm_type, o);
    case at::kHalf: return groups_flat(grad.data_ptr<at::Half>(), rows, count, norm_type, o);
    default: SHARDAMP_CHECK(false, "group_partials: unsupported grad dtype ", grad.scalar_type());
  }
}

void group_partials_parts(const std::vector<GradPart>& parts, at::ScalarType dtype, const at::Tensor& segments,
                          at::Tensor& out, double norm_type) {
  const int64_t* rows = segments.data_ptr<int64_t>();
  const int64_t count = segments.size(0);
  float* o = out.data_ptr<float>();
  switch (dtype) {
    case at::kFloat: return groups_parts<float>(parts, rows, count, norm_type, o);
    case at::kBFloat16: return groups_parts<at::BFloat16>(parts, rows, count, norm_type, o);
    case at::kHalf: return groups_parts<at::Half>(parts, rows, count, norm_type, o);
    default: SHARDAMP_CHECK(false, "group_partials_parts: unsupported grad dtype ", dtype);
  }
}

// ---------------------------------------------------------------------------------------------
// nonfinite_flags: one vectorized pass over the buffer (x - x is NaN exactly for inf/NaN), chunk
// by chunk in parallel; only a chunk holding a non-finite value is read again, element by
// element, each such element's row found by binary search (rows sorted by start).

constexpr int64_t kFlagsChunk = 1 << 16;

template <typename T>
float chunk_bad(const T* x, int64_t lo, int64_t hi) {
  fVec b0(0.f), b1(0.f);
  int64_t i = lo;
  for (; i + kV <= hi; i += kV) {
    fVec x0, x1;
    load2(x + i, x0, x1);
    b0 = b0 + (x0 - x0);
    b1 = b1 + (x1 - x1);
  }
  alignas(64) float lb[kW];
  (b0 + b1).store(lb);
  float f = 0.f;
  for (int64_t k = 0; k < kW; ++k) f += lb[k];
  for (; i < hi; ++i) {
    const float v = static_cast<float>(x[i]);
    f += v - v;
  }
  return f;
}

// Chunk c, known to hold an inf/NaN, read again element by element: each such element's row set.
template <typename T>
void flag_chunk(const T* x, int64_t n, int64_t c, const int64_t* rows, int64_t n_rows, float* flags,
                int64_t any_index) {
  for (int64_t i = c * kFlagsChunk, hi = std::min(n, (c + 1) * kFlagsChunk); i < hi; ++i) {
    flag_nonfinite(static_cast<float>(x[i]), i, rows, n_rows, flags, any_index);
  }
}

template <typename T>
void flags_impl(const T* x, int64_t n, const int64_t* rows, int64_t n_rows, float* flags, int64_t any_index) {
  const int64_t nchunks = (n + kFlagsChunk - 1) / kFlagsChunk;
  std::vector<char> bad(nchunks, 0);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      bad[c] = chunk_bad(x, c * kFlagsChunk, std::min(n, (c + 1) * kFlagsChunk)) != 0.f;  // NaN != 0 too
    }
  });
  for (int64_t c = 0; c < nchunks; ++c) {
    if (bad[c]) flag_chunk(x, n, c, rows, n_rows, flags, any_index);
  }
}

// bucket_stats: grad_stats' chunk partials (norm 2, so its sum exactly), whose non-finite sums
// also say which chunks to read again for the flags: one pass over the bucket unless it holds an
// inf/NaN.
template <typename T>
void bucket_stats_impl(const T* x, int64_t n, const int64_t* rows, int64_t n_rows, float* flags, int64_t any_index,
                       float* out, bool assign) {
  static_assert(kFlagsChunk == kStatsChunk, "a stats chunk is the flags' chunk");
  const std::vector<Partial> part = chunk_partials<T, Norm::kTwo>(x, n, 2.f);
  for (int64_t c = 0; c < static_cast<int64_t>(part.size()); ++c) {
    if (part[c].bad != 0.f) flag_chunk(x, n, c, rows, n_rows, flags, any_index);  // NaN != 0 too
  }
  fold_partials<Norm::kTwo>(part, out, assign);
}

void bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags, at::Tensor& out, bool assign) {
  const int64_t n = full.numel(), n_rows = rows.size(0);
  float* o = out.data_ptr<float>();
  if (n == 0) {
    if (assign) o[0] = o[1] = 0.f;
    return;
  }
  const int64_t* r = rows.data_ptr<int64_t>();
  float* f = flags.data_ptr<float>();
  const int64_t any = flags.numel() - 1;
  switch (full.scalar_type()) {
    case at::kFloat: return bucket_stats_impl(full.data_ptr<float>(), n, r, n_rows, f, any, o, assign);
    case at::kBFloat16: return bucket_stats_impl(full.data_ptr<at::BFloat16>(), n, r, n_rows, f, any, o, assign);
    case at::kHalf: return bucket_stats_impl(full.data_ptr<at::Half>(), n, r, n_rows, f, any, o, assign);
    default: SHARDAMP_CHECK(false, "bucket_stats: unsupported dtype ", full.scalar_type());
  }
}

// bucket_stats over a bucket's grads where autograd left them (grad_parts.h): the same chunks,
// each read through PartsSrc (its gaps as zeros, as a landed shard's), so the same partials.
template <typename T>
bool parts_stats_impl(const std::vector<GradPart>& parts, int64_t n, float* out, bool assign) {
  // the chunks wholly past the last part are zeros: their partials are +0, which the fold adds as
  // nothing (a chunk the last part reaches keeps its whole range: its lanes sum as the shard's)
  const int64_t end = parts.empty() ? 0 : std::min(n, parts.back().start + parts.back().len);
  const int64_t nchunks = (end + kStatsChunk - 1) / kStatsChunk;
  std::vector<Partial> part(nchunks);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * kStatsChunk;
      PartsSrc<T> src(parts, lo);
      // no non-finite sum: a finite sum of squares has only finite terms (then the sum would be
      // 0 exactly); a non-finite one goes to the landed shard's pass, which flags what it must
      part[c] = chunk_partial_src<T, Norm::kTwo, PartsSrc<T>, false>(src, lo, std::min(n, lo + kStatsChunk), 2.f);
    }
  });
  for (const Partial& q : part) {
    if (!std::isfinite(q.acc)) return false;
  }
  fold_partials<Norm::kTwo>(part, out, assign);
  return true;
}

bool bucket_stats_parts(const std::vector<GradPart>& parts, at::ScalarType dtype, int64_t n, float* out, bool assign) {
  if (n == 0) {
    if (assign) out[0] = out[1] = 0.f;
    return true;
  }
  switch (dtype) {
    case at::kFloat: return parts_stats_impl<float>(parts, n, out, assign);
    case at::kBFloat16: return parts_stats_impl<at::BFloat16>(parts, n, out, assign);
    case at::kHalf: return parts_stats_impl<at::Half>(parts, n, out, assign);
    default: SHARDAMP_CHECK(false, "bucket_stats_parts: unsupported dtype ", dtype);
  }
  return false;
}

void nonfinite_flags(const at::Tensor& full, const at::Tensor& rows, at::Tensor& flags) {
  const int64_t n = full.numel(), n_rows = rows.size(0);
  if (n == 0 || n_rows == 0) return;
  const int64_t* r = rows.data_ptr<int64_t>();
  float* f = flags.data_ptr<float>();
  const int64_t any = flags.numel() - 1;
  switch (full.scalar_type()) {
    case at::kFloat: return flags_impl(full.data_ptr<float>(), n, r, n_rows, f, any);
    case at::kBFloat16: return flags_impl(full.data_ptr<at::BFloat16>(), n, r, n_rows, f, any);
    case at::kHalf: return flags_impl(full.data_ptr<at::Half>(), n, r, n_rows, f, any);
    default: SHARDAMP_CHECK(false, "nonfinite_flags: unsupported dtype ", full.scalar_type());
  }
}

}  // namespace cpu
}  // namespace shardamp
