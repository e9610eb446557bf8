// The serving engine (DESIGN.md §3 src/engine/): many concurrent requests on one target model.
// One engine thread runs `step()` in a loop — schedule (admit waiting requests, pick prefill
// chunks and decode rows) → run (one batched target forward over every running sequence's rows;
// with a drafter, every sequence's tree in one verify pass with block-diagonal ancestor masks) →
// post-process (sample, accept, commit, emit events). The latent KV lives in a paged pool of
// fixed-size blocks; full blocks of a prompt are kept in a prefix cache (LRU) and shared by later
// requests with the same prefix. Row invariance (DESIGN.md §2) makes a request's output independent
// of its batch and of prefix-cache hits: same seed → same tokens as `kdtree run`.
//
// This header is the contract between the engine and the HTTP server (src/server/): the server
// talks to the engine only through submit / cancel / metrics and the per-request event callback.
//
// KV admission is by reservation: a request is admitted when the pool (free blocks plus evictable
// prefix-cache blocks, minus what running sequences reserved) holds its worst case — prompt + max
// new tokens (+ one verify tree with a drafter); running sequences are never preempted. Block
// storage is allocated on first use, so a large kv_tokens costs memory only when used.
// The forward uses the process-wide ThreadPool, which serves one calling thread at a time: while an
// engine runs, run no other model forward (generate_ar, generate_ddtree) on another thread.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "decode/generate.h"
#include "grammar/matcher.h"
#include "model/drafter.h"
#include "model/target.h"

namespace kd {

struct EngineOptions {
  int64_t n_parallel = 4;       // sequences running at once (`serve --parallel`)
  int64_t context = 0;          // per-sequence context limit in tokens; 0 → max_position_embeddings
  int64_t kv_tokens = 0;        // latent KV pool size in tokens; 0 → n_parallel × context (within the target's memory)
  int64_t kv_block = 16;        // tokens per KV block: paging and prefix-cache granularity
  int64_t prefill_chunk = 256;  // prompt tokens per sequence per step (chunked prefill)
  // Prompt tokens of all sequences together in one step (0: no limit). Chunks go to prefilling
  // sequences in admission order until it is spent; the rest wait a step. So several long prompts
  // arriving at once cannot stretch a step — and every running stream's time per token — past the
  // cost of this many rows, while one prompt alone still gets its whole chunk.
  int64_t step_prefill_tokens = 2048;
  int64_t max_queue = 64;       // requests waiting beyond the free slots, past which submit() throws EngineFull
  bool prefix_cache = true;
  // Speculative decoding: one drafter per running sequence (drafters keep per-sequence context).
  // Empty → plain autoregressive decoding.
  std::function<std::unique_ptr<Drafter>()> make_drafter;
  // spec.auto_budget (--budget auto, decode/budget.h): each sequence picks its tree size every round,
  // or AR steps; the verify cost is profiled here at construction (about a second) unless given.
  SpecOptions spec;
};

// Log-probabilities (natural log, of the target's distribution after temperature, as OpenAI
// reports them) of a committed token and, when asked, of the top alternatives.
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // [top_logprobs] (id, logprob), most likely first
};

struct RequestStats {
  int64_t n_prompt = 0;         // tokens the model saw (prompt_tokens in usage)
  int64_t n_cached = 0;         // prompt tokens served from the prefix cache
  int64_t n_generated = 0;
  double queue_ms = 0;          // submit → admitted
  double prefill_ms = 0;        // admitted → first token committed
  double decode_ms = 0;         // first token → done
  int64_t rounds = 0, drafted = 0, accepted = 0;  // speculative decoding (0 for AR)
  std::vector<int64_t> tau_histogram;  // DDTree: [block + 1], rounds whose τ (accepted + 1) was i
  std::vector<int32_t> round_tau;      // DDTree: each round's τ, as SpecStats::round_tau
  std::vector<SpecRoundTree> round_trees;  // DDTree with EngineOptions::spec.record_trees: each round's tree
  // Target forwards this request took part in, and what they cost (a batched step counts whole for
  // each of its sequences: with one request, exactly that request's).
  int64_t forwards = 0;
  uint64_t prefill_weight_bytes = 0, decode_weight_bytes = 0;
  double prefill_forward_ms = 0;      // the prompt's forwards
  double draft_ms = 0, verify_ms = 0; // DDTree: this sequence's drafting; the verify forwards
  std::vector<int64_t> budget_histogram;  // DDTree/DFlash: [most nodes + 1], rounds that verified N nodes (0: AR steps)
  int64_t ar_steps = 0;                   // --budget auto: AR steps taken instead of rounds (counted in rounds)
  double predicted_tokens = 0, predicted_ms = 0;  // --budget auto: what its choices expected (SpecStats)
  double auto_ceiling = 0;  // --budget auto: a drafter always right, × AR on this device (SpecStats)
};

