#include "engine/generate.h"

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "core/error.h"
#include "engine/engine.h"

namespace kd {

namespace {

// The caller's drafter, lent to the engine (which owns the drafters it runs).
class LentDrafter final : public Drafter {
 public:
  explicit LentDrafter(Drafter& d) : d_(d) {}
  std::string name() const override { return d_.name(); }
  int64_t block_size() const override { return d_.block_size(); }
  const std::vector<int32_t>& tap_layers() const override { return d_.tap_layers(); }
  void append_context(const float* taps, int64_t n) override { d_.append_context(taps, n); }
  int64_t context_len() const override { return d_.context_len(); }
  void draft(int32_t bonus, int64_t start, float* logits) override { d_.draft(bonus, start, logits); }
  bool top_k_on_device(int32_t bonus, int64_t start, int64_t L, int64_t k, DraftTopK& out) override {
    return d_.top_k_on_device(bonus, start, L, k, out);
  }
  bool takes_device_taps() const override { return d_.takes_device_taps(); }
  void append_context_device(const float* taps_dev, int64_t n, const int32_t* rows) override {
    d_.append_context_device(taps_dev, n, rows);
  }
  bool stages_device_taps() const override { return d_.stages_device_taps(); }
  void stage_context_device(const float* taps_dev, int64_t n) override { d_.stage_context_device(taps_dev, n); }

 private:
  Drafter& d_;
};

// Runs one request through an engine sized for it alone: one sequence, the whole prompt in one
// prefill forward, a KV pool of its worst case, no prefix cache. The pool's blocks: on a target with
// host KV, 16 rows each, storage taken as the sequence grows (memory follows what is generated, not
// max_new_tokens); on a device target, one block as long as the worst case (its single-sequence view).
SpecResult run_one(const Target& target, Drafter* drafter, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                   const SpecOptions& spec, const std::function<void(int32_t)>& on_token) {
  const GenerationLimits lim = check_generation(target.config(), prompt, opt);
  if (drafter) check_spec(spec);  // before the budget sizes the KV
  EngineOptions eo;
  eo.n_parallel = 1;
  eo.context = lim.ctx;
  eo.prefill_chunk = lim.n_prompt;
  eo.max_queue = 0;
  eo.prefix_cache = false;
  // The KV: one block as long as the request's worst case (a single-sequence cache).
  int64_t rows = lim.n_prompt + lim.n_max + 1;
  if (drafter) {
    eo.spec = spec;
    eo.make_drafter = [drafter] { return std::make_unique<LentDrafter>(*drafter); };
    rows += spec.chain ? drafter->block_size() : spec.budget + 1;
  }
  eo.kv_block = target.host_kv() ? 16 : rows;
  eo.kv_tokens = (rows + eo.kv_block - 1) / eo.kv_block * eo.kv_block;
  Engine engine(target, eo);

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  SpecResult res;
  GenerateResult& r = res.gen;
  EngineRequest req;
  req.prompt = prompt;
  req.gen = opt;
  std::exception_ptr callback_error;  // the caller's on_token threw: generation stops, the error is rethrown
  req.on_event = [&](const EngineEvent& ev) {
    for (int32_t id : ev.ids) {
      r.output_ids.push_back(id);
      if (on_token && !callback_error) {
        try {
          on_token(id);
        } catch (...) {
          callback_error = std::current_exception();
        }
      }
    }
    if (opt.keep_logits) r.logits.insert(r.logits.end(), ev.logits.begin(), ev.logits.end());
    if (ev.done) {
      // Once `done` is set the caller may return and destroy everything captured here (this frame's
      // mutex, results and callback_error): nothing of it is touched after the lock is released —
      // the answer is taken first and cv is notified under the lock (clang's ASan found the read of
      // callback_error after the unlock, a stack-use-after-scope).
      const bool keep = !callback_error;
      std::lock_guard<std::mutex> lk(mu);
      r.finish_reason = ev.finish_reason;
      const RequestStats& s = ev.stats;
      r.n_prompt = s.n_prompt;
      r.prefill_ms = s.forwards ? s.prefill_ms : 0;  // (max_new_tokens 0: nothing ran)
      r.decode_ms = s.forwards ? s.decode_ms : 0;
      r.n_target_forwards = s.forwards;
      r.prefill_weight_bytes = s.prefill_weight_bytes;
      r.decode_weight_bytes = s.decode_weight_bytes;
      SpecStats& st = res.stats;
      st.rounds = s.rounds;
      st.target_forwards = s.forwards;
      st.drafted = s.drafted;
      st.accepted = s.accepted;
      st.tau_histogram = s.tau_histogram;
      st.round_tau = s.round_tau;
      st.round_trees = s.round_trees;
      st.draft_ms = s.draft_ms;
      st.verify_ms = s.verify_ms;
      st.prefill_ms = s.prefill_forward_ms;
      st.budget_histogram = s.budget_histogram;
      st.ar_steps = s.ar_steps;
      st.predicted_tokens = s.predicted_tokens;
      st.predicted_ms = s.predicted_ms;
      st.auto_ceiling = s.auto_ceiling;
      if (ev.finish_reason == "error") r.finish_reason = "error: " + ev.error;
      done = true;
      cv.notify_all();
      return keep;
    }
    return !callback_error;
  };
  engine.submit(std::move(req));
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done; });
  if (callback_error) std::rethrow_exception(callback_error);
  if (r.finish_reason.rfind("error: ", 0) == 0) fail(r.finish_reason.substr(7));
  if (drafter && res.stats.tau_histogram.empty()) res.stats.tau_histogram.assign(size_t(drafter->block_size() + 1), 0);
  return res;
}

}  // namespace

GenerateResult generate_ar(const Target& target, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                           const std::function<void(int32_t)>& on_token) {
  return run_one(target, nullptr, prompt, opt, {}, on_token).gen;
}

SpecResult generate_ddtree(const Target& target, Drafter& drafter, const std::vector<int32_t>& prompt,
                           const GenerateOptions& opt, const SpecOptions& spec,
                           const std::function<void(int32_t)>& on_token) {
  if (drafter.context_len() != 0) fail("the drafter already holds context: use a fresh drafter per generation");
  return run_one(target, &drafter, prompt, opt, spec, on_token);
}

}  // namespace kd
