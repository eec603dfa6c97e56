// The state behind the native grad hook (csrc/grad_stager.cpp binds it to Python as GradStager;
// contract: shardamp/optim/sync/grad_stager.py): the staging lists and counts, the hook's body,
// the bucket landings and the landing plan. Its methods are in stager_state.cpp.
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <memory>
#include <cstdint>
#include <condition_variable>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardamp {
// hidden, as pybind11's own types (StagerState holds a py::object): nothing here leaves the module
namespace stager __attribute__((visibility("hidden"))) {

enum Event : int { kNone = 0, kSlow = 1, kFlush = 2, kComplete = 3 };

extern std::atomic<bool> g_release_async;  // set_async_release: for A/B measurements and tests
// Tests only (_release_cpu_too): CPU grads take the release thread too, so the CPU suite runs its
// logic (a CPU landing is synchronous: freeing later is trivially safe there).
extern std::atomic<bool> g_release_cpu;

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
  bool armed = false;  // the hook stages grads itself: Python saw this backward's first grad, or prearm
  bool dead = false;  // removed while a backward may run its hooks: they do nothing
  py::object callback;  // callback(event, arg): arg is a param index (kSlow) or a bucket
  std::mutex mu;
  // The landing plan (one process; set_plan / finish_plan): a complete bucket that is the next to
  // launch (or completed ahead of it: then after the ones before it) and has a plan entry is
  // allocated, landed and passed over here, on the autograd
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
  // A bucket the plan landed: its shard, or (``hold``) its grads left where autograd put them
  // (``full`` undefined; in staging order, each grad with its param, the layout it has, and its
  // offset in the shard): read in place by the flags' pass here and by the step, the shard made
  // only if something else reads it (grad_parts.h)
  struct Landed {
    int64_t bucket;
    at::Tensor full;
    std::vector<at::Tensor> like;
    std::vector<int64_t> offsets;
    std::vector<at::Tensor> grads;
  };
  std::vector<Landed> plan_landed;  // in landing order
  // Landings claimed (their plan entry taken) and not yet in plan_landed: another autograd
  // thread's hook may be landing a bucket while Python ends the plan (params of one optimizer on
  // two devices). What Python takes from the plan (finish_plan, end_quiet, clear) waits for them
  // (wait_landings), so a claimed bucket is adopted by Python, never launched by it a second time
  int64_t plan_inflight = 0;
  static constexpr int kLandingWaitSeconds = 60;  // a landing is launches only: far below this
  std::condition_variable plan_cv;  // notified when plan_inflight falls to 0
  // set_hold: per bucket, its grads may be held in place where they allow it (hold_planned); a
  // bucket whose segments the update launch cannot carry (kHeldSegments on CUDA) is never held
  std::vector<char> hold;
  std::string plan_error;  // a landing that failed after taking its grads: Python raises it
  // The standing plan (set_standing): the entries every pre-armed backward starts from, without
  // their flags. prearm(flags) (zero_grad, every bucket released) arms the stager and sets the
  // plan from it, so the next backward's first grad is staged here instead of Python deciding it
  // and arming the plan itself.
  std::vector<PlanEntry> standing;
  bool prearmed = false;  // armed by prearm, no grad seen since
  // The quiet begin (set_quiet_begin, required by prearm): a pre-armed backward's first grad
  // calls no Python; it queues `quiet_end` (a Python callable) to run when that backward
  // finishes, as Python's queue_callback would. Python learns of the begin at its next entry
  // point (take_quiet_begin) or in `quiet_end`.
  py::object quiet_end;
  bool began_quietly = false;  // a backward began quietly and Python has not taken it yet
  std::weak_ptr<StagerState> self;  // what the queued callback holds (the stager may be gone by then)

  // Queue quiet_end on the current graph task (the hook runs inside it); quiet_end raises nothing
  // (an error it meets is raised from backward() by a Python callback it queues there).
  void queue_quiet_end();

  int stage_locked(int64_t i, at::Tensor& grad_slot);

  void call(int event, int64_t arg);

  // Runs on the autograd thread, without the GIL, after AccumulateGrad stored param i's grad.
  void hook(int64_t i) noexcept;

  static void report(const char* what);

  void hook_body(int64_t i);

  // hook_body's planned landing of complete bucket b (its plan entry is taken here). An
  // allocation that fails leaves the grads staged and hands the bucket to Python (which raises
  // it); a failure after the grads were taken is kept for Python to raise (finish_plan).
  void land_planned(int64_t b);

  // Under `lock` (on mu): wait until no claimed landing is in flight (plan_inflight == 0), at
  // most kLandingWaitSeconds; raises naming the stuck landing past it. The caller must not hold
  // the GIL meanwhile (GradStager::settled releases it), though no landing asks for it.
  void wait_landings(std::unique_lock<std::mutex>& lock);

  // land_planned(b), then each next bucket of the plan that completed while it waited its turn
  // (hook_body stages such a bucket and calls no one), in launch order, until one is not complete
  // or the plan ended; one complete with nothing to land (a frozen bucket) ends the plan and goes
  // to Python
  void land_planned_in_order(int64_t b);

  // land_planned's zero-copy landing of bucket b (``hold``): where every staged grad is a dense
  // tensor on the bucket's device in its param's layout and dtype (CPU: and the bucket holds no
  // inf/NaN; CUDA: at most kHeldSegments grads, no graph capture), its flags' pass runs over the
  // grads in place and they are taken as held (true); else nothing changes (false)
  bool hold_planned(int64_t b, const PlanEntry& e, bool assign);

  // land() into `full` (allocated uninitialized: zero_rest) and the flags' and partial's pass
  // over it: the hook's merged landing under the plan (land_planned)
  std::vector<int64_t> land_checked_into(int64_t b, at::Tensor& full, const at::Tensor& rows, at::Tensor flags,
                                         at::Tensor partial, bool assign);

  // Starts `p` as the plan (the caller holds `mu`): from bucket `next` on, `assign` for its first
  // landing, `active` if it names any bucket. The last plan's landings must have been taken.
  void start_plan_locked(std::vector<PlanEntry> p, int64_t next, bool assign, bool active);

  // Ends the plan (the caller holds `mu`): the entries dropped, nothing active; a pre-arming no
  // grad has used yet is undone (the next first grad goes to Python, which arms again).
  void reset_plan_locked();

  std::pair<std::vector<int64_t>, std::vector<at::Tensor>> take(int64_t b);

  // Copy bucket b's staged grads into their slots of the flat buffer `full` (land_grads: the
  // param's sizes and strides at its offset; `zero_rest`: the rest of `full` zeroed in the same
  // pass); returns the params landed, in staging order.
  std::vector<int64_t> land(int64_t b, at::Tensor& full, bool zero_rest);
};

}  // namespace stager
}  // namespace shardamp
