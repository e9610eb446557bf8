#include "cli/device.h"

#include "core/error.h"
#ifdef KDTREE_HAVE_CUDA
#include "model/deepseek_v3_cuda.h"
#endif

namespace kd::cli {

bool use_cuda(const std::string& device) {
  const bool cuda = device == "cuda";
  if (device != "cpu" && !cuda) fail("--device ", device, ": unknown device (choose cpu or cuda)");
#ifndef KDTREE_HAVE_CUDA
  if (cuda) fail("--device cuda: this build has no CUDA backend (configure with -DKDTREE_CUDA=ON where nvcc is installed)");
#else
  if (cuda && !cuda_device_available()) fail("--device cuda: ", cuda_device_name());
#endif
  return cuda;
}

}  // namespace kd::cli
