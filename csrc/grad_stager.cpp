// The backward hook of DistributedFusedAdam in C++ (contract: shardamp/optim/sync/grad_stager.py,
// whose PyStager is the reference and the fallback).
//
// Why: a Python post-accumulate-grad hook per param costs the autograd thread a GIL round trip
// and an interpreter call for every param of every backward. On a GPU host that is ~10 us per
// param (ResNet-50: ~2 ms of an iteration that is host-bound), where plain AccumulateGrad costs
// ~2 us. So, as DDP's reducer does, the hook is a C++ post hook on each param's grad accumulator:
// it takes the grad (param.grad becomes undefined) into its bucket's staging list and counts,
// without the GIL, and calls Python only for the few events that need a decision there: the
// first grad of a backward, an unusual grad (sparse, or a param staged twice), a bucket whose
// staged bytes reach its flush size, a complete bucket. The bucket copy itself (`land`) also
// runs here (land_grads.h: byte ranges, no tensor view, where a grad has its param's layout).
//
// This file is the one place the C++ autograd internals are used (torch::autograd::impl::
// grad_accumulator, Node::add_post_hook / del_post_hook, LambdaPostHook), as
// optim/_compat.py is for Python ones; tests/test_grad_stager.py checks them on every torch.
//
// No exception ever leaves a hook: the Python callback is wrapped (grad_stager.py stores its
// errors and raises them from the end-of-backward callback) and anything else is caught here
// and reported as unraisable. The methods Python calls throw std::runtime_error only (a
// c10::Error leaving a JIT-built extension was seen to kill the interpreter on torch 2.11 + g++
// 13.3: common.h).
#include <torch/extension.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common.h"
#include "grad_stager.h"
#include "grad_parts.h"
#include "grad_release.h"

namespace shardamp {

namespace {

using namespace stager;  // this file binds StagerState to Python, nothing else
namespace ag = torch::autograd;
using AccPtr = decltype(ag::impl::grad_accumulator(std::declval<const at::Tensor&>()));

class GradStager {
 public:
  GradStager(std::vector<at::Tensor> params, std::vector<int64_t> bucket_of, std::vector<int64_t> offset,
             std::vector<int64_t> nbytes, std::vector<int64_t> expected, std::vector<int64_t> flush_bytes,
             py::object callback)
      : state_(std::make_shared<StagerState>()) {
    const size_t n = params.size();
    SHARDAMP_CHECK(bucket_of.size() == n && offset.size() == n && nbytes.size() == n,
                   "GradStager: params, bucket_of, offset and nbytes must have the same length");
    SHARDAMP_CHECK(expected.size() == flush_bytes.size(), "GradStager: expected and flush_bytes differ in length");
    for (size_t i = 0; i < n; ++i) {
      SHARDAMP_CHECK(bucket_of[i] >= 0 && bucket_of[i] < static_cast<int64_t>(expected.size()),
                     "GradStager: param ", i, " names bucket ", bucket_of[i], " of ", expected.size());
    }
    auto& s = *state_;
    s.params = std::move(params);
    s.bucket_of = std::move(bucket_of);
    s.offset = std::move(offset);
    s.nbytes = std::move(nbytes);
    s.staged.assign(n, 0);
    s.owned.assign(n, 1);
    s.touched.assign(n, 0);
    s.via_python.assign(n, 0);
    s.expected = std::move(expected);
    s.flush_bytes = std::move(flush_bytes);
    s.fired.assign(s.expected.size(), 0);
    s.staged_bytes.assign(s.expected.size(), 0);
    s.pending.resize(s.expected.size());
    s.callback = std::move(callback);
    s.quiet_end = py::none();
    s.self = state_;
  }

  ~GradStager() { remove(false); }

  // One post hook on the grad accumulator of every param that requires grad. The accumulators
  // are held here: a param holds its own only weakly, and a new one (without the hook) would be
  // made once the autograd graph that referenced the old one is gone.
  void attach() {
    auto& s = *state_;
    std::weak_ptr<StagerState> weak = state_;
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (!s.params[i].requires_grad()) continue;
      AccPtr acc = ag::impl::grad_accumulator(s.params[i]);
      SHARDAMP_CHECK(acc, "GradStager: param ", i, " has no grad accumulator (not a leaf?)");
      const int64_t index = static_cast<int64_t>(i);
      auto key = acc->add_post_hook(std::make_unique<ag::utils::LambdaPostHook>(
          [weak, index](const ag::variable_list& outputs, const ag::variable_list&) {
            if (auto st = weak.lock()) st->hook(index);
            return outputs;
          }));
      hooks_.emplace_back(std::move(acc), key);
    }
  }

