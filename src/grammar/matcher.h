// Runs a byte-level Grammar over committed tokens and computes which tokens may come next.
//
// The grammar is a pushdown automaton: a *stack* is the element to match next, then the return
// points of the rules it is inside (a persistent list, interned, so equal stacks are one id), and a
// parser *state* is the set of stacks still alive (an ambiguous grammar keeps several). States are
// interned too, and every (state, byte) → state transition is remembered, so the automaton is a DFA
// built lazily as bytes are seen: after the first visit, following a token's bytes is one table
// lookup a byte. Calls into rules push their return point unless it ends the alternative (a tail
// call), so `x*` written as right recursion runs in constant depth. Left recursion is refused when
// the grammar is built (grammar.h).
//
// A mask walks the vocabulary trie (vocab_trie.h) from the state: a rejected byte prunes its whole
// subtree; each token whose bytes are all accepted is allowed; a subtree of plain or UTF-8 text from a
// state that loops on all such text (inside a JSON string) is allowed without walking it. Masks are
// cached per state, so a
// state seen again (inside a JSON string, between array items) costs a copy. Stop ids are allowed
// exactly where the grammar may end; other special tokens never are.
//
// An ambiguous grammar can keep exponentially many stacks alive ((x+)+, nested repetitions): a
// state of more than kMaxStacksPerState stacks is a kd::Error naming the problem (a request fails
// cleanly; the server keeps serving). The closures of one step visit each (element, return stack)
// once, so grammars whose empty paths reconverge ((""|"")(""|"")…, x*x*x*…) cost linear work, not
// 2^n or n². And every parser step is paid from a work budget (kWorkBurst, refilled by
// kWorkPerToken at each committed token): whatever the grammar, a request's matching costs at most
// a fixed number of steps a token on the serving thread, else a kd::Error.
//
// Masks can also be shared by every matcher of one grammar and vocabulary (SharedMasks: every
// request with the same schema or tools), so an agent that sends the same tools with each request
// pays a state's trie walk once per server, not once per request.
//
// Not thread-safe: one Matcher per sequence (the grammar and trie it reads are shared, read-only;
// a SharedMasks is thread-safe).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "grammar/grammar.h"
#include "grammar/vocab_trie.h"

namespace kd::grammar {

// A Grammar flattened for the matcher: each alternative is a run of elements ending in `end`.
struct CompiledGrammar {
  struct Elem {
    uint8_t kind;   // 0 bytes, 1 rule, 2 end of alternative
    int32_t index;  // bytes: set index; rule: rule id
  };
  explicit CompiledGrammar(const Grammar& g);
  std::vector<Elem> elems;
  std::vector<std::vector<int32_t>> alt_starts;  // [rules] → positions in elems
  std::vector<ByteSet> sets;
  std::vector<std::string> names;
  int32_t root = 0;
};

// A grammar that is valid but past what the matcher will do for it (more parses alive at once than
// kMaxStacksPerState, or its work budget spent): the request's fault, not the server's — a 400.
struct LimitError : kd::Error {
  using kd::Error::Error;
};

// The masks of one grammar over one vocabulary, shared by its matchers (thread-safe). A state's mask
// is a function of what its stacks hold — their elements top first — and of the stop ids, not of
// the ids a matcher gave them, so it is keyed by that content (Matcher::shared_key). Bounded: past
// max_bytes (keys and masks) nothing more is kept; the states a document opens with, which every
// request passes, are the first ones in.
class SharedMasks {
 public:
  using Mask = std::shared_ptr<const std::vector<uint32_t>>;
  static constexpr size_t kDefaultMaxBytes = size_t(4) << 20;  // ≈ 200 masks of Kimi's 163,840 tokens
  SharedMasks(std::shared_ptr<const CompiledGrammar> g, std::shared_ptr<const VocabTrie> vocab, size_t max_bytes = kDefaultMaxBytes);
  const CompiledGrammar* grammar() const { return g_.get(); }
  const VocabTrie* vocab() const { return vocab_.get(); }
  Mask find(const std::string& key) const;   // null when absent
  void insert(const std::string& key, Mask m);  // kept unless present or the cache is full
  struct Stats {
    int64_t hits = 0, misses = 0, entries = 0, bytes = 0;
  };
  Stats stats() const;

