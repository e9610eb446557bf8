// Seeded random weights for the `make-model` / `make-drafter` generators: one splitmix64 stream
// per tensor, keyed by the tensor's name and the user's seed, so a tensor's values depend on
// neither the order tensors are written in nor how they are sharded.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

namespace kd {

struct Rng {  // splitmix64: a seeded, explicit stream per tensor
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  float normal() {  // Box–Muller
    double u1 = uniform(), u2 = uniform();
    return float(std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2));
  }
};

// FNV-1a of the name, offset by the seed: the per-tensor stream's starting state.
inline uint64_t hash_name(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

}  // namespace kd