struct EngineEvent {
  std::vector<int32_t> ids;            // tokens committed since the last event (a DDTree round commits several)
  std::vector<TokenLogprob> logprobs;  // parallel to ids when the request asked for logprobs
  bool done = false;
  std::string finish_reason;           // when done: "stop" | "length" | "cancelled" | "error"
  std::string error;                   // when finish_reason == "error"
  bool request_error = false;          // when "error": the request was at fault (its grammar past the matcher's limits: a 400)
  RequestStats stats;                  // complete when done
  std::vector<float> logits;           // [ids.size(), vocab] each token was drawn from, when gen.keep_logits
  bool grammar_incomplete = false;     // when done: constrained, and the output is not a complete sentence of the grammar
};

struct EngineRequest {
  std::vector<int32_t> prompt;
  // max_new_tokens, sampling (with its seed), ignore_eos, stop_ids, context. seq_id must stay 0
  // (or the caller's choice) — never the engine's request id — so that a request's samples do not
  // depend on what else is running.
  // gen.keep_logits fills EngineEvent::logits (tests, --dump-logits).
  GenerateOptions gen;
  int32_t top_logprobs = -1;  // -1: no logprobs; 0…20: the chosen token's logprob and k alternatives
  // Constrained decoding (response_format, grammar): every token is drawn from the logits with the
  // tokens the grammar forbids at −inf (greedy and seeded sampling alike; logprobs are of that
  // masked distribution). The stop ids (unless ignore_eos) are allowed where the grammar may end;
  // where it is complete and nothing may follow, the sequence ends with "stop". Empty: unconstrained.
  grammar::GrammarSpec grammar;
  // Called on the engine thread whenever tokens are committed and exactly once with done = true.
  // Must be quick and must not call back into the engine. Return false to cancel (client gone, a stop
  // string matched): the sequence and its KV blocks are freed before the next step, and a final
  // event with finish_reason "cancelled" follows.
  std::function<bool(const EngineEvent&)> on_event;
};

struct EngineMetrics {
  int64_t running = 0, waiting = 0;
  int64_t kv_blocks_used = 0, kv_blocks_total = 0;  // used: held by running sequences
  int64_t kv_blocks_cached = 0;                     // prefix-cache entries (held or evictable)
  uint64_t kv_evictions = 0;                        // cached blocks evicted (LRU) for new work
  uint64_t requests_finished = 0;
  uint64_t prompt_tokens = 0, generated_tokens = 0;
  uint64_t prefix_query_tokens = 0, prefix_hit_tokens = 0;  // hit rate = hit / query
  uint64_t spec_rounds = 0, spec_drafted = 0, spec_accepted = 0;
  uint64_t steps = 0;
  double step_seconds = 0;     // engine thread time in steps that ran a forward
  double forward_seconds = 0;  // … of which the target's forward_batch
  uint64_t forward_rows = 0;   // rows over all those forwards
  int64_t max_prefill_rows = 0;  // the most prompt rows one step's forward has held (step_prefill_tokens bounds it)
};

// submit() when the waiting queue already holds max_queue requests (the server answers 503 with
// Retry-After).
class EngineFull : public Error {
 public:
  using Error::Error;
};

class Engine {
 public:
  // Starts the engine thread on any target (the CPU model, the CUDA target). The target (and
  // anything make_drafter captures) must outlive the engine; its KV is sized and set up here.
  Engine(const Target& target, EngineOptions opt);
  ~Engine();  // cancels every request (each gets its final event) and joins the thread
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Thread-safe. Validates the request (check_generation: ids in range, prompt + 1 fits the context,
  // sampling params) and throws kd::Error with a message naming the problem; throws EngineFull when
  // the queue is full. Returns the request's id. Requests that do not fit the free KV wait.
  uint64_t submit(EngineRequest req);
  void cancel(uint64_t id);  // thread-safe; unknown or finished ids are ignored
  EngineMetrics metrics() const;
  const ModelConfig& config() const;
  const EngineOptions& options() const;
  int64_t context() const;    // per-sequence context limit in effect
  int64_t kv_tokens() const;  // the KV pool's size in tokens

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kd
