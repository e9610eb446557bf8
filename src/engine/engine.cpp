// The engine thread (engine.h): schedule → one batched forward → post-process, in a loop.
//
// KV admission is by reservation: a request is admitted only when the pool (free blocks plus
// evictable prefix-cache blocks, minus what running sequences have reserved and not yet taken) can
// hold its worst case — prompt + max new tokens (+ one verify tree with a drafter). A running
// sequence therefore never runs out of blocks, nothing is ever preempted, and a request waits
// until earlier ones finish; one whose worst case exceeds the whole pool is rejected at submit.
#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <thread>

#include "core/log.h"
#include "core/thread_pool.h"
#include "engine/sequence.h"
#include "kv/paged_kv.h"
#include "sample/rng.h"
#include "sample/sampler.h"

namespace kd {

namespace {

// Natural-log softmax of logits / temperature (plain logits when greedy) at `tok`, and the k most
// likely tokens (higher logit first, lower id on ties).
TokenLogprob logprob_of(const float* lg, int64_t V, float temperature, int32_t tok, int32_t k) {
  const double inv = temperature > 0 ? 1.0 / double(temperature) : 1.0;
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, double(lg[i]));
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp((double(lg[i]) - mx) * inv);
  const double lse = std::log(sum);
  auto lp = [&](int64_t i) { return float((double(lg[i]) - mx) * inv - lse); };
  TokenLogprob r;
  r.id = tok;
  r.logprob = lp(tok);
  if (k > 0) {
    std::vector<int32_t> idx(static_cast<size_t>(V));
    for (int64_t i = 0; i < V; ++i) idx[size_t(i)] = int32_t(i);
    const int64_t kk = std::min<int64_t>(k, V);
    std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(),
                      [&](int32_t a, int32_t b) { return lg[a] > lg[b] || (lg[a] == lg[b] && a < b); });
    for (int64_t i = 0; i < kk; ++i) r.top.push_back({idx[size_t(i)], lp(idx[size_t(i)])});
  }
  return r;
}

}  // namespace

struct Engine::Impl {
  const Target& target;
  EngineOptions opt;
  int64_t ctx = 0, V = 0;
  int64_t draft_block = 0, draft_taps = 0;  // from a probe drafter; 0 without speculative decoding
  std::vector<int32_t> draft_tap_layers;     // … its tap layers, and whether it takes them on the device
  bool draft_device_taps = false;
  int64_t max_nodes = 0;                     // the most nodes a round verifies (chain: block − 1)
  RoundCosts costs;                          // --budget auto: this device's verify and draft costs
  KvPool pool;
  int64_t reserved_total = 0;  // blocks promised to running sequences and not yet lent

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<EngineSeq>> waiting;  // guarded by mu
  std::vector<uint64_t> cancels;                   // guarded by mu
  bool stop = false;                               // guarded by mu
  uint64_t next_id = 1;                            // guarded by mu
  EngineMetrics m;                                 // guarded by mu

  std::vector<std::unique_ptr<EngineSeq>> running;  // engine thread only
  std::thread thread;

  Impl(const Target& t, EngineOptions o);
  int64_t blocks_for(const EngineSeq& s) const;
  bool try_reserve(EngineSeq& s);
  void admit();
  // prefill_left: prompt rows this step may still take (EngineOptions::step_prefill_tokens; a
  // prefilling sequence takes from it, and waits a step when it is spent).
  bool schedule(EngineSeq& s, SeqForward& f, int64_t& prefill_left);
  void post_sample(EngineSeq& s);
  void post_kv(EngineSeq& s);
  bool commit_token(EngineSeq& s, int32_t tok, const float* lg);
  void publish_blocks(EngineSeq& s);
  void ensure_rows(EngineSeq& s, int64_t rows);
  void emit(EngineSeq& s);
  void finish(EngineSeq& s, const std::string& reason, const std::string& error = "");
  void step();
  void loop();
  void refresh_metrics();
  void init_costs(Drafter& probe);
  void profile_costs(Drafter& probe);
  double time_draft(Drafter& probe);
  void defer_context(EngineSeq& s, const float* taps, int64_t rows);
  void flush_context(EngineSeq& s);
};

namespace {

// Blocks of the pool: opt.kv_tokens, or n_parallel × context, within what the target can hold.
int64_t pool_blocks(const Target& t, const EngineOptions& opt, int64_t ctx) {
  const int64_t kb = std::max<int64_t>(1, opt.kv_block), limit = t.max_kv_tokens(kb);
  if (opt.kv_tokens > limit)
    fail("engine: a KV pool of ", opt.kv_tokens, " tokens does not fit the ", t.device(), " (at most ", limit,
         " tokens now): lower --kv-tokens");
  int64_t want = opt.kv_tokens > 0 ? opt.kv_tokens : std::max<int64_t>(1, opt.n_parallel) * ctx;
  want = std::min(want, limit);
  if (want < kb) fail("engine: no room for a KV pool on the ", t.device(), " (", limit, " tokens fit)");
  return std::max<int64_t>(1, (want + kb - 1) / kb);
}

}  // namespace

