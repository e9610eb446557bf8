// The Drafter interface (what DDTree needs from a drafter, written against by decode/): per-position draft logits for the block after the bonus token,
// and (for DFlash) the target's tapped hidden states of every committed token.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace kd {

struct DraftTopK;  // sample/top_k.h

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string name() const = 0;        // printed in stats (synthetic drafters say so)
  virtual int64_t block_size() const = 0;      // B: the bonus token plus B − 1 draft positions
  // Target layers whose residual-stream outputs the drafter consumes; empty for synthetic drafters.
  virtual const std::vector<int32_t>& tap_layers() const = 0;
  // Features of n newly committed tokens at positions [context_len, context_len + n):
  // taps [n, tap_layers().size(), hidden] (nullptr when tap_layers() is empty).
  virtual void append_context(const float* taps, int64_t n) = 0;
  virtual int64_t context_len() const = 0;
  // Draft logits [B − 1, vocab] for positions start + 1 … start + B − 1, where the bonus token sits
  // at position start == context_len().
  virtual void draft(int32_t bonus, int64_t start, float* logits) = 0;
  // Optional, for drafters on a device: draft(), then the tree builder's top-k (k ≤ 128) of the
  // first L draft rows computed where the logits are (bit-identical to draft_top_k over draft()'s
  // logits, sample/top_k.h), so the logits never come to the host. false: not offered — call draft().
  virtual bool top_k_on_device(int32_t bonus, int64_t start, int64_t L, int64_t k, DraftTopK& out) {
    (void)bonus, (void)start, (void)L, (void)k, (void)out;
    return false;
  }
  // Optional, for drafters on the target's device: append_context from taps where the target's
  // forward left them (ForwardArgs::device_taps, [·, tap_layers, hidden] fp32): rows[k] of
  // taps_dev for k < n (rows null → rows 0 … n − 1), so taps never come to the host.
  virtual bool takes_device_taps() const { return false; }
  virtual void append_context_device(const float* taps_dev, int64_t n, const int32_t* rows) {
    (void)taps_dev, (void)n, (void)rows;
    fail("the ", name(), " drafter takes its taps on the host");
  }
  // Optional, with takes_device_taps: rows 0 … n − 1 of taps_dev kept aside on the device (a copy,
  // no context update) and taken in, in order, before the next append or draft — what --budget
  // auto's AR steps hand over, so a stretch of them costs the drafter a copy a step. context_len()
  // counts them at once. false from stages_device_taps: not offered (the engine brings such rows
  // to the host and defers them there).
  virtual bool stages_device_taps() const { return false; }
  virtual void stage_context_device(const float* taps_dev, int64_t n) {
    (void)taps_dev, (void)n;
    fail("the ", name(), " drafter does not stage device taps");
  }
};

}  // namespace kd
