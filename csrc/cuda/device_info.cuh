// Per-device facts the launches size their grids by, read once per device.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>

#include "../common.h"

namespace shardamp {
namespace cuda {

// The device's SM count (cached: cudaDeviceGetAttribute on every launch is host time).
inline int multiprocessors(int device) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int n = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  SHARDAMP_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute(multiProcessorCount) failed: ", cudaGetErrorString(err));
  cache.emplace(device, n);
  return n;
}

}  // namespace cuda
}  // namespace shardamp