Engine::Impl::Impl(const Target& t, EngineOptions o)
    : target(t),
      opt(std::move(o)),
      ctx(std::min(opt.context > 0 ? opt.context : t.config().max_position_embeddings, t.max_context())),
      V(t.config().vocab_size),
      pool(t.config().num_hidden_layers, t.config().latent_dim(), opt.kv_block < 1 ? 1 : opt.kv_block,
           opt.kv_tokens < 0 || opt.kv_block < 1 ? 1 : pool_blocks(t, opt, ctx), t.host_kv()) {
  if (opt.n_parallel < 1) fail("engine: --parallel must be at least 1 (got ", opt.n_parallel, ")");
  if (opt.context < 0) fail("engine: the context (", opt.context, ") is negative");
  if (opt.kv_block < 1) fail("engine: the KV block size must be at least 1 token (got ", opt.kv_block, ")");
  if (opt.kv_tokens < 0) fail("engine: the KV pool size (", opt.kv_tokens, " tokens) is negative");
  if (opt.prefill_chunk < 1) fail("engine: the prefill chunk must be at least 1 token (got ", opt.prefill_chunk, ")");
  if (opt.step_prefill_tokens < 0)
    fail("engine: the prompt tokens per step must be 0 (no limit) or more (got ", opt.step_prefill_tokens, ")");
  if (opt.max_queue < 0) fail("engine: the queue bound (", opt.max_queue, ") is negative");
  std::unique_ptr<Drafter> probe;
  if (opt.make_drafter) {
    check_spec(opt.spec);
    probe = opt.make_drafter();
    if (!probe) fail("engine: make_drafter returned no drafter");
    draft_block = probe->block_size();
    if (draft_block < 2) fail("engine: the drafter's block size (", draft_block, ") must be at least 2");
    draft_taps = int64_t(probe->tap_layers().size());
    draft_tap_layers = probe->tap_layers();
    draft_device_taps = draft_taps > 0 && target.device_taps() && probe->takes_device_taps();
    max_nodes = opt.spec.chain ? draft_block - 1 : opt.spec.budget;
  }
  m.kv_blocks_total = pool.n_blocks();
  target.init_kv(pool.n_blocks(), pool.block_tokens());
  if (probe && opt.spec.auto_budget) init_costs(*probe);
}

// --budget auto's cost(rows): the caller's fixed table, or a micro-profile of verify forwards for
// one sequence on a scratch stretch of the pool (its rows are garbage afterwards and go back free):
// a tree of `rows` rows shaped like a round's (a chain as deep as the block, siblings on it), with
// the outputs a greedy round asks of this target (argmax outputs where it has them) and the
// drafter's taps. Online measurements of single-sequence rounds refine it (step()). Then the
// draft's cost (time_draft) and the ceiling: whether drafting can pay here at all.
void Engine::Impl::init_costs(Drafter& probe) {
  const int64_t max_rows = max_nodes + 1;
  if (!opt.spec.fixed_verify_ms.empty()) {
    costs.verify = VerifyCost(opt.spec.fixed_verify_ms, std::max(max_rows, opt.spec.fixed_verify_ms.back().first));
    costs.draft_ms = std::max(0.0, opt.spec.fixed_draft_ms);
    costs.draft_seen = costs.frozen = true;
  } else {
    profile_costs(probe);
  }
  costs.ceiling = perfect_drafter_ratio(costs.verify, costs.draft_ms, max_nodes, draft_block - 1, costs.shapes);
  costs.speculate = costs.ceiling >= kSpeculationGate;
  log_info("--budget auto: a drafter that is always right would reach ", costs.ceiling, "× AR here (draft ",
           costs.draft_ms, " ms, cost(1) ", costs.verify.ms(1), " ms)",
           costs.speculate ? "" : cat(" — below ", kSpeculationGate, "×, so no round is drafted: every step is AR"));
}