 private:
  std::shared_ptr<const CompiledGrammar> g_;
  std::shared_ptr<const VocabTrie> vocab_;
  size_t max_bytes_;
  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, Mask> masks_;
  size_t bytes_ = 0;
  mutable std::atomic<int64_t> hits_{0}, misses_{0};
};

class Matcher {
 public:
  using State = int32_t;
  static constexpr State kDead = 0;  // no stack left: the bytes so far are not a prefix of the language
  static constexpr size_t kMaxStacksPerState = 16384;
  static constexpr size_t kMaxClosureItems = 16 * kMaxStacksPerState;  // (element, stack) pairs one step visits
  // The work budget, in parser steps: an (element, stack) pair a closure visits, a rule it expands
  // (and each alternative it pushes), 16 stacks an advance scans, a stack a memo reset rebuilds. A
  // matcher starts with kWorkBurst and gains kWorkPerToken at each committed token, up to kWorkBurst;
  // a step past an empty budget is a LimitError. Masks run on the serving thread (every sequence of
  // the batch waits for them), so this bounds what one hostile grammar costs the others: ≈ 0.19 s at
  // first, then ≈ 3 ms a token, at the ≤ 45 ns a step measured on a 163,840-token vocabulary
  // (docs/perf.md). GrammarPerf's two schemas pay 16,768 and 57,353 steps over their 27 and 58 tokens
  // (≈ 620 and 990 a token), an enum of 16,000 values ≈ 200,000 a mask. What a mask costs besides its
  // steps (one visit of each trie node it reaches) is bounded by the vocabulary.
  static constexpr int64_t kWorkBurst = int64_t(1) << 22;
  static constexpr int64_t kWorkPerToken = int64_t(1) << 16;

  // shared (optional): masks shared with the grammar's other matchers; it must be for this grammar
  // and vocabulary.
  Matcher(std::shared_ptr<const CompiledGrammar> g, std::shared_ptr<const VocabTrie> vocab, std::vector<int32_t> stop_ids,
          std::shared_ptr<SharedMasks> shared = nullptr);

  State state() const { return cur_; }
  State advance(State s, uint8_t byte);
  State advance_bytes(State s, std::string_view bytes);
  // The state after token `id`: kDead for a rejected token (a special token only where the grammar
  // names it; a stop id is not text: see after()).
  State advance_token(State s, int32_t id);
  // advance_token, except that a stop id where the grammar may end leaves the state as it is.
  State after(State s, int32_t id);
  bool accepting(State s) const;     // the grammar may end here
  bool can_continue(State s) const;  // some byte may follow

  // Allowed tokens in `s`: bit id of word id / 32. Valid until the next call on this matcher.
  const std::vector<uint32_t>& mask(State s);
  bool allowed(State s, int32_t id);
  // Sets disallowed logits[0, n) to −inf (the mask of the current state; n ≤ the vocabulary).
  void apply(float* logits, int64_t n);

  // Commits token `id`: false (state unchanged) if the grammar does not allow it. A stop id is
  // accepted where the grammar may end and leaves the state as it is (generation ends there).
  bool commit(int32_t id);
  bool accepting() const { return accepting(cur_); }
  // The grammar is complete and nothing may follow: generation must stop here.
  bool finished() const { return accepting(cur_) && !can_continue(cur_); }