  // erase=false (a backward may be iterating these hooks: erasing one would invalidate it) only
  // makes them do nothing; the accumulators then drop them when they die.
  void remove(bool erase) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->dead = true;
    }
    if (erase) {
      for (auto& h : hooks_) h.first->del_post_hook(h.second);
    }
    hooks_.clear();
    // the callback holds Python objects: drop it with the GIL held
    if (state_ && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      state_->callback = py::none();
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->quiet_end = py::none();
    }
  }

  int stage(int64_t i) {
    auto& s = *state_;
    check_param(i);
    std::lock_guard<std::mutex> lock(s.mu);
    at::Tensor& grad = s.params[i].mutable_grad();
    SHARDAMP_CHECK(grad.defined(), "GradStager.stage: param ", i, " has no grad");
    SHARDAMP_CHECK(!s.staged[i], "GradStager.stage: param ", i, " is staged already (flush first)");
    s.via_python[i] = 1;
    return s.stage_locked(i, grad);
  }

  std::pair<std::vector<int64_t>, std::vector<at::Tensor>> take(int64_t b) {
    check_bucket(b);
    return state_->take(b);
  }

  std::vector<int64_t> land(int64_t b, at::Tensor& full, bool zero_rest) {
    check_bucket(b);
    return state_->land(b, full, zero_rest);
  }

  // The landing plan (see StagerState): from bucket `next` on, each bucket named in `entries`
  // ((bucket, numel, like, rows, flags, partial): its shard's size, a dtype template, its flag
  // rows, the round's flags and the shared partial row) is landed by the hook itself once it is complete, in launch
  // order (StagerState::land_planned_in_order); `assign`: the first such landing
  // replaces the shared partial row's values.
  void set_plan(int64_t next, bool assign, const std::vector<py::tuple>& entries) {
    auto plan = plan_entries(entries, true, "GradStager.set_plan");
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->start_plan_locked(std::move(plan), next, assign, !entries.empty());
  }

  // The standing plan's entries ((bucket, numel, like, rows, partial): set_plan's without the
  // flags), set once; prearm(flags) starts a plan from them.
  void set_standing(const std::vector<py::tuple>& entries) {
    auto standing = plan_entries(entries, false, "GradStager.set_standing");
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->standing = std::move(standing);
  }

  // Arms the stager for the next backward with the standing plan from bucket 0 (its first
  // landing assigns the partial row), every entry flagging into `flags`; the backward's first
  // grad then calls no Python (it queues the backward's end: set_quiet_begin). Undone by
  // set_armed(false), clear and finish_plan.
  void prearm(const at::Tensor& flags) {
    auto& s = *state_;
    std::lock_guard<std::mutex> lock(s.mu);
    SHARDAMP_CHECK(!s.standing.empty(), "GradStager.prearm: no standing plan (set_standing first)");
    SHARDAMP_CHECK(!s.quiet_end.is_none(), "GradStager.prearm: no backward end (set_quiet_begin first)");
    std::vector<StagerState::PlanEntry> plan = s.standing;
    for (auto& e : plan) {
      if (e.on) e.flags = flags;
    }
    s.start_plan_locked(std::move(plan), 0, true, true);
    s.armed = true;
    s.prearmed = true;
  }

  // Ends the plan: the buckets it landed, in order, as (bucket, shard, None), or (held in place,
  // set_hold) as (bucket, None, HeldParts: grad_parts.h); and the error of a landing that failed
  // after taking its grads ("" if none).
  std::pair<py::list, std::string> finish_plan() {
    auto& s = *state_;
    std::vector<StagerState::Landed> landed;
    std::string error;
    {
      auto lock = settled();
      s.reset_plan_locked();
      std::swap(landed, s.plan_landed);
      std::swap(error, s.plan_error);
    }
    return {landed_list(landed), std::move(error)};
  }

  // A quietly begun backward's end (set_quiet_begin): (began, landed, error, complete), where
  // began is take_quiet_begin's answer and landed and error finish_plan's; complete: the plan
  // landed every bucket and nothing is staged, so the round is over: the stager is disarmed and
  // its fired counts reset here (end_of_backward's own calls, made in this one).
  py::tuple end_quiet() {
    auto& s = *state_;
    std::vector<StagerState::Landed> landed;
    std::string error;
    bool began, complete;
    {
      auto lock = settled();
      began = s.began_quietly;
      s.began_quietly = false;
      complete = s.plan_error.empty() && s.plan_next == static_cast<int64_t>(s.pending.size());
      for (const auto& bucket : s.pending) complete = complete && bucket.empty();
      s.reset_plan_locked();
      std::swap(landed, s.plan_landed);
      std::swap(error, s.plan_error);
      if (complete) {
        s.armed = false;
        s.prearmed = false;
        std::fill(s.fired.begin(), s.fired.end(), 0);
      }
    }
    return py::make_tuple(began, landed_list(landed), error, complete);
  }

  // The quiet begin (StagerState::queue_quiet_end): `end` (a callable; None: prearm refuses) runs
  // when a pre-armed backward finishes.
  void set_quiet_begin(py::object end) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->quiet_end = std::move(end);
  }
  // Whether a backward began quietly since the last call (and forget it).
  bool take_quiet_begin() {
    std::lock_guard<std::mutex> lock(state_->mu);
    const bool began = state_->began_quietly;
    state_->began_quietly = false;
    return began;
  }

  // Which complete buckets may be held in place under the plan (StagerState::hold_planned): one
  // flag per bucket.
  void set_hold(const std::vector<bool>& hold) {
    SHARDAMP_CHECK(hold.size() == state_->pending.size(), "GradStager.set_hold: one flag per bucket (",
                   state_->pending.size(), "), got ", hold.size());
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->hold.assign(hold.begin(), hold.end());
  }

  py::bytes touched() {
    std::lock_guard<std::mutex> lock(state_->mu);
    return py::bytes(state_->touched.data(), state_->touched.size());
  }
  void clear_touched() {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::fill(state_->touched.begin(), state_->touched.end(), 0);
  }

  bool is_staged(int64_t i) {
    check_param(i);
    return state_->staged[i] != 0;
  }
  int64_t staged_count(int64_t b) {
    check_bucket(b);
    return static_cast<int64_t>(state_->pending[b].size());
  }
  int64_t staged_bytes(int64_t b) {
    check_bucket(b);
    return state_->staged_bytes[b];
  }
  int64_t fired(int64_t b) {
    check_bucket(b);
    return state_->fired[b];
  }
  void reset_fired() {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::fill(state_->fired.begin(), state_->fired.end(), 0);
  }
  void clear() {
    auto& s = *state_;
    auto lock = settled();
    for (auto& bucket : s.pending) bucket.clear();
    std::fill(s.staged.begin(), s.staged.end(), 0);
    std::fill(s.staged_bytes.begin(), s.staged_bytes.end(), 0);
    std::fill(s.fired.begin(), s.fired.end(), 0);
    s.reset_plan_locked();
    s.plan_landed.clear();
    s.plan_error.clear();
    s.began_quietly = false;
  }
  void set_armed(bool armed) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->armed = armed;
    state_->prearmed = false;
  }
  void disown(int64_t i) {
    check_param(i);
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->owned[i] = 0;
  }
  int64_t hooks() const { return static_cast<int64_t>(hooks_.size()); }

 private:
  // The stager's lock, taken once no claimed landing is in flight (StagerState::plan_inflight):
  // what Python takes from the plan (finish_plan, end_quiet, clear) includes every bucket another
  // autograd thread's hook claimed. Called with the GIL, which the wait releases (reacquired with
  // the lock free: a thread holding the GIL may be waiting for the lock).
  std::unique_lock<std::mutex> settled() {
    auto& s = *state_;
    std::unique_lock<std::mutex> lock(s.mu);
    while (s.plan_inflight > 0) {
      lock.unlock();
      {
        py::gil_scoped_release nogil;
        std::unique_lock<std::mutex> wait(s.mu);
        s.wait_landings(wait);
      }
      lock.lock();
    }
    return lock;
  }

  void check_param(int64_t i) const {
    SHARDAMP_CHECK(i >= 0 && i < static_cast<int64_t>(state_->params.size()), "GradStager: no param ", i);
  }
  void check_bucket(int64_t b) const {
    SHARDAMP_CHECK(b >= 0 && b < static_cast<int64_t>(state_->pending.size()), "GradStager: no bucket ", b);
  }

  // Python's plan entries, one slot per bucket: (bucket, numel, like, rows, flags, partial), or
  // without the flags where `with_flags` is false (the standing plan's); `method` names the caller.
  std::vector<StagerState::PlanEntry> plan_entries(const std::vector<py::tuple>& entries, bool with_flags,
                                                   const char* method) const {
    std::vector<StagerState::PlanEntry> plan(state_->pending.size());
    const size_t width = with_flags ? 6 : 5;
    for (const auto& t : entries) {
      SHARDAMP_CHECK(t.size() == width, method, ": an entry is (bucket, numel, like, rows, ", with_flags ? "flags, " : "",
                     "partial)");
      const auto b = t[0].cast<int64_t>();
      check_bucket(b);
      auto& e = plan[b];
      e.on = true;
      e.numel = t[1].cast<int64_t>();
      e.like = t[2].cast<at::Tensor>();
      e.rows = t[3].cast<at::Tensor>();
      if (with_flags) e.flags = t[4].cast<at::Tensor>();
      e.partial = t[width - 1].cast<at::Tensor>();
      SHARDAMP_CHECK(e.numel >= 0, method, ": numel must be >= 0");
    }
    return plan;
  }

  // (bucket, shard, None) per landed bucket, or (bucket, None, HeldParts) where its grads are held
  static py::list landed_list(std::vector<StagerState::Landed>& landed) {
    py::list out;
    for (auto& l : landed) {
      if (l.full.defined()) {
        out.append(py::make_tuple(l.bucket, py::cast(l.full), py::none()));
      } else {
        auto held = std::make_shared<HeldParts>(
            HeldParts{std::move(l.grads), std::move(l.like), std::move(l.offsets)});
        out.append(py::make_tuple(l.bucket, py::none(), py::cast(std::move(held))));
      }
    }
    return out;
  }

  std::shared_ptr<StagerState> state_;
  std::vector<std::pair<AccPtr, uintptr_t>> hooks_;
};

}  // namespace

