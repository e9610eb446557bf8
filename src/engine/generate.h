// One generation on any target through the one decode loop: `kdtree run` (and the tests, the
// bench) is the engine (engine.h) with one request — the same step, forward modes (device argmax,
// device taps, graph replay where the target has them) and round code that serving runs.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "decode/generate.h"
#include "model/drafter.h"
#include "model/target.h"

namespace kd {

// Plain autoregressive generation: the reference every speculative decoder reproduces token for
// token. Validates the request (check_generation: the messages name the problem) and throws
// kd::Error on a failure during generation. on_token(id) is called as each token is committed
// (on the engine's thread; streaming); may be empty; if it throws, generation stops and the
// exception reaches the caller. Each call lends the target's KV afresh (Target::init_kv): no engine
// may be running on the same target meanwhile.
GenerateResult generate_ar(const Target& target, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                           const std::function<void(int32_t)>& on_token = {});

// DDTree (or, with spec.chain, DFlash's chain) speculative decoding with `drafter`, which must be
// fresh (no context); the output equals generate_ar's.
SpecResult generate_ddtree(const Target& target, Drafter& drafter, const std::vector<int32_t>& prompt,
                           const GenerateOptions& opt, const SpecOptions& spec,
                           const std::function<void(int32_t)>& on_token = {});

}  // namespace kd
