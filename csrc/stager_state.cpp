// StagerState's methods (grad_stager.h): staging a grad, the hook's body and its calls into
// Python, the bucket landings (land_grads.h) and the landing plan's landings in the hook.
#include "grad_stager.h"

#include <chrono>

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <memory>

#include "common.h"
#include "grad_release.h"
#include "grad_parts.h"
#include "land_grads.h"

namespace shardamp {

// binding.cpp: a landed bucket's non-finite flags and L2 partial in one pass (checked there)
void checked_bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor flags, at::Tensor out,
                          bool assign);

namespace stager {

std::atomic<bool> g_release_async{true};
std::atomic<bool> g_release_cpu{false};

int StagerState::stage_locked(int64_t i, at::Tensor& grad_slot) {
  const int64_t b = bucket_of[i];
  pending[b].emplace_back(i, grad_slot);
  grad_slot.reset();
  staged[i] = 1;
  touched[i] = 1;
  staged_bytes[b] += nbytes[i];
  fired[b] += 1;
  if (fired[b] >= expected[b]) return kComplete;
  if (staged_bytes[b] >= flush_bytes[b]) return kFlush;
  return kNone;
}

void StagerState::call(int event, int64_t arg) {
  py::gil_scoped_acquire gil;
  try {
    callback(event, arg);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("shardamp grad hook");
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    PyErr_WriteUnraisable(nullptr);
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "shardamp grad hook: unknown C++ error");
    PyErr_WriteUnraisable(nullptr);
  }
}

void StagerState::hook(int64_t i) noexcept {
  try {
    hook_body(i);
  } catch (const std::exception& e) {
    report(e.what());
  } catch (...) {
    report("unknown C++ error");
  }
}

void StagerState::report(const char* what) {
  py::gil_scoped_acquire gil;
  PyErr_SetString(PyExc_RuntimeError, (std::string("shardamp grad hook: ") + what).c_str());
  PyErr_WriteUnraisable(nullptr);
}

void StagerState::hook_body(int64_t i) {
  int event = kNone;
  int64_t arg = i;
  bool planned = false, began = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    at::Tensor& grad = params[i].mutable_grad();
    if (dead || !grad.defined() || !owned[i]) return;
    if (!armed || grad.layout() != at::kStrided || staged[i]) {
      event = kSlow;
    } else {
      event = stage_locked(i, grad);
      via_python[i] = 0;
      arg = bucket_of[i];
    }
    began = prearmed;  // the first grad of a pre-armed backward
    prearmed = false;
    if (began) began_quietly = true;
    if (event == kComplete && plan_active && arg >= plan_next && plan[arg].on &&
        (arg == plan_next || fired[plan_next] < expected[plan_next])) {
      // A bucket completing ahead of its turn stays staged while the next one's grads are still
      // coming: it lands after the buckets before it (land_planned_in_order), as Python's launches
      // wait for them, so the shared partial row adds the buckets in launch order either way
      planned = arg == plan_next;
      if (!planned) event = kNone;
    } else if (event != kNone) {
      plan_active = false;  // Python decides from here on (it adopts what was landed first)
    }
  }
  if (began) queue_quiet_end();  // no Python call: its end runs when the backward finishes
  if (planned) {
    land_planned_in_order(arg);
  } else if (event != kNone) {
    call(event, arg);
  }
}

void StagerState::queue_quiet_end() {
  std::weak_ptr<StagerState> weak = self;
  torch::autograd::Engine::get_default_engine().queue_callback([weak]() {
    auto st = weak.lock();
    if (!st) return;
    py::gil_scoped_acquire gil;
    py::object end;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      end = st->quiet_end;
    }
    if (end.is_none()) return;  // removed since
    // No C++ exception leaves here (a throw out of this module kills Python on some toolchains:
    // NOTES.md): `end` raises nothing; an error it meets it queues as a Python callback of its own,
    // which torch raises from backward() (grad_stager.py quiet_end_callback).
    PyObject* result = PyObject_CallObject(end.ptr(), nullptr);
    if (result == nullptr) {
      PyErr_WriteUnraisable(end.ptr());
    } else {
      Py_DECREF(result);
    }
  });
}