void register_grad_stager(py::module& m) {
  py::class_<GradStager>(m, "GradStager",
                         "Grad staging for DistributedFusedAdam's buckets, hooked in C++ (reference: optim/sync/grad_stager.py)")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<int64_t>, py::object>(),
           py::arg("params"), py::arg("bucket_of"), py::arg("offset"), py::arg("nbytes"), py::arg("expected"),
           py::arg("flush_bytes"), py::arg("callback"))
      .def("attach", &GradStager::attach)
      .def("remove", &GradStager::remove, py::arg("erase") = true)
      .def("stage", &GradStager::stage, py::arg("index"))
      .def("take", &GradStager::take, py::arg("bucket"))
      .def("land", &GradStager::land, py::arg("bucket"), py::arg("full"), py::arg("zero_rest") = false)
      .def("set_plan", &GradStager::set_plan, py::arg("next"), py::arg("assign"), py::arg("entries"))
      .def("finish_plan", &GradStager::finish_plan)
      .def("set_hold", &GradStager::set_hold, py::arg("hold"))
      .def("set_quiet_begin", &GradStager::set_quiet_begin, py::arg("end"))
      .def("take_quiet_begin", &GradStager::take_quiet_begin)
      .def("end_quiet", &GradStager::end_quiet)
      .def("set_standing", &GradStager::set_standing, py::arg("entries"))
      .def("prearm", &GradStager::prearm, py::arg("flags"))
      .def("is_staged", &GradStager::is_staged, py::arg("index"))
      .def("staged_count", &GradStager::staged_count, py::arg("bucket"))
      .def("staged_bytes", &GradStager::staged_bytes, py::arg("bucket"))
      .def("fired", &GradStager::fired, py::arg("bucket"))
      .def("reset_fired", &GradStager::reset_fired)
      .def("clear", &GradStager::clear)
      .def("set_armed", &GradStager::set_armed, py::arg("armed"))
      .def("touched", &GradStager::touched)
      .def("clear_touched", &GradStager::clear_touched)
      .def("disown", &GradStager::disown, py::arg("index"))
      .def("hooks", &GradStager::hooks)
      .def("drain", [](GradStager&) { Releaser::get().drain(); }, py::call_guard<py::gil_scoped_release>(),
           "Wait until every landed CUDA grad handed to the release thread is freed");
  m.def("drain_released", [] { Releaser::get().drain(); }, py::call_guard<py::gil_scoped_release>(),
        "Wait until every landed CUDA grad handed to the release thread is freed");
  m.def("released_pending", [] { return Releaser::get().pending(); },
        "Batches of landed CUDA grads the release thread has not freed yet");
  m.def("released_total", [] { return Releaser::get().handed_over(); },
        "Batches of landed grads handed to the release thread so far (this process)");
  m.def("set_async_release", [](bool on) { g_release_async.store(on); }, py::arg("on"),
        "Free landed CUDA grads on the release thread (default) or at once, in land()");
  m.def("_hold_release", [](bool on) { Releaser::get().hold(on); }, py::arg("on"),
        "Tests only: the release thread frees nothing while held");
  m.def("_release_cpu_too", [](bool on) { g_release_cpu.store(on); }, py::arg("on"),
        "Tests only: landed CPU grads take the release thread too");
}

}  // namespace shardamp
