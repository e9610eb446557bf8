// `--device cpu|cuda`, checked the same way by every command that takes it.
#pragma once
#include <string>

namespace kd::cli {

// True for cuda, false for cpu; a clear error for anything else, for cuda in a build without the
// CUDA backend, and for cuda on a machine without a usable GPU (the message says why).
bool use_cuda(const std::string& device);

}  // namespace kd::cli
