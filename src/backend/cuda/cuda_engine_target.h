// The CUDA target as the serving engine's target (src/engine/engine_target.h): the engine's
// KvPool keeps the bookkeeping, the blocks live in the CudaTarget's device cache (use_paged_kv),
// and every engine step is one CudaTarget::forward_batch. A plain C++ header.
#pragma once
#include <memory>

#include "model/deepseek_v3_cuda.h"
#include "engine/engine_target.h"

namespace kd {

// The target must outlive the returned object; it must be fresh (no sequence in its cache): the
// engine replaces its cache by the paged pool.
std::unique_ptr<EngineTarget> cuda_engine_target(CudaTarget& target);

}  // namespace kd