void StagerState::land_planned_in_order(int64_t b) {
  while (true) {
    land_planned(b);
    {
      std::lock_guard<std::mutex> lock(mu);
      b = plan_next;
      if (!plan_active || b >= static_cast<int64_t>(plan.size()) || fired[b] < expected[b]) {
        return;  // the plan ended, or the next bucket's grads are still coming: its own hook lands it
      }
      // not named (any more): another thread claimed it (it lands it), or the plan leaves it to
      // Python, which the next bucket's event calls (hook_body waits only behind expected grads)
      if (!plan[b].on) return;
      if (!pending[b].empty()) continue;  // it completed while waiting for this one: it lands now
      // Complete by its counts with nothing staged (no param of it takes a grad: a frozen layer's
      // bucket): Python launches it, then the buckets waiting behind it, in order, and arms the
      // plan again
      plan_active = false;
    }
    call(kComplete, b);
    return;
  }
}

bool StagerState::hold_planned(int64_t b, const PlanEntry& e, bool assign) {
  // under `mu` throughout: the grads checked are the grads taken
  std::lock_guard<std::mutex> lock(mu);
  std::vector<at::Tensor> grads, like;
  std::vector<int64_t> offsets;
  for (const auto& pg : pending[b]) {
    const at::Tensor& g = pg.second;
    const at::Tensor& p = params[pg.first];
    if (g.device() != e.like.device() || g.scalar_type() != e.like.scalar_type() || g.is_sparse() ||
        !g.is_non_overlapping_and_dense() || !p.is_non_overlapping_and_dense() || !same_layout(g, p)) {
      return false;
    }
    grads.push_back(g);
    like.push_back(p);
    offsets.push_back(offset[pg.first]);
  }
  if (grads.empty() || !checked_bucket_stats_parts(grads, offsets, e.numel, e.partial, assign, e.rows, e.flags)) {
    return false;
  }
  for (auto& pg : pending[b]) staged[pg.first] = 0;
  plan_landed.push_back(Landed{b, at::Tensor(), std::move(like), std::move(offsets), std::move(grads)});
  pending[b].clear();
  staged_bytes[b] = 0;
  plan_next = b + 1;
  plan_assign = false;
  return true;
}

namespace {
// A claimed landing in flight (StagerState::plan_inflight) until released: at every exit of
// land_planned, and before it calls Python (which may wait for it: wait_landings).
class InflightClaim {
 public:
  explicit InflightClaim(StagerState& s) : s_(s) {}
  InflightClaim(const InflightClaim&) = delete;
  InflightClaim& operator=(const InflightClaim&) = delete;
  ~InflightClaim() { release(); }
  void release() {
    if (released_) return;
    released_ = true;
    {
      std::lock_guard<std::mutex> lock(s_.mu);
      --s_.plan_inflight;
    }
    s_.plan_cv.notify_all();
  }

 private:
  StagerState& s_;
  bool released_ = false;
};
}  // namespace

void StagerState::wait_landings(std::unique_lock<std::mutex>& lock) {
  if (!plan_cv.wait_for(lock, std::chrono::seconds(kLandingWaitSeconds), [this] { return plan_inflight == 0; })) {
    SHARDAMP_CHECK(false, "GradStager: a grad hook's landing on another autograd thread did not finish in ",
                   kLandingWaitSeconds, " s (", plan_inflight, " in flight); its backward is stuck");
  }
}