  // Work done so far, for tests and the perf notes.
  struct Stats {
    int64_t masks_computed = 0, masks_cached = 0, trie_nodes_visited = 0, states = 0, stacks = 0, resets = 0;
    int64_t masks_shared = 0;   // masks taken from the SharedMasks (another matcher walked them)
    int64_t closure_items = 0;  // (element, stack) pairs visited by every step so far
    int64_t work = 0;           // parser steps paid from the work budget so far (closure items included)
    int64_t closure_pops = 0;   // worklist entries the closures took (visited or not): what they really did
  };
  const Stats& stats() const { return stats_; }
  // State s's key in a SharedMasks: the stop ids where s may end (nothing elsewhere), then each
  // stack's elements top first, the stacks in sorted order — equal for equal states of any matcher of
  // the grammar. Empty (not shared) past kMaxSharedKeyInts. (A mask found shared costs no parser
  // steps, so a grammar near its work budget may pass after another request walked its states.)
  std::string shared_key(State s);
  static constexpr size_t kMaxSharedKeyInts = 4096;
  // The memo is dropped (the current state kept) at a commit past these sizes; tests lower them.
  void set_memo_limits(size_t max_stacks, size_t max_transitions) { max_stacks_ = max_stacks, max_transitions_ = max_transitions; }
  // Whether masks skip the walk of text subtrees from states that loop on all text (on by default;
  // tests and the perf notes turn it off to compare).
  void set_text_skip(bool on) { text_skip_ = on; }
  // kWorkBurst and kWorkPerToken for this matcher (tests lower them); the budget restarts full.
  void set_work_limits(int64_t burst, int64_t per_token) { burst_ = budget_ = burst, per_token_ = per_token; }

 private:
  int32_t intern_stack(int32_t pos, int32_t parent);
  State advance_special(State s, int32_t id);
  void begin_closures();  // a new visited set for the closures of one step
  void closure(int32_t pos, int32_t parent, std::vector<int32_t>& out);
  State intern_state(std::vector<int32_t>& stacks);
  void reset_tables();  // drops the memo, keeping the current state's stacks
  bool loops_on_plain(State s);  // advance(s, b) == s for every plain byte (VocabTrie::plain_byte)
  // loops_on_plain, and every UTF-8 character above U+007F (VocabTrie::text_subtree) leads back to s:
  // then every text string is allowed from s (inside a JSON string, Chinese as well as ASCII).
  bool loops_on_text(State s);

  std::shared_ptr<const CompiledGrammar> g_;
  std::shared_ptr<const VocabTrie> vocab_;
  std::vector<int32_t> stop_ids_;
  State cur_ = kDead;

  std::vector<int32_t> node_pos_, node_parent_;        // [stacks] top element, rest of the stack (−1: bottom)
  std::unordered_map<uint64_t, int32_t> node_index_;   // (pos, parent) → stack
  std::vector<int32_t> state_begin_, state_members_;   // [states + 1] → sorted stacks (−1: the empty stack, accepting)
  std::vector<int8_t> loops_;                          // [states] loops_on_plain: −1 not yet known
  std::vector<int8_t> text_loops_;                     // [states] loops_on_text: −1 not yet known
  std::unordered_map<std::string, int32_t> state_index_;
  std::unordered_map<uint64_t, int32_t> trans_;        // state << 8 | byte → state
  std::unordered_map<uint64_t, int32_t> trans_special_;  // (state, special token id) → state
  std::unordered_map<int32_t, SharedMasks::Mask> masks_;
  SharedMasks::Mask last_mask_;                        // what mask() returned last (kept alive for its caller)
  std::shared_ptr<SharedMasks> shared_;
  std::vector<int32_t> walk_;                          // [max depth + 1] states along the trie path
  std::vector<std::pair<int32_t, int32_t>> work_;      // closure worklist
  std::vector<uint64_t> seen_key_;                     // closure's visited (pos, stack) pairs: open addressing,
  std::vector<uint32_t> seen_stamp_;                   // an entry counts when its stamp is seen_now_
  uint32_t seen_now_ = 0;
  size_t seen_count_ = 0;
  bool first_visit(int32_t pos, int32_t parent);
  void check_state_size(size_t n) const;
  void spend(int64_t steps) {
    stats_.work += steps;
    if ((budget_ -= steps) < 0) out_of_work();
  }
  [[noreturn]] void out_of_work() const;
  Stats stats_;
  size_t max_stacks_ = 2'000'000, max_transitions_ = 4'000'000;
  int64_t burst_ = kWorkBurst, per_token_ = kWorkPerToken, budget_ = kWorkBurst;
  int64_t commits_ = 0;
  bool text_skip_ = true;
};

// Everything a request needs to build its matcher: the compiled grammar and the vocabulary.
struct GrammarSpec {
  std::shared_ptr<const CompiledGrammar> grammar;
  std::shared_ptr<const VocabTrie> vocab;
  std::shared_ptr<SharedMasks> masks;  // optional: the masks this grammar's other requests computed
};

}  // namespace kd::grammar
