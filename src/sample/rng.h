// Position-keyed randomness (DESIGN.md §2): the uniform that samples the token at absolute position
// p of a sequence is a pure function of (seed, sequence id, p), never of call order. A DDTree round
// verifies several siblings at one position; they all see the same uniform, so the accept walk picks
// exactly the token the AR loop would have sampled at that position.
//
// The generator is Philox4x32-10, a counter-based RNG (Salmon, Moraes, Dror, Shaw, "Parallel random
// numbers: as easy as 1, 2, 3", SC 2011), written here from the published round function. It is
// checked against the Random123 known-answer vectors in tests/unit/test_rng.cpp.
#pragma once
#include <array>
#include <cstdint>

namespace kd {

struct Philox4x32 {
  // Multipliers of the two S-boxes and the Weyl key schedule increments (golden ratio, sqrt(3)-1).
  static constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  static constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  static constexpr int n_rounds = 10;

  // One 128-bit output block for counter `ctr` under key `key`. Word order is Random123's: ctr[0] is
  // the least significant counter word, and output word i is Random123's v[i].
  static constexpr std::array<uint32_t, 4> block(std::array<uint32_t, 4> ctr,
                                                 std::array<uint32_t, 2> key) {
    for (int r = 0; r < n_rounds; ++r) {
      // The key is bumped between rounds, not before the first one (Random123 philox4x32_R).
      if (r > 0) {
        key[0] += W0;
        key[1] += W1;
      }
      const uint64_t p0 = uint64_t(M0) * ctr[0];
      const uint64_t p1 = uint64_t(M1) * ctr[2];
      ctr = {uint32_t(p1 >> 32) ^ ctr[1] ^ key[0], uint32_t(p1),
             uint32_t(p0 >> 32) ^ ctr[3] ^ key[1], uint32_t(p0)};
    }
    return ctr;
  }
};

// The uniform in [0, 1) used to sample the token at absolute position `position` of sequence `seq_id`
// under `seed`. Key = {lo(seed), hi(seed)}; counter = {lo(position), hi(position), lo(seq_id),
// hi(seq_id)}; the first output word's top 24 bits scaled by 2^-24, so every value is exactly
// representable in fp32 and the largest is 1 - 2^-24 (never 1). The CUDA sampler must compute the
// same bits: changing this mapping changes every seeded output.
constexpr float position_uniform(uint64_t seed, uint64_t seq_id, uint64_t position) {
  const std::array<uint32_t, 4> out = Philox4x32::block(
      {uint32_t(position), uint32_t(position >> 32), uint32_t(seq_id), uint32_t(seq_id >> 32)},
      {uint32_t(seed), uint32_t(seed >> 32)});
  return float(out[0] >> 8) * 0x1p-24f;
}

}  // namespace kd