// The draft's cost for the ceiling: draft_tree at context 0 on the probe drafter (a draft leaves the
// context as it is), one untimed pass then the median of nine (on the CPU with the trained pair
// single drafts spread 1.6–2.8 ms). Context 0 makes it a lower bound —
// a round's draft also attends to its context and takes in new rows — so the ceiling errs high:
// a device it shuts out really cannot gain.
double Engine::Impl::time_draft(Drafter& probe) {
  if (probe.context_len() != 0) fail("the drafter already holds context: make_drafter must give a fresh one");
  std::vector<float> scratch;
  std::vector<double> ms;
  for (int i = 0; i < 10; ++i) {
    const double t0 = now_s();
    draft_tree(probe, 0, 0, draft_block - 1, opt.spec, V, scratch, opt.spec.device_top_k);
    if (i > 0) ms.push_back((now_s() - t0) * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void Engine::Impl::profile_costs(Drafter& probe) {
  const int64_t max_rows = max_nodes + 1;
  const int64_t kb = pool.block_tokens(), rows_fit = std::min(max_rows, pool.n_blocks() * kb);
  std::vector<int32_t> blocks;
  for (int64_t r = 0; r < rows_fit; r += kb) blocks.push_back(pool.allocate());
  const int64_t L = draft_block - 1, hid = target.config().hidden_size;
  std::vector<float> logits, taps, am_vals;
  std::vector<int32_t> am_ids;
  const float* dev_taps = nullptr;
  auto time_forward = [&](int64_t n) {
    n = std::min(n, rows_fit);
    std::vector<int32_t> ids(static_cast<size_t>(n)), pos(static_cast<size_t>(n), 0), parent(static_cast<size_t>(n), -1);
    std::vector<uint8_t> vis(static_cast<size_t>(n * n), 0);
    for (int64_t i = 0; i < n; ++i) {
      if (i > 0) parent[size_t(i)] = int32_t(i <= L ? i - 1 : (i - 1 - L) % L);
      if (i > 0) pos[size_t(i)] = pos[size_t(parent[size_t(i)])] + 1;
      ids[size_t(i)] = int32_t((i * 131 + 11) % V);
      for (int64_t a = i; a >= 0; a = parent[size_t(a)]) vis[size_t(i * n + a)] = 1;
    }
    SeqForward f;
    f.kv = pool.view(blocks);
    f.start = 0;
    ForwardArgs& a = f.args;
    a.ids = ids.data();
    a.n = n;
    a.form = AttnForm::absorbed;
    if (n > 1) {  // one row: the AR step's form (causal; the fallback runs exactly that)
      a.positions = pos.data();
      a.visibility = vis.data();
      a.all_logits = true;
    }
    if (target.device_argmax()) {
      am_ids.resize(size_t(n));
      am_vals.resize(size_t(n));
      a.argmax_ids = am_ids.data();
      a.argmax_vals = am_vals.data();
    } else {
      logits.resize(static_cast<size_t>(n * V));
      a.logits = logits.data();
    }
    if (draft_taps > 0) {
      a.tap_layers = &draft_tap_layers;
      if (draft_device_taps && n > 1) {  // (an AR step brings its taps to the host: schedule())
        a.device_taps = &dev_taps;
      } else {
        taps.resize(static_cast<size_t>(n * draft_taps * hid));
        a.taps = taps.data();
      }
    }
    const double t0 = now_s();
    target.forward_batch({f});
    return (now_s() - t0) * 1e3;
  };
  const double t0 = now_s();
  try {
    costs.verify = profile_verify_cost(time_forward, max_rows);
  } catch (...) {
    for (int32_t b : blocks) pool.release(b);
    throw;
  }
  for (int32_t b : blocks) pool.release(b);
  if (target.shape_warmup()) costs.shapes = profile_rows(max_rows);
  std::string table;
  std::vector<int64_t> shown;
  for (int64_t r : {1, 2, 5, 9, 17, 33, 49})
    if (r < max_rows) shown.push_back(r);
  shown.push_back(max_rows);
  for (int64_t r : shown) table += cat(table.empty() ? "" : ", ", r, ": ", costs.verify.ms(r));
  log_info("--budget auto: verify cost by rows (ms) ", table, " — profiled in ", (now_s() - t0) * 1e3, " ms",
           costs.shapes.empty() ? "" : "; rounds verify the profiled sizes only (this device captures a graph per size)");
  costs.draft_ms = time_draft(probe);  // a prior: the rounds' own drafts refine it (observe_draft)
  costs.draft_seen = true;
}

// Host taps of committed rows wait until the drafter next drafts (flush_context); a stretch of
// --budget auto's AR steps then costs the drafter nothing. Bounded, so a long stretch holds little.
void Engine::Impl::defer_context(EngineSeq& s, const float* taps, int64_t rows) {
  constexpr int64_t kMaxPendingRows = 256;
  if (s.ar_only) return;  // it never drafts
  if (s.n_taps) s.pending_taps.insert(s.pending_taps.end(), taps, taps + rows * s.n_taps * target.config().hidden_size);
  s.pending_rows += rows;
  if (s.pending_rows >= kMaxPendingRows) flush_context(s);
}

void Engine::Impl::flush_context(EngineSeq& s) {
  if (s.pending_rows == 0) return;
  s.drafter->append_context(s.n_taps ? s.pending_taps.data() : nullptr, s.pending_rows);
  s.pending_taps.clear();
  s.pending_rows = 0;
}

// Worst-case rows of a request: prompt + every new token, plus one round's scratch tree.
int64_t Engine::Impl::blocks_for(const EngineSeq& s) const {
  int64_t rows = s.lim.n_prompt + s.lim.n_max;
  if (opt.make_drafter) rows += (opt.spec.chain ? draft_block - 1 : opt.spec.budget) + 1;
  return (rows + pool.block_tokens() - 1) / pool.block_tokens();
}

// Takes the prompt's cached prefix and reserves the rest; false (holding nothing) when the pool
// cannot take the request now.
bool Engine::Impl::try_reserve(EngineSeq& s) {
  const int64_t kb = pool.block_tokens();
  uint64_t h = 0;
  // Taps of cached rows are not kept, so a drafter that needs them always prefills in full.
  if (opt.prefix_cache && draft_taps == 0) {
    const int64_t max_hit = (s.lim.n_prompt - 1) / kb;  // the last prompt token always runs: its logits start decoding
    for (int64_t j = 0; j < max_hit; ++j) {
      const int32_t* ids = s.tokens.data() + j * kb;
      const uint64_t hj = KvPool::chain_hash(h, ids, kb);
      const int32_t b = pool.lookup(hj, s.blocks.empty() ? -1 : s.blocks.back(), ids);
      if (b < 0) break;
      s.blocks.push_back(b);
      h = hj;
    }
  }
  const int64_t need = blocks_for(s) - int64_t(s.blocks.size());
  if (pool.n_available() - reserved_total < need) {
    for (int32_t b : s.blocks) pool.release(b);
    s.blocks.clear();
    return false;
  }
  reserved_total += need;
  s.reserved = need;
  s.n_published = int64_t(s.blocks.size());
  s.last_hash = h;
  s.n_kv = s.n_published * kb;
  s.stats.n_cached = s.n_kv;
  return true;
}

void Engine::Impl::admit() {
  std::vector<std::unique_ptr<EngineSeq>> admitted;
  {
    std::lock_guard<std::mutex> lk(mu);
    while (int64_t(running.size() + admitted.size()) < opt.n_parallel && !waiting.empty() && try_reserve(*waiting.front())) {
      admitted.push_back(std::move(waiting.front()));
      waiting.pop_front();
      m.prefix_query_tokens += uint64_t(admitted.back()->lim.n_prompt);
      m.prefix_hit_tokens += uint64_t(admitted.back()->stats.n_cached);
      m.prompt_tokens += uint64_t(admitted.back()->lim.n_prompt);
      admitted.back()->admitted = true;
      ++m.running;
    }
    m.waiting = int64_t(waiting.size());
  }
  for (auto& sp : admitted) {
    EngineSeq& s = *sp;
    s.t_admit = now_s();
    s.stats.queue_ms = (s.t_admit - s.t_submit) * 1e3;
    if (s.lim.n_max == 0) {  // nothing to generate (max_new_tokens 0): as generate_ar, "length" at once
      finish(s, "length");
      continue;
    }
    if (opt.make_drafter) {
      try {
        s.drafter = opt.make_drafter();
        if (!s.drafter) fail("make_drafter returned no drafter");
        if (s.drafter->context_len() != 0) fail("the drafter already holds context: make_drafter must give a fresh one");
        if (s.drafter->block_size() != draft_block || int64_t(s.drafter->tap_layers().size()) != draft_taps)
          fail("make_drafter gave drafters of different shapes");
      } catch (const std::exception& e) {
        finish(s, "error", e.what());
        continue;
      }
      s.n_taps = draft_taps;
      s.stats.tau_histogram.assign(size_t(draft_block + 1), 0);
      s.stats.budget_histogram.assign(size_t(max_nodes + 1), 0);
      if (opt.spec.auto_budget) {
        s.budget = std::make_unique<BudgetController>(max_nodes);
        s.stats.auto_ceiling = costs.ceiling;
        // Where drafting cannot pay (RoundCosts::speculate) every round is an AR step and the drafter
        // is never asked for anything: no taps, no context.
        s.ar_only = !costs.speculate;
        if (s.ar_only) s.n_taps = 0;
      }
      // A drafter on the target's device reads the taps where the forward leaves them.
      s.device_taps = s.n_taps > 0 && target.device_taps() && s.drafter->takes_device_taps();
      s.stage_taps = s.device_taps && s.drafter->stages_device_taps();
      // Prefix-cache rows (only for drafters without taps) count as context the drafter has seen.
      if (s.n_kv > 0 && !s.ar_only) s.drafter->append_context(nullptr, s.n_kv);
    }
    running.push_back(std::move(sp));
  }
}

void Engine::Impl::ensure_rows(EngineSeq& s, int64_t rows) {
  while (int64_t(s.blocks.size()) * pool.block_tokens() < rows) {
    if (s.reserved <= 0) fail("internal: sequence ", s.id, " outgrew its KV reservation");
    const int32_t b = pool.allocate();
    if (b < 0) fail("internal: the KV pool is exhausted despite reservations");
    s.blocks.push_back(b);
    --s.reserved;
    --reserved_total;
  }
}

// This step's rows of one sequence; false when it has none.
bool Engine::Impl::schedule(EngineSeq& s, SeqForward& f, int64_t& prefill_left) {
  if (s.next < 0 && prefill_left <= 0) return false;  // the step's prompt rows are spent: wait a step
  const ModelConfig& c = target.config();
  ForwardArgs& a = f.args;
  s.step_logits = true;
  s.step_prefill = s.next < 0;
  s.post_failed = false;
  s.round.reset();
  s.step_ar = false;
  s.dev_taps = nullptr;
  if (s.next < 0) {
    // Prefill chunk in the target's prefill form (the CPU: expanded MLA, as generate_ar's prefill;
    // row invariance: chunks and prefix-cache hits give the one-shot prefill's latents bit for
    // bit). Logits only after the last prompt row.
    s.step_rows = std::min({opt.prefill_chunk, s.lim.n_prompt - s.n_kv, prefill_left});
    prefill_left -= s.step_rows;
    s.step_logits = s.n_kv + s.step_rows == s.lim.n_prompt;
    a.ids = s.tokens.data() + s.n_kv;
    a.form = target.prefill_form();
  } else if (s.drafter) {
    // A DDTree round after the bonus token `next` at position n_kv.
    const int64_t start = s.n_kv;
    const int64_t L = std::min({draft_block - 1, s.lim.ctx - 1 - start, s.lim.n_max - s.n_out});
    if (L < 1) fail("internal: no draft position left at ", start);
    s.step_ar = s.budget && (s.ar_only || !s.budget->draft_now());
    if (s.step_ar) {
      // --budget auto's fallback: an AR step as a round of the root alone — no drafter call, the
      // forward the AR decode step's; the row's taps still reach the drafter (post_kv), so a later
      // round drafts with full context.
      s.step_choice = s.budget->ar_step(costs);
      s.step_draft_ms = 0;
      s.round = std::make_unique<DraftRound>(make_round(root_tree(L), s.next, start));
    } else {
      // (A drafter on the GPU hands back only the tree builder's top-k: draft_tree.)
      std::vector<float> scratch;
      const double t0 = now_s();
      const int64_t caught_up = s.pending_rows;
      flush_context(s);
      const double flush_ms = (now_s() - t0) * 1e3;
      // Under a grammar, a node is kept only if its path is a prefix the grammar allows: each node's
      // matcher state is its parent's advanced by its token (nodes arrive in index order).
      NodeFilter filter;
      std::vector<grammar::Matcher::State> node_state;
      if (s.matcher && opt.spec.grammar_draft) {
        node_state.push_back(s.matcher->state());  // the root: the bonus, already committed
        filter = [&](int32_t parent, int32_t tok) {
          const grammar::Matcher::State t = s.matcher->after(node_state[size_t(parent)], tok);
          if (t == grammar::Matcher::kDead) return false;
          node_state.push_back(t);
          return true;
        };
      }
      // --budget auto drafts at its largest budget (opt.spec.budget) and keeps the best first N nodes.
      DraftTree tree = draft_tree(*s.drafter, s.next, start, L, opt.spec, V, scratch, opt.spec.device_top_k, filter);
      const double draft_ms = (now_s() - t0) * 1e3;
      s.stats.draft_ms += draft_ms;
      if (s.budget) {
        // A round's draft cost includes the context it takes in — a round's worth (≤ block rows): a
        // catch-up after AR steps counts at that share.
        const double share = caught_up > draft_block ? double(draft_block) / double(caught_up) : 1.0;
        s.step_draft_ms = draft_ms - flush_ms * (1 - share);
        costs.observe_draft(s.step_draft_ms);
        s.step_choice = s.budget->choose(tree, costs);
        tree = truncate_tree(tree, s.step_choice.nodes);
      }
      s.round = std::make_unique<DraftRound>(make_round(std::move(tree), s.next, start));
    }
    s.step_rows = s.round->tree.size();
    a.ids = s.round->tree.tokens.data();
    if (s.step_ar) {
      a.form = s.req.gen.decode_form;  // exactly the AR decode step (one causal row), taps added
    } else {
      a.positions = s.round->positions.data();
      a.visibility = s.round->visibility.data();
      a.form = AttnForm::absorbed;
      a.all_logits = true;
    }
  } else {
    s.step_rows = 1;
    a.ids = &s.next;
    a.form = s.req.gen.decode_form;
  }
  a.n = s.step_rows;
  ensure_rows(s, s.n_kv + s.step_rows);
  // Greedy rows whose logits nobody reads (no kept logits, no logprobs) need only their argmax:
  // where the target computes it (the GPU), the logits stay there.
  const GenerateOptions& g = s.req.gen;
  s.step_argmax = s.step_logits && target.device_argmax() && g.sampling.temperature == 0.0f && !g.keep_logits &&
                  s.req.top_logprobs < 0;
  const int64_t lrows = s.step_logits ? (a.all_logits ? a.n : 1) : 0;
  if (s.step_argmax) {
    s.am_ids.resize(size_t(lrows));
    s.am_vals.resize(size_t(lrows));
    a.argmax_ids = s.am_ids.data();
    a.argmax_vals = s.am_vals.data();
  } else {
    s.logits.resize(static_cast<size_t>(lrows * V));
    a.logits = s.step_logits ? s.logits.data() : nullptr;
  }
  if (s.n_taps) {
    a.tap_layers = &s.drafter->tap_layers();
    // An AR step's row comes to the host and waits (defer_context) like the CPU's: handed to a
    // device drafter at once, each AR step paid the drafter's context update — a copy and nine
    // small kernel launches, ~0.06 ms where the step is 0.2 ms on the H200 — and the next draft
    // takes the whole stretch in one update instead. (The trained pair's poorest prompt on the
    // H200: --budget auto 0.76× → 0.85× AR. The taps' copy-out still cost an AR step ~0.04 ms.)
    // A drafter that stages device taps (stages_device_taps) keeps an AR step's row on the device
    // instead: a device copy a step, the update with its next append or draft (post_kv).
    if (s.device_taps && (!s.step_ar || s.stage_taps)) {
      a.device_taps = &s.dev_taps;
    } else {
      s.taps.resize(static_cast<size_t>(a.n * s.n_taps * c.hidden_size));
      a.taps = s.taps.data();
    }
  }
  f.kv = pool.view(s.blocks);
  f.start = s.n_kv;
  return true;
}

// Appends a committed token (its event entry, logprobs, stop/length check); false when the
// sequence is done (s.ev.finish_reason says why).
bool Engine::Impl::commit_token(EngineSeq& s, int32_t tok, const float* lg) {
  s.tokens.push_back(tok);
  ++s.n_out;
  s.ev.ids.push_back(tok);
  if (s.req.gen.keep_logits) s.ev.logits.insert(s.ev.logits.end(), lg, lg + V);
  if (s.req.top_logprobs >= 0)
    s.ev.logprobs.push_back(logprob_of(lg, V, s.req.gen.sampling.temperature, tok, s.req.top_logprobs));
  const auto& stop_ids = s.req.gen.stop_ids;
  if (!s.req.gen.ignore_eos && std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end())
    s.ev.finish_reason = "stop";
  else if (s.n_out >= s.lim.n_max)
    s.ev.finish_reason = "length";
  return s.ev.finish_reason.empty();
}

// Offers the sequence's newly completed full blocks to the prefix cache: the prompt's, and — where
// a generated row's latent is bit-identical to what a prefill of the same tokens would write (the
// decode form is the target's prefill form: on the GPU, absorbed throughout) — the generated
// ones too, so an agent's next turn (this prompt + this answer + more) reuses the answer's KV.
// On the CPU, prompts prefill in the expanded form and decode rows are absorbed: their bits differ,
// so only prompt blocks are published there (a hit must not change the output).
void Engine::Impl::publish_blocks(EngineSeq& s) {
  if (!opt.prefix_cache) return;
  const int64_t kb = pool.block_tokens();
  const bool generated_ok = s.req.gen.decode_form == target.prefill_form();
  const int64_t full = (generated_ok ? s.n_kv : std::min(s.n_kv, s.lim.n_prompt)) / kb;
  for (; s.n_published < full; ++s.n_published) {
    const int64_t j = s.n_published;
    const int32_t* ids = s.tokens.data() + j * kb;
    const uint64_t h = KvPool::chain_hash(s.last_hash, ids, kb);
    pool.publish(s.blocks[size_t(j)], h, j > 0 ? s.blocks[size_t(j - 1)] : -1, ids);
    s.last_hash = h;
  }
}

// Sampling, the accept walk and the tokens' events: per sequence only, so the sequences of a step
// run this in parallel (drawing from K2's 163,840 logits costs ~1 ms a token on the host).
void Engine::Impl::post_sample(EngineSeq& s) {
  const SamplingParams& sp = s.req.gen.sampling;
  const uint64_t seq_id = s.req.gen.seq_id;
  // Logit row `row` of this step: on the host, or (argmax outputs) left where the target computed it.
  std::vector<float> fetched;
  auto row_of = [&](int32_t row) -> const float* {
    if (!s.step_argmax) return s.logits.data() + size_t(row) * size_t(V);
    fetched.resize(size_t(V));
    target.logits_row(s.batch_index, row, fetched.data());
    return fetched.data();
  };
  // The target's choice at a row: sample(logits, position_uniform(seed, seq, position)) — with
  // argmax outputs (greedy), the device's argmax, which is sample()'s greedy choice; a row it cannot
  // settle (a NaN, nothing selectable) goes to sample(), which names the problem.
  auto choose = [&](int32_t row, int64_t pos) {
    if (s.matcher) {
      // Constrained: the device's argmax stands when the grammar allows it (it is then the masked
      // argmax too); otherwise the row is masked on the host. The walk commits each choice before
      // the next node's, so the matcher is at this node's state (DDTree included).
      if (s.step_argmax && s.am_ids[size_t(row)] >= 0 && s.am_vals[size_t(row)] != -INFINITY &&
          s.matcher->allowed(s.matcher->state(), s.am_ids[size_t(row)]))
        return s.am_ids[size_t(row)];
      const float* lg = row_of(row);
      s.masked.assign(lg, lg + V);
      const int64_t n_vocab = std::min<int64_t>(V, s.req.grammar.vocab->vocab_size());
      s.matcher->apply(s.masked.data(), n_vocab);
      std::fill(s.masked.begin() + n_vocab, s.masked.end(), -INFINITY);  // padded lm_head rows are no tokens
      return sample(s.masked.data(), int32_t(V), sp, position_uniform(sp.seed, seq_id, uint64_t(pos)));
    }
    if (s.step_argmax && s.am_ids[size_t(row)] >= 0 && s.am_vals[size_t(row)] != -INFINITY) return s.am_ids[size_t(row)];
    return sample(row_of(row), int32_t(V), sp, position_uniform(sp.seed, seq_id, uint64_t(pos)));
  };
  // (A row whose token is emitted is read whole only when kept or asked for logprobs: never with
  // argmax outputs, which are asked only when neither is.) Constrained rows report the masked row.
  auto commit = [&](int32_t tok, int32_t row) {
    if (s.matcher) {
      if (!s.matcher->commit(tok)) fail("internal: the grammar rejected token ", tok, " it allowed");
      const float* lg = s.step_argmax && s.masked.empty() ? nullptr : (s.masked.empty() ? row_of(row) : s.masked.data());
      bool more = commit_token(s, tok, lg);
      s.masked.clear();
      if (more && s.matcher->finished()) {
        s.ev.finish_reason = "stop";  // the grammar is complete and nothing may follow
        more = false;
      }
      return more;
    }
    return commit_token(s, tok, s.step_argmax ? nullptr : row_of(row));
  };
  if (!s.round) {
    if (!s.step_logits) return;
    // The token at position tokens.size(), exactly as the AR reference draws it.
    const int32_t tok = choose(0, int64_t(s.tokens.size()));
    if (s.step_prefill) s.t_first = now_s();
    if (commit(tok, 0)) s.next = tok;
    return;
  }
  // DDTree round: walk the tree against the target's choices, committing as it goes.
  const DraftTree& tree = s.round->tree;
  s.path = accept_walk(tree, s.n_kv, choose, commit, &s.next);
  const int64_t tau = int64_t(s.path.size());
  ++s.stats.rounds;
  s.stats.drafted += tree.size() - 1;
  s.stats.accepted += tau - 1;
  ++s.stats.tau_histogram[size_t(std::min<int64_t>(tau, int64_t(s.stats.tau_histogram.size()) - 1))];
  s.stats.round_tau.push_back(int32_t(tau));
  if (opt.spec.record_trees) s.stats.round_trees.push_back({s.n_kv, tree.tokens, tree.parents, tree.depths, s.path});
  auto& bh = s.stats.budget_histogram;
  if (!bh.empty()) ++bh[size_t(std::min<int64_t>(tree.size() - 1, int64_t(bh.size()) - 1))];
  if (s.budget) {
    s.stats.ar_steps += s.step_ar;
    s.stats.predicted_tokens += s.step_choice.tokens;
    s.stats.predicted_ms += s.step_choice.ms;
    // Only a walk that left the tree knows every verified node's fate (emit may stop it inside).
    if (s.ev.finish_reason.empty() && !s.step_ar) s.budget->observe(tree, s.path, costs);
  }
  std::lock_guard<std::mutex> lk(mu);
  ++m.spec_rounds;
  m.spec_drafted += uint64_t(tree.size() - 1);
  m.spec_accepted += uint64_t(tau - 1);
}

// The KV side of a step (serial: the pool, the target and the drafters are the engine thread's):
// commit the rows, keep a DDTree round's accepted rows (compacted into place), publish full
// blocks, feed the drafter.
void Engine::Impl::post_kv(EngineSeq& s) {
  if (!s.round) {
    s.n_kv += s.step_rows;
    publish_blocks(s);
    if (s.step_prefill && s.drafter) {
      if (s.dev_taps)
        s.drafter->append_context_device(s.dev_taps, s.step_rows, nullptr);
      else
        defer_context(s, s.n_taps ? s.taps.data() : nullptr, s.step_rows);
    }
    return;
  }
  if (!s.ev.finish_reason.empty()) return;
  const int64_t start = s.n_kv, tau = int64_t(s.path.size());
  target.keep_rows(pool.view(s.blocks), start, s.path);
  s.n_kv = start + tau;
  publish_blocks(s);
  if (s.dev_taps) {
    if (s.step_ar)  // an AR step's one row (the root): staged on the device (schedule())
      s.drafter->stage_context_device(s.dev_taps, tau);
    else
      s.drafter->append_context_device(s.dev_taps, tau, s.path.data());
    return;
  }
  const int64_t hid = target.config().hidden_size, width = s.n_taps * hid;
  std::vector<float> acc(static_cast<size_t>(tau * width));
  for (int64_t k = 0; k < tau && width; ++k)
    std::copy_n(&s.taps[size_t(s.path[size_t(k)] * width)], width, &acc[size_t(k * width)]);
  defer_context(s, width ? acc.data() : nullptr, tau);
}

// Sends the tokens committed this step (if any); a false return asks for cancellation.
void Engine::Impl::emit(EngineSeq& s) {
  if (s.ev.ids.empty()) return;
  {
    std::lock_guard<std::mutex> lk(mu);
    m.generated_tokens += uint64_t(s.ev.ids.size());
  }
  bool keep = false;
  try {
    keep = s.req.on_event(s.ev);
  } catch (...) {
    keep = false;  // a throwing callback is treated as a client gone
  }
  if (!keep) s.cancel = true;
  s.ev = EngineEvent{};
}

void Engine::Impl::finish(EngineSeq& s, const std::string& reason, const std::string& error) {
  for (int32_t b : s.blocks) pool.release(b);
  s.blocks.clear();
  reserved_total -= s.reserved;
  s.reserved = 0;
  const double t = now_s();
  if (s.t_admit == 0) s.t_admit = t, s.stats.queue_ms = (t - s.t_submit) * 1e3;
  if (s.t_first == 0) s.t_first = t;
  s.stats.n_prompt = s.lim.n_prompt;
  s.stats.n_generated = s.n_out;
  s.stats.prefill_ms = (s.t_first - s.t_admit) * 1e3;
  s.stats.decode_ms = (t - s.t_first) * 1e3;
  s.ev.done = true;
  s.ev.finish_reason = reason;
  s.ev.grammar_incomplete = s.matcher && !s.matcher->accepting();
  s.ev.error = error;
  s.ev.stats = s.stats;
  {
    std::lock_guard<std::mutex> lk(mu);
    m.generated_tokens += uint64_t(s.ev.ids.size());
    ++m.requests_finished;
    // Metrics are current when the final event arrives (a client may read them right after it).
    if (s.admitted) --m.running;
    s.admitted = false;
    m.kv_blocks_used = pool.n_used();
    m.kv_blocks_cached = pool.n_cached();
    m.kv_evictions = pool.n_evictions();
  }
  try {
    s.req.on_event(s.ev);
  } catch (...) {
  }
  s.ev = EngineEvent{};
}

void Engine::Impl::step() {
  // Cancellations: waiting requests end here; running ones are flagged and freed below.
  std::vector<std::unique_ptr<EngineSeq>> dropped;
  {
    std::lock_guard<std::mutex> lk(mu);
    for (uint64_t id : cancels) {
      auto w = std::find_if(waiting.begin(), waiting.end(), [&](const auto& s) { return s->id == id; });
      if (w != waiting.end()) {
        dropped.push_back(std::move(*w));
        waiting.erase(w);
        continue;
      }
      for (auto& s : running)
        if (s->id == id) s->cancel = true;
    }
    cancels.clear();
  }
  for (auto& s : dropped) finish(*s, "cancelled");
  for (auto& s : running)
    if (s->cancel) finish(*s, "cancelled");
  std::erase_if(running, [](const auto& s) { return s->cancel; });

  admit();
  if (running.empty()) return;

  std::vector<SeqForward> batch;
  std::vector<EngineSeq*> in_batch;
  int64_t prefill_left = opt.step_prefill_tokens > 0 ? opt.step_prefill_tokens : std::numeric_limits<int64_t>::max();
  int64_t prefill_rows = 0;
  for (auto& sp : running) {
    EngineSeq& s = *sp;
    SeqForward f;
    try {
      if (!schedule(s, f, prefill_left)) continue;
      if (s.step_prefill) prefill_rows += s.step_rows;
    } catch (const std::exception& e) {
      s.ev.finish_reason = "error";
      s.ev.error = e.what();
      s.ev.request_error = dynamic_cast<const grammar::LimitError*>(&e) != nullptr;
      continue;
    }
    s.batch_index = int64_t(batch.size());
    batch.push_back(std::move(f));
    in_batch.push_back(&s);
  }
  const double t_step = now_s();
  double t_fwd = 0;
  int64_t rows = 0;
  for (const SeqForward& f : batch) rows += f.args.n;
  if (!batch.empty()) {
    try {
      const double t0 = now_s();
      ForwardStats fst;
      target.forward_batch(batch, &fst);
      t_fwd = now_s() - t0;
      // --budget auto's cost model is one sequence's: only a forward of one round refines it.
      if (in_batch.size() == 1 && in_batch[0]->round && in_batch[0]->budget) {
        const EngineSeq& q = *in_batch[0];
        // (-v) The controller's view of each round, before this round refines it: what it chose and
        // predicted, what the draft and the verify measured, the model's costs and its smoothed ratio.
        if (log_level() >= LogLevel::debug)
          log_debug("budget auto: pos ", q.n_kv, q.step_ar ? " AR step" : " round", " N ", q.step_choice.nodes,
                    " predicted ", q.step_choice.tokens, " tok in ", q.step_choice.ms, " ms; measured draft ",
                    q.step_draft_ms, " ms, verify(", rows, ") ", t_fwd * 1e3, " ms; model draft ", costs.draft_ms,
                    " ms, cost(", rows, ") ", costs.verify.ms(rows), " ms, cost(1) ", costs.verify.ms(1),
                    " ms; ratio ", q.budget->ratio(), ", AR steps left ", q.budget->ar_left());
        costs.observe_verify(rows, t_fwd * 1e3);
      }
      for (EngineSeq* q : in_batch) {
        RequestStats& rs = q->stats;
        ++rs.forwards;
        (q->step_prefill ? rs.prefill_weight_bytes : rs.decode_weight_bytes) += fst.weight_bytes;
        if (q->step_prefill) rs.prefill_forward_ms += t_fwd * 1e3;
        if (q->round) rs.verify_ms += t_fwd * 1e3;
      }
      ThreadPool::global().parallel_for(int64_t(in_batch.size()), 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          EngineSeq& q = *in_batch[size_t(i)];
          try {
            post_sample(q);
          } catch (const std::exception& ex) {
            q.ev.finish_reason = "error";
            q.ev.error = ex.what();
            q.ev.request_error = dynamic_cast<const grammar::LimitError*>(&ex) != nullptr;
            q.post_failed = true;
          }
        }
      });
      for (EngineSeq* s : in_batch) {
        if (s->post_failed) continue;
        try {
          post_kv(*s);
        } catch (const std::exception& e) {
          s->ev.finish_reason = "error";
          s->ev.error = e.what();
        }
      }
    } catch (const std::exception& e) {
      for (EngineSeq* s : in_batch) {
        s->ev.finish_reason = "error";
        s->ev.error = e.what();
      }
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    ++m.steps;
    if (!batch.empty()) {
      m.step_seconds += now_s() - t_step;
      m.forward_seconds += t_fwd;
      m.forward_rows += uint64_t(rows);
      m.max_prefill_rows = std::max(m.max_prefill_rows, prefill_rows);
    }
  }
  for (auto& sp : running) {
    EngineSeq& s = *sp;
    if (!s.ev.finish_reason.empty()) {
      const std::string reason = s.ev.finish_reason, error = s.ev.error;
      finish(s, reason, error);
      s.cancel = true;  // removed below
    } else {
      emit(s);
      if (s.cancel) finish(s, "cancelled");
    }
  }
  std::erase_if(running, [](const auto& s) { return s->cancel; });
}

void Engine::Impl::refresh_metrics() {
  std::lock_guard<std::mutex> lk(mu);
  m.running = int64_t(running.size());
  m.waiting = int64_t(waiting.size());
  m.kv_blocks_used = pool.n_used();
  m.kv_blocks_cached = pool.n_cached();
  m.kv_evictions = pool.n_evictions();
}

void Engine::Impl::loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return stop || !waiting.empty() || !running.empty() || !cancels.empty(); });
      if (stop) break;
    }
    try {
      step();
    } catch (const std::exception& e) {
      // Should not happen (every per-sequence failure is caught in step); fail what is running
      // rather than take the process down.
      log_info("engine step failed: ", e.what());
      for (auto& s : running) finish(*s, "error", e.what());
      running.clear();
    }
    refresh_metrics();
  }
  // Shutdown: every request still here gets its final event.
  for (auto& s : running) finish(*s, "cancelled");
  running.clear();
  std::deque<std::unique_ptr<EngineSeq>> rest;
  {
    std::lock_guard<std::mutex> lk(mu);
    rest.swap(waiting);
  }
  for (auto& s : rest) finish(*s, "cancelled");
  refresh_metrics();
}

