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
#include "grad_release.h"
#include "land_grads.h"

namespace shardamp {

// binding.cpp: a landed bucket's non-finite flags and L2 partial in one pass (checked there)
void checked_bucket_stats(const at::Tensor& full, const at::Tensor& rows, at::Tensor flags, at::Tensor out,
                          bool assign);

namespace {

namespace ag = torch::autograd;
using AccPtr = decltype(ag::impl::grad_accumulator(std::declval<const at::Tensor&>()));

enum Event : int { kNone = 0, kSlow = 1, kFlush = 2, kComplete = 3 };

std::atomic<bool> g_release_async{true};  // set_async_release: for A/B measurements and tests
// Tests only (_release_cpu_too): CPU grads take the release thread too, so the CPU suite runs its
// logic (a CPU landing is synchronous: freeing later is trivially safe there).
std::atomic<bool> g_release_cpu{false};

struct StagerState {
  // per param (the optimizer's order)
  std::vector<at::Tensor> params;
  std::vector<int64_t> bucket_of, offset, nbytes;
  std::vector<char> staged, owned;
  std::vector<char> touched;  // got a grad since clear_touched (zero_grad)
  std::vector<char> via_python;  // staged by stage() (Python saw the grad), not by the hook
  // per bucket
  std::vector<int64_t> expected, fired, flush_bytes, staged_bytes;
  std::vector<std::vector<std::pair<int64_t, at::Tensor>>> pending;  // staged (param, grad)
  bool armed = false;  // this backward's first grad went through Python
  bool dead = false;  // removed while a backward may run its hooks: they do nothing
  py::object callback;  // callback(event, arg): arg is a param index (kSlow) or a bucket
  std::mutex mu;
  // The landing plan (one process; set_plan / finish_plan): a complete bucket that is the next to
  // launch and has a plan entry is allocated, landed and passed over here, on the autograd
  // thread without the GIL, instead of calling Python; Python adopts the landed shards later
  // (finish_plan). The plan ends at the first event that calls Python.
  struct PlanEntry {
    bool on = false;
    int64_t numel = 0;
    at::Tensor like, rows, flags, partial;
  };
  std::vector<PlanEntry> plan;
  bool plan_active = false;
  int64_t plan_next = 0;  // the next bucket to launch, as GradSync.next_launch
  bool plan_assign = false;  // the next landing's partial replaces the shared row's values
  std::vector<std::pair<int64_t, at::Tensor>> plan_landed;  // in landing order
  std::string plan_error;  // a landing that failed after taking its grads: Python raises it

