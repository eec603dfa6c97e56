// The release thread of the grad landing (grad_stager.cpp's GradStager::land): why and its
// bounds are below; the bindings (drain_released, released_pending, released_total,
// set_async_release, and the tests' _hold_release / _release_cpu_too) are in grad_stager.cpp.
#pragma once

#include <ATen/ATen.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace shardamp {

// Drops landed CUDA grads on a thread of its own. Why: a bucket's grads used to be freed as it
// landed, inside backward, where torch frees its grads later, in zero_grad; each free is a trip
// through the caching allocator (~1.5-2 us of host time on an H200 host: ~300 us for ResNet-50's
// 161 grads, on the autograd thread that runs the rest of backward). The allocator reuses a
// block only on the stream it was allocated on, where the copy that read the grad is already
// queued, so freeing later, from any thread, is as safe as freeing at once.
//
// Bounds: one batch at a time. While one is still queued or being freed, `push` declines (the
// caller frees inline), so at most one landing's grads outlive it: ZeRO-2's backward memory
// grows by at most one flush (a quarter of a bucket at world > 1, STAGE_FRACTION). Grads Python
// has seen (staged by a Python call: the first grad of every backward) are freed by the caller
// too: their Python object would make the thread wait for the GIL. `drain()` (zero_grad) waits
// until everything handed over before it is freed, with the GIL released (its binding), so
// memory is where torch's is by then. Only the process that started the thread uses it (a
// forked child frees inline: it cannot use CUDA anyway); a thread that cannot be started makes
// every later push decline.
class Releaser {
 public:
  static Releaser& get() {
    static Releaser* r = new Releaser();  // never destroyed: its thread is never joined at exit
    return *r;
  }
  // Takes `tensors` (returns true) or leaves them to the caller (false).
  bool push(std::vector<at::Tensor>& tensors) {
    if (tensors.empty()) return true;
    const pid_t me = getpid();
    const pid_t owner = owner_.load();
    if (owner != me && owner != 0) return false;  // a forked child: the mutex may be the parent's
    {
      std::lock_guard<std::mutex> lock(mu_);
      // (read again under the lock: two threads' first pushes must not start two threads)
      if (owner_.load() == 0 && !start_locked(me)) return false;
      if (freed_ != pushed_) return false;  // the last batch is not freed yet: the caller frees
      queue_.push_back(std::move(tensors));
      ++pushed_;
    }
    work_.notify_one();
    return true;
  }
  void drain() {
    if (owner_.load() != getpid()) return;
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t target = pushed_;
    idle_.wait(lock, [this, target] { return freed_ >= target; });
  }
  int64_t pending() {
    if (owner_.load() != getpid()) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    return pushed_ - freed_;
  }
  int64_t handed_over() {
    if (owner_.load() != getpid()) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    return pushed_;
  }
  // Tests only: a held thread frees nothing until released (so a test can see a batch queued).
  void hold(bool on) {
    const pid_t owner = owner_.load();
    if (owner != 0 && owner != getpid()) return;  // (before the first push no thread exists yet)
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ = on;
    }
    work_.notify_one();
  }

 private:
  Releaser() = default;
  bool start_locked(pid_t me) {
    if (failed_) return false;
    try {
      std::thread([this] { run(); }).detach();
    } catch (const std::exception&) {  // e.g. a thread limit: free inline from now on
      failed_ = true;
      return false;
    }
    owner_.store(me);
    return true;
  }
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [this] { return !queue_.empty() && !held_; });
      std::vector<at::Tensor> batch = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      batch.clear();  // the frees
      lock.lock();
      ++freed_;
      idle_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_, idle_;
  std::deque<std::vector<at::Tensor>> queue_;
  int64_t pushed_ = 0, freed_ = 0;  // batches handed over / freed
  bool held_ = false, failed_ = false;
  std::atomic<pid_t> owner_{0};  // the process whose thread serves the queue (0: none started)
};

}  // namespace shardamp
