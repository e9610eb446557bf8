// Helpers shared by the GPU tests (tests/gpu/): the skip without a GPU, fixture paths that binaries
// built on one machine find on another (scripts/gpu-check sets KDTREE_FIXTURES), a device buffer,
// and the CUDA-event timing the printed (never asserted) timing tables use.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "model/deepseek_v3_cuda.h"
#include "backend/cuda/kernels.h"

#define REQUIRE_GPU() \
  if (!kd::cuda_device_available()) GTEST_SKIP() << "no CUDA GPU here (" << kd::cuda_device_name() << "): GPU test skipped"

namespace kd::gpu_test {

// KDTREE_FIXTURES in the environment overrides the build's path.
inline std::string fixture(const std::string& name) {
  const char* env = std::getenv("KDTREE_FIXTURES");
  return std::string(env ? env : KDTREE_FIXTURES) + "/" + name;
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { cuda::check(cudaMalloc(&p, bytes ? bytes : 16), "cudaMalloc"); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void up(const void* h, size_t bytes) { cuda::check(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice), "upload"); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// n draws of N(0, 1).
inline std::vector<float> normal_x(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = nd(rng);
  return x;
}

// Median device time of `once` (launches on the default stream) in µs: `warm` untimed calls, then
// `reps` timed ones, each between two events.
template <class F>
double median_us(F&& once, int warm = 3, int reps = 21) {
  cudaEvent_t e0, e1;
  cuda::check(cudaEventCreate(&e0), "cudaEventCreate");
  cuda::check(cudaEventCreate(&e1), "cudaEventCreate");
  for (int i = 0; i < warm; ++i) once();
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    cuda::check(cudaEventRecord(e0, nullptr), "record");
    once();
    cuda::check(cudaEventRecord(e1, nullptr), "record");
    cuda::check(cudaEventSynchronize(e1), "sync");
    float v = 0;
    cuda::check(cudaEventElapsedTime(&v, e0, e1), "elapsed");
    ms.push_back(v);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]) * 1e3;
}

}  // namespace kd::gpu_test
