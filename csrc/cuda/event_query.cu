// cudaEventQuery from a thread that is not capturing, safe while another thread captures a CUDA
// graph in the default ("global") capture mode, where such a query would invalidate the capture:
// the query runs with this thread's capture mode exchanged to relaxed, as torch's own NCCL
// watchdog does. Used by optim/comm/watchdog.py's monitor thread. Returns 1 (complete),
// 0 (not yet) or -1 (an error, cleared; the caller reports it). Never throws.

#include <cuda_runtime.h>

#include <cstdint>

namespace shardamp {
namespace cuda {

int64_t event_query_relaxed(int64_t handle) {
  if (handle == 0) return -1;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(handle));
  (void)cudaThreadExchangeStreamCaptureMode(&mode);  // back to this thread's own mode
  if (err == cudaSuccess) return 1;
  (void)cudaGetLastError();  // not ready (or an error) must not stay as the thread's last error
  return err == cudaErrorNotReady ? 0 : -1;
}

}  // namespace cuda
}  // namespace shardamp