void StagerState::land_planned(int64_t b) {
  PlanEntry e;
  bool assign;
  bool held;
  {
    std::lock_guard<std::mutex> lock(mu);
    // Taking the entry claims the landing: where two autograd threads both find bucket b due
    // (its own hook, and the thread that landed the bucket ahead of it), one lands it; and a plan
    // Python ended before the claim lands nothing (the grads stay staged for Python). A plan
    // Python ends after the claim (from another thread) waits for this landing to finish
    // (plan_inflight, wait_landings) and adopts it
    if (!plan_active || b >= static_cast<int64_t>(plan.size()) || !plan[b].on) return;
    std::swap(e, plan[b]);
    assign = plan_assign;
    held = b < static_cast<int64_t>(hold.size()) && hold[b];
    ++plan_inflight;
  }
  InflightClaim claim(*this);
  if (held) {
    try {
      if (hold_planned(b, e, assign)) return;
    } catch (const std::exception&) {  // nothing was taken or written: the grads land below
    }
  }
  at::Tensor full;
  try {
    full = at::empty({e.numel}, e.like.options());
  } catch (const std::exception&) {
    {
      std::lock_guard<std::mutex> lock(mu);
      plan_active = false;
    }
    claim.release();  // Python may end the plan, which waits for claims in flight
    call(kComplete, b);
    return;
  }
  try {
    land_checked_into(b, full, e.rows, e.flags, e.partial, assign);
  } catch (const std::exception& ex) {
    std::lock_guard<std::mutex> lock(mu);
    plan_active = false;
    plan_error = std::string("bucket ") + std::to_string(b) + ": " + ex.what();
    return;
  }
  std::lock_guard<std::mutex> lock(mu);
  plan_landed.push_back({b, std::move(full), {}, {}, {}});
  plan_next = b + 1;
  plan_assign = false;
}

std::vector<int64_t> StagerState::land_checked_into(int64_t b, at::Tensor& full, const at::Tensor& rows, at::Tensor flags,
                                       at::Tensor partial, bool assign) {
  std::vector<int64_t> landed = land(b, full, true);
  checked_bucket_stats(full, rows, flags, partial, assign);
  return landed;
}

void StagerState::start_plan_locked(std::vector<PlanEntry> p, int64_t next, bool assign, bool active) {
  SHARDAMP_CHECK(plan_landed.empty() && plan_error.empty(),
                 "GradStager: the last plan's landings were not taken (finish_plan)");
  plan = std::move(p);
  plan_next = next;
  plan_assign = assign;
  plan_active = active;
}

void StagerState::reset_plan_locked() {
  plan.clear();
  plan_active = false;
  if (prearmed) {
    prearmed = false;
    armed = false;
  }
}

std::pair<std::vector<int64_t>, std::vector<at::Tensor>> StagerState::take(int64_t b) {
  std::lock_guard<std::mutex> lock(mu);
  std::vector<int64_t> idx;
  std::vector<at::Tensor> grads;
  idx.reserve(pending[b].size());
  grads.reserve(pending[b].size());
  for (auto& e : pending[b]) {
    idx.push_back(e.first);
    grads.push_back(std::move(e.second));
    staged[e.first] = 0;
  }
  pending[b].clear();
  staged_bytes[b] = 0;
  return {std::move(idx), std::move(grads)};
}

std::vector<int64_t> StagerState::land(int64_t b, at::Tensor& full, bool zero_rest) {
  auto taken = take(b);
  std::vector<at::Tensor> like;
  std::vector<int64_t> offsets;
  like.reserve(taken.first.size());
  offsets.reserve(taken.first.size());
  for (int64_t i : taken.first) {
    like.push_back(params[i]);
    offsets.push_back(offset[i]);
  }
  land_grads(full, taken.second, like, offsets, false, zero_rest);
  if ((full.is_cuda() || g_release_cpu.load(std::memory_order_relaxed)) && g_release_async.load(std::memory_order_relaxed)) {
    // what Python has seen is freed here (below), the rest on the release thread if it takes it
    std::vector<at::Tensor> later;
    later.reserve(taken.second.size());
    for (size_t k = 0; k < taken.first.size(); ++k) {
      if (!via_python[taken.first[k]]) later.push_back(std::move(taken.second[k]));
    }
    Releaser::get().push(later);  // declined: `later` is freed on return
  }
  return std::move(taken.first);
}

}  // namespace stager
}  // namespace shardamp