  int stage_locked(int64_t i, at::Tensor& grad_slot) {
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

  void call(int event, int64_t arg) {
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

  // Runs on the autograd thread, without the GIL, after AccumulateGrad stored param i's grad.
  void hook(int64_t i) noexcept {
    try {
      hook_body(i);
    } catch (const std::exception& e) {
      report(e.what());
    } catch (...) {
      report("unknown C++ error");
    }
  }

  static void report(const char* what) {
    py::gil_scoped_acquire gil;
    PyErr_SetString(PyExc_RuntimeError, (std::string("shardamp grad hook: ") + what).c_str());
    PyErr_WriteUnraisable(nullptr);
  }

  void hook_body(int64_t i) {
    int event = kNone;
    int64_t arg = i;
    bool planned = false;
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
      if (event == kComplete && plan_active && arg == plan_next && plan[arg].on) {
        planned = true;
      } else if (event != kNone) {
        plan_active = false;  // Python decides from here on (it adopts what was landed first)
      }
    }
    if (planned) {
      land_planned(arg);
    } else if (event != kNone) {
      call(event, arg);
    }
  }

  // hook_body's planned landing of complete bucket b (its plan entry is taken here). An
  // allocation that fails leaves the grads staged and hands the bucket to Python (which raises
  // it); a failure after the grads were taken is kept for Python to raise (finish_plan).
  void land_planned(int64_t b) {
    PlanEntry e;
    bool assign;
    {
      std::lock_guard<std::mutex> lock(mu);
      std::swap(e, plan[b]);
      assign = plan_assign;
    }
    at::Tensor full;
    try {
      full = at::empty({e.numel}, e.like.options());
    } catch (const std::exception&) {
      {
        std::lock_guard<std::mutex> lock(mu);
        plan_active = false;
      }
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
    plan_landed.emplace_back(b, std::move(full));
    plan_next = b + 1;
    plan_assign = false;
  }

  // land() into `full` (allocated uninitialized: zero_rest) and the flags' and partial's pass
  // over it: the merged landing, from Python (GradStager.land_checked) or the hook (land_planned)
  std::vector<int64_t> land_checked_into(int64_t b, at::Tensor& full, const at::Tensor& rows, at::Tensor flags,
                                         at::Tensor partial, bool assign) {
    std::vector<int64_t> landed = land(b, full, true);
    checked_bucket_stats(full, rows, flags, partial, assign);
    return landed;
  }

  // Ends the plan (the caller holds `mu`): the entries dropped, nothing active.
  void reset_plan_locked() {
    plan.clear();
    plan_active = false;
  }

  std::pair<std::vector<int64_t>, std::vector<at::Tensor>> take(int64_t b) {
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

  // Copy bucket b's staged grads into their slots of the flat buffer `full` (land_grads: the
  // param's sizes and strides at its offset; `zero_rest`: the rest of `full` zeroed in the same
  // pass); returns the params landed, in staging order.
  std::vector<int64_t> land(int64_t b, at::Tensor& full, bool zero_rest) {
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
};

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

  // One process, a complete bucket whose shard was released: the shard allocated uninitialized
  // like `like` (land's zero_rest fills what no grad writes), the bucket's grads landed in it,
  // and its per-param non-finite flags and L2 partial formed (bucket_stats into `flags` and
  // `partial`, assigned or added): one call from Python instead of an allocation and two calls.
  std::pair<at::Tensor, std::vector<int64_t>> land_checked(int64_t b, int64_t numel, const at::Tensor& like,
                                                           const at::Tensor& rows, at::Tensor flags,
                                                           at::Tensor partial, bool assign) {
    check_bucket(b);
    SHARDAMP_CHECK(numel >= 0, "GradStager.land_checked: numel must be >= 0");
    at::Tensor full = at::empty({numel}, like.options());
    std::vector<int64_t> landed = state_->land_checked_into(b, full, rows, flags, partial, assign);
    return {full, std::move(landed)};
  }

  // The landing plan (see StagerState): from bucket `next` on, each bucket named in `entries`
  // ((bucket, numel, like, rows, flags, partial), as land_checked takes them) is landed by the
  // hook itself once it is complete and the next to launch; `assign`: the first such landing
  // replaces the shared partial row's values.
  void set_plan(int64_t next, bool assign, const std::vector<py::tuple>& entries) {
    auto& s = *state_;
    std::vector<StagerState::PlanEntry> plan(s.pending.size());
    for (const auto& t : entries) {
      SHARDAMP_CHECK(t.size() == 6, "GradStager.set_plan: an entry is (bucket, numel, like, rows, flags, partial)");
      const auto b = t[0].cast<int64_t>();
      check_bucket(b);
      auto& e = plan[b];
      e.on = true;
      e.numel = t[1].cast<int64_t>();
      e.like = t[2].cast<at::Tensor>();
      e.rows = t[3].cast<at::Tensor>();
      e.flags = t[4].cast<at::Tensor>();
      e.partial = t[5].cast<at::Tensor>();
      SHARDAMP_CHECK(e.numel >= 0, "GradStager.set_plan: numel must be >= 0");
    }
    std::lock_guard<std::mutex> lock(s.mu);
    SHARDAMP_CHECK(s.plan_landed.empty() && s.plan_error.empty(),
                   "GradStager.set_plan: the last plan's landings were not taken (finish_plan)");
    s.plan = std::move(plan);
    s.plan_next = next;
    s.plan_assign = assign;
    s.plan_active = !entries.empty();
  }

  // Ends the plan: the buckets it landed, in order, as (bucket, shard), and the error of a
  // landing that failed after taking its grads ("" if none).
  std::pair<std::vector<std::pair<int64_t, at::Tensor>>, std::string> finish_plan() {
    auto& s = *state_;
    std::lock_guard<std::mutex> lock(s.mu);
    s.reset_plan_locked();
    std::vector<std::pair<int64_t, at::Tensor>> landed;
    std::swap(landed, s.plan_landed);
    std::string error;
    std::swap(error, s.plan_error);
    return {std::move(landed), std::move(error)};
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
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto& bucket : s.pending) bucket.clear();
    std::fill(s.staged.begin(), s.staged.end(), 0);
    std::fill(s.staged_bytes.begin(), s.staged_bytes.end(), 0);
    std::fill(s.fired.begin(), s.fired.end(), 0);
    s.reset_plan_locked();
    s.plan_landed.clear();
    s.plan_error.clear();
  }
  void set_armed(bool armed) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->armed = armed;
  }
  void disown(int64_t i) {
    check_param(i);
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->owned[i] = 0;
  }
  int64_t hooks() const { return static_cast<int64_t>(hooks_.size()); }

 private:
  void check_param(int64_t i) const {
    SHARDAMP_CHECK(i >= 0 && i < static_cast<int64_t>(state_->params.size()), "GradStager: no param ", i);
  }
  void check_bucket(int64_t b) const {
    SHARDAMP_CHECK(b >= 0 && b < static_cast<int64_t>(state_->pending.size()), "GradStager: no bucket ", b);
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
      .def("land_checked", &GradStager::land_checked, py::arg("bucket"), py::arg("numel"), py::arg("like"),
           py::arg("rows"), py::arg("flags"), py::arg("partial"), py::arg("assign"))
      .def("set_plan", &GradStager::set_plan, py::arg("next"), py::arg("assign"), py::arg("entries"))
      .def("finish_plan", &GradStager::finish_plan)
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