Engine::Engine(const Target& target, EngineOptions opt) : impl_(std::make_unique<Impl>(target, std::move(opt))) {
  impl_->thread = std::thread([this] { impl_->loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
}

uint64_t Engine::submit(EngineRequest req) {
  Impl& I = *impl_;
  if (!req.on_event) fail("engine: the request has no on_event callback");
  if (req.top_logprobs < -1 || req.top_logprobs > 20)
    fail("top_logprobs must be between 0 and 20 (got ", req.top_logprobs, ")");
  auto s = std::make_unique<EngineSeq>();
  GenerateOptions& gen = req.gen;
  gen.context = gen.context > 0 ? std::min(gen.context, I.ctx) : I.ctx;
  if (!I.target.supports(gen.decode_form))
    fail("the ", I.target.device(), " target runs the absorbed MLA form only: use --decode-attn absorbed");
  s->lim = check_generation(I.target.config(), req.prompt, gen);
  s->tokens = req.prompt;
  if (req.grammar.grammar || req.grammar.vocab) {
    if (!req.grammar.grammar || !req.grammar.vocab) fail("engine: a constrained request needs both a grammar and a vocabulary");
    s->matcher = std::make_unique<grammar::Matcher>(req.grammar.grammar, req.grammar.vocab,
                                                    gen.ignore_eos ? std::vector<int32_t>{} : gen.stop_ids, req.grammar.masks);
  }
  s->req = std::move(req);
  const int64_t need = I.blocks_for(*s);
  if (need > I.pool.n_blocks())
    fail("the request needs up to ", need * I.pool.block_tokens(), " KV rows (a ", s->lim.n_prompt, "-token prompt + up to ",
         s->lim.n_max, " new tokens), more than the whole KV pool of ", I.pool.n_blocks() * I.pool.block_tokens(),
         " tokens: lower max_tokens or enlarge the pool");
  s->t_submit = now_s();
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(I.mu);
    // Requests not yet admitted include those about to take a free slot: only the rest wait.
    const int64_t free_slots = std::max<int64_t>(0, I.opt.n_parallel - I.m.running);
    if (int64_t(I.waiting.size()) >= I.opt.max_queue + free_slots)
      throw EngineFull(cat("the engine's queue is full (", I.opt.max_queue, " requests waiting): retry later"));
    id = s->id = I.next_id++;
    I.waiting.push_back(std::move(s));
    I.m.waiting = int64_t(I.waiting.size());
  }
  I.cv.notify_all();
  return id;
}

void Engine::cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->cancels.push_back(id);
  }
  impl_->cv.notify_all();
}

EngineMetrics Engine::metrics() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->m;
}

const ModelConfig& Engine::config() const { return impl_->target.config(); }
const EngineOptions& Engine::options() const { return impl_->opt; }
int64_t Engine::context() const { return impl_->ctx; }
int64_t Engine::kv_tokens() const { return impl_->pool.n_blocks() * impl_->pool.block_tokens(); }

}  // namespace kd
