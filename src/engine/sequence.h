// The engine's private per-request state (engine.cpp): a request from submit to its final event.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "decode/budget.h"
#include "decode/round.h"
#include "engine/engine.h"

namespace kd {

struct EngineSeq {
  uint64_t id = 0;
  EngineRequest req;
  GenerationLimits lim;         // context, prompt length, most tokens to generate
  std::vector<int32_t> tokens;  // prompt then every committed output token, indexed by position
  int64_t n_out = 0;

  // Paged KV: block table, committed rows, blocks reserved at admission but not yet lent.
  std::vector<int32_t> blocks;
  int64_t n_kv = 0;
  int64_t reserved = 0;
  int64_t n_published = 0;    // leading prompt blocks already in (or taken from) the prefix cache
  uint64_t last_hash = 0;     // chain hash of block n_published − 1

  // Decoding: `next` is the token sampled last and not yet run through the target (AR's input,
  // DDTree's bonus); −1 while the prompt is still being prefilled.
  int32_t next = -1;
  std::unique_ptr<Drafter> drafter;
  int64_t n_taps = 0;
  bool device_taps = false;     // the drafter reads the target's taps on the device
  bool stage_taps = false;      // … and stages an AR step's row there (Drafter::stages_device_taps)
  // Committed rows' host taps not yet given to the drafter: appended just before it drafts, so
  // --budget auto's AR steps cost no drafter work (and a run that never drafts again, none).
  std::vector<float> pending_taps;  // [pending_rows, n_taps, hidden]
  int64_t pending_rows = 0;
  std::unique_ptr<BudgetController> budget;  // --budget auto
  bool ar_only = false;  // --budget auto where drafting cannot pay (RoundCosts::speculate): AR steps only

  // This step's work.
  int64_t step_rows = 0;          // rows in the forward (0: not in this step)
  bool step_prefill = false;      // the rows are a prompt chunk
  bool post_failed = false;       // sampling this step threw (the sequence ends with an error)
  std::vector<int32_t> path;      // a DDTree round's accepted rows (tree indices, root first)
  bool step_logits = false;       // the forward returns logits for this sequence
  bool step_argmax = false;       // … as argmax outputs (greedy, logits left on the device)
  int64_t batch_index = 0;        // this sequence's index in the step's batch
  std::vector<float> logits;      // [1 or tree size, vocab]
  std::vector<int32_t> am_ids;    // [1 or tree size] argmax outputs
  std::vector<float> am_vals;
  std::vector<float> taps;        // [step_rows, n_taps, hidden]
  const float* dev_taps = nullptr;  // device taps of this step (device_taps)
  std::unique_ptr<DraftRound> round;
  bool step_ar = false;           // the round is --budget auto's AR step (the root alone, no draft)
  BudgetChoice step_choice;       // --budget auto: what this round's choice expected
  double step_draft_ms = 0;       // --budget auto: this round's measured draft time (0: an AR step)
  std::unique_ptr<grammar::Matcher> matcher;  // constrained requests: the grammar's state after the committed tokens
  std::vector<float> masked;                  // [vocab] the logits row with the grammar's mask applied

  // Timing, stats, and the event being built.
  double t_submit = 0, t_admit = 0, t_first = 0;
  RequestStats stats;
  EngineEvent ev;
  bool cancel = false;
  bool admitted = false;  // counted in EngineMetrics::running
};

}  // namespace kd
