// Settings of the CUDA backend read once from the environment (host side). Kernel choices travel in
// the launchers' parameters (kernel_config.h); the environment may only feed a parameter struct's
// default, at one place, documented there — today KDTREE_CUDA_MMA_MIN_ROWS and KDTREE_CUDA_MMA_GEMM_MIN_M
// (LinearConfig; the second scheduling only) and KDTREE_CUDA_MLA_LAUNCH_ROWS (mla_core_launch_rows,
// scheduling only).
// KDTREE_CUDA_PDL (the launch overlap, off by default; common.cuh: pdl_mode) chooses no kernel's
// arithmetic and is read once where it applies. A malformed value is an error naming the variable and what it must be.
#pragma once
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace kd::cuda {

// A count ≥ 0 (decimal); `unset` when the variable is unset or empty.
inline int64_t env_count(const char* name, int64_t unset) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return unset;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(e, &end, 10);
  if (*end != '\0' || v < 0 || errno == ERANGE) fail(name, " must be a count ≥ 0, not '", std::string(e), "'");
  return int64_t(v);
}

}  // namespace kd::cuda
