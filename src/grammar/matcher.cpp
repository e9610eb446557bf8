#include "grammar/matcher.h"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "core/error.h"

namespace kd::grammar {

namespace {

constexpr uint8_t kBytes = 0, kRule = 1, kEnd = 2, kToken = 3;
// Masks kept per matcher (each vocab/8 bytes: 20 KB for Kimi). The memo of stacks and transitions
// is dropped (keeping the current state) past set_memo_limits' sizes, so a long generation through
// a grammar with many contexts cannot grow it without bound.
constexpr size_t kMaxMasks = 256;

// Why a grammar keeps many parses alive and what to do, for the two errors that refuse one.
constexpr const char* kAmbiguityAdvice =
    "stacked or nested repetitions such as (x+)+, (x*)* or x* x* … x* through named rules keep every way of splitting "
    "the text); write it so that each text has one parse";

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

// The visited set's slot hash: every bit of the key reaches the low bits (a multiply alone left the
// position, in the high half, out of them: the items of one return stack — a chain of 150,000 tail
// calls — fell into a few slots, and the probe went quadratic).
uint64_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xFF51AFD7ED558CCDull;
  k ^= k >> 33;
  k *= 0xC4CEB9FE1A85EC53ull;
  return k ^ (k >> 33);
}

// The distinct stacks in v (sorted and deduplicated in place; intern_state does the same).
size_t dedup_size(std::vector<int32_t>& v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v.size();
}

}  // namespace

CompiledGrammar::CompiledGrammar(const Grammar& g) : sets(g.sets), names(g.names), root(g.root) {
  alt_starts.resize(g.rules.size());
  for (size_t r = 0; r < g.rules.size(); ++r)
    for (const Sequence& s : g.rules[r]) {
      alt_starts[r].push_back(int32_t(elems.size()));
      for (const Element& e : s)
        elems.push_back({e.kind == Element::bytes ? kBytes : e.kind == Element::token ? kToken : kRule, e.index});
      elems.push_back({kEnd, int32_t(r)});
    }
}

SharedMasks::SharedMasks(std::shared_ptr<const CompiledGrammar> g, std::shared_ptr<const VocabTrie> vocab, size_t max_bytes)
    : g_(std::move(g)), vocab_(std::move(vocab)), max_bytes_(max_bytes) {
  if (!g_ || !vocab_) fail("shared grammar masks: no grammar or vocabulary");
}

SharedMasks::Mask SharedMasks::find(const std::string& key) const {
  std::shared_lock lock(mu_);
  auto it = masks_.find(key);
  if (it == masks_.end()) {
    ++misses_;
    return nullptr;
  }
  ++hits_;
  return it->second;
}

void SharedMasks::insert(const std::string& key, Mask m) {
  const size_t bytes = key.size() + m->size() * sizeof(uint32_t);
  std::unique_lock lock(mu_);
  if (bytes_ + bytes > max_bytes_) return;
  if (masks_.emplace(key, std::move(m)).second) bytes_ += bytes;
}

SharedMasks::Stats SharedMasks::stats() const {
  std::shared_lock lock(mu_);
  return {hits_.load(), misses_.load(), int64_t(masks_.size()), int64_t(bytes_)};
}

Matcher::Matcher(std::shared_ptr<const CompiledGrammar> g, std::shared_ptr<const VocabTrie> vocab, std::vector<int32_t> stop_ids,
                 std::shared_ptr<SharedMasks> shared)
    : g_(std::move(g)), vocab_(std::move(vocab)), stop_ids_(std::move(stop_ids)), shared_(std::move(shared)) {
  if (!g_ || !vocab_) fail("grammar matcher: no grammar or vocabulary");
  if (shared_ && (shared_->grammar() != g_.get() || shared_->vocab() != vocab_.get()))
    fail("grammar matcher: the shared masks are for another grammar or vocabulary");
  for (int32_t id : stop_ids_)
    if (id < 0 || id >= vocab_->vocab_size()) fail("grammar matcher: stop id ", id, " is outside the vocabulary");
  for (const CompiledGrammar::Elem& e : g_->elems)
    if (e.kind == kToken && (e.index < 0 || e.index >= vocab_->vocab_size() || !vocab_->is_special(e.index)))
      fail("grammar: token <[", e.index, "]> is not a special token of this vocabulary (write text tokens as text)");
  state_begin_.push_back(0);
  std::vector<int32_t> none;
  intern_state(none);  // kDead
  std::vector<int32_t> init;
  begin_closures();
  for (int32_t a : g_->alt_starts[size_t(g_->root)]) closure(a, -1, init);
  cur_ = intern_state(init);
  walk_.resize(size_t(vocab_->max_depth()) + 1);
}

int32_t Matcher::intern_stack(int32_t pos, int32_t parent) {
  auto [it, added] = node_index_.try_emplace(pair_key(pos, parent), int32_t(node_pos_.size()));
  if (added) {
    node_pos_.push_back(pos);
    node_parent_.push_back(parent);
  }
  return it->second;
}

// Every stack reachable from "match elems[pos], then return to `parent`" whose top is a byte set
// (or the empty stack −1: the grammar may end), appended to out.
// The closures of one step (one advance: every stack that took the byte) share one visited set: an
// item reached from an earlier stack already put its stacks in `out`. Per closure, the pile-up
// x* x* x* … x* (n copies alive) cost n² items a byte; shared, n.
void Matcher::begin_closures() {
  if (++seen_now_ == 0) {  // the stamps wrapped: clear them once in 2^32 steps
    std::fill(seen_stamp_.begin(), seen_stamp_.end(), 0u);
    seen_now_ = 1;
  }
  seen_count_ = 0;
}

void Matcher::closure(int32_t pos, int32_t parent, std::vector<int32_t>& out) {
  work_.clear();
  work_.push_back({pos, parent});
  while (!work_.empty()) {
    auto [p, par] = work_.back();
    work_.pop_back();
    ++stats_.closure_pops;
    for (;;) {
      if (!first_visit(p, par)) break;  // reached before by another path: its stacks are in out
      const CompiledGrammar::Elem& e = g_->elems[size_t(p)];
      if (e.kind == kBytes || e.kind == kToken) {
        out.push_back(intern_stack(p, par));
        break;
      }
      if (e.kind == kEnd) {
        if (par < 0) {
          out.push_back(-1);
          break;
        }
        p = node_pos_[size_t(par)];
        const int32_t up = node_parent_[size_t(par)];
        if (g_->elems[size_t(p)].kind == kBytes || g_->elems[size_t(p)].kind == kToken) {
          out.push_back(par);
          break;
        }
        par = up;
        continue;
      }
      // A call: return to p + 1 unless that ends the alternative (a tail call pushes nothing).
      const int32_t ret = p + 1;
      const int32_t np = g_->elems[size_t(ret)].kind == kEnd ? par : intern_stack(ret, par);
      // Tail calls from many sites share np: expand the rule once per (rule, return stack) — the
      // key's position −2 − rule is no element's — and pay for the alternatives it pushes, so
      // M call sites of an N-alternative rule cost M + N steps, not M · N unpaid ones.
      if (!first_visit(-2 - e.index, np)) break;
      const std::vector<int32_t>& alts = g_->alt_starts[size_t(e.index)];
      spend(int64_t(alts.size()));
      for (int32_t a : alts) work_.push_back({a, np});
      break;
    }
  }
}

bool Matcher::first_visit(int32_t pos, int32_t parent) {
  if (2 * (seen_count_ + 1) > seen_key_.size()) {  // grow (and rehash this closure's entries) at half full
    std::vector<uint64_t> keys;
    for (size_t i = 0; i < seen_key_.size(); ++i)
      if (seen_stamp_[i] == seen_now_) keys.push_back(seen_key_[i]);
    const size_t cap = std::max<size_t>(64, seen_key_.size() * 2);
    seen_key_.assign(cap, 0);
    seen_stamp_.assign(cap, 0);
    const uint32_t now = seen_now_;
    for (uint64_t k : keys) {
      size_t i = size_t(mix(k)) & (cap - 1);
      while (seen_stamp_[i] == now) i = (i + 1) & (cap - 1);
      seen_key_[i] = k, seen_stamp_[i] = now;
    }
  }
  if (seen_count_ > kMaxClosureItems)
    throw LimitError(cat("grammar: one step of the matcher visits more than ", kMaxClosureItems,
                         " (element, stack) pairs — the grammar is too large to match at this point (a chain of that many "
                         "rules) or too ambiguous (", kAmbiguityAdvice));
  const uint64_t k = pair_key(pos, parent);
  const size_t mask = seen_key_.size() - 1;
  for (size_t i = size_t(mix(k)) & mask;; i = (i + 1) & mask) {
    if (seen_stamp_[i] != seen_now_) {
      seen_key_[i] = k, seen_stamp_[i] = seen_now_;
      ++seen_count_;
      ++stats_.closure_items;
      spend(1);
      return true;
    }
    if (seen_key_[i] == k) return false;
  }
}

void Matcher::out_of_work() const {
  throw LimitError(cat("grammar: matching this grammar took more than its budget of parser steps (", burst_, ", plus ", per_token_,
       " for each token; ", commits_, " tokens so far) — the grammar keeps too many parses alive (", kAmbiguityAdvice));
}

void Matcher::check_state_size(size_t n) const {
  if (n > kMaxStacksPerState)
    throw LimitError(cat("grammar: more than ", kMaxStacksPerState,
                         " parses of the text so far are alive at once — the grammar is too ambiguous to match (", kAmbiguityAdvice));
}

Matcher::State Matcher::intern_state(std::vector<int32_t>& stacks) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  check_state_size(stacks.size());
  std::string key(reinterpret_cast<const char*>(stacks.data()), stacks.size() * sizeof(int32_t));
  auto [it, added] = state_index_.try_emplace(std::move(key), int32_t(state_begin_.size() - 1));
  if (added) {
    state_members_.insert(state_members_.end(), stacks.begin(), stacks.end());
    state_begin_.push_back(int32_t(state_members_.size()));
  }
  return it->second;
}

Matcher::State Matcher::advance(State s, uint8_t byte) {
  if (s == kDead) return kDead;
  const uint64_t key = (uint64_t(uint32_t(s)) << 8) | byte;
  if (auto it = trans_.find(key); it != trans_.end()) return it->second;
  std::vector<int32_t> next;
  // The scan of the state's stacks (a few ns each, against ~60-90 ns a closure item): 1 step per 16.
  spend((int64_t(state_begin_[size_t(s) + 1] - state_begin_[size_t(s)]) + 15) / 16);
  begin_closures();
  for (int32_t k = state_begin_[size_t(s)]; k < state_begin_[size_t(s) + 1]; ++k) {
    const int32_t st = state_members_[size_t(k)];
    if (st < 0) continue;
    const int32_t p = node_pos_[size_t(st)];
    const CompiledGrammar::Elem& e = g_->elems[size_t(p)];
    if (e.kind == kBytes && g_->sets[size_t(e.index)].has(byte)) closure(p + 1, node_parent_[size_t(st)], next);
    if (next.size() > 4 * kMaxStacksPerState) check_state_size(dedup_size(next));
  }
  const State t = intern_state(next);
  trans_.emplace(key, t);
  return t;
}

Matcher::State Matcher::advance_special(State s, int32_t id) {
  if (s == kDead) return kDead;
  const uint64_t key = pair_key(s, id);
  if (auto it = trans_special_.find(key); it != trans_special_.end()) return it->second;
  std::vector<int32_t> next;
  spend((int64_t(state_begin_[size_t(s) + 1] - state_begin_[size_t(s)]) + 15) / 16);
  begin_closures();
  for (int32_t k = state_begin_[size_t(s)]; k < state_begin_[size_t(s) + 1]; ++k) {
    const int32_t st = state_members_[size_t(k)];
    if (st < 0) continue;
    const int32_t p = node_pos_[size_t(st)];
    const CompiledGrammar::Elem& e = g_->elems[size_t(p)];
    if (e.kind == kToken && e.index == id) closure(p + 1, node_parent_[size_t(st)], next);
    if (next.size() > 4 * kMaxStacksPerState) check_state_size(dedup_size(next));
  }
  const State t = intern_state(next);
  trans_special_.emplace(key, t);
  return t;
}

Matcher::State Matcher::advance_bytes(State s, std::string_view bytes) {
  for (unsigned char c : bytes) {
    s = advance(s, c);
    if (s == kDead) break;
  }
  return s;
}

Matcher::State Matcher::advance_token(State s, int32_t id) {
  if (id < 0 || id >= vocab_->vocab_size()) return kDead;
  if (vocab_->is_special(id)) return advance_special(s, id);
  const std::string& b = vocab_->token_bytes(id);
  return b.empty() ? kDead : advance_bytes(s, b);
}

bool Matcher::accepting(State s) const {
  return state_begin_[size_t(s)] < state_begin_[size_t(s) + 1] && state_members_[size_t(state_begin_[size_t(s)])] < 0;
}

bool Matcher::can_continue(State s) const {
  const int32_t b = state_begin_[size_t(s)], e = state_begin_[size_t(s) + 1];
  return e > b && state_members_[size_t(e - 1)] >= 0;
}

std::string Matcher::shared_key(State s) {
  // Each stack as its elements top first, ended by −1 (the empty, accepting stack: just the −1).
  // The stop ids matter only where the grammar may end (they are allowed there): elsewhere requests
  // with other stop ids (chat and completions, ignore_eos) share the mask.
  std::vector<int32_t> flat = accepting(s) ? stop_ids_ : std::vector<int32_t>{};
  std::vector<std::vector<int32_t>> lists;
  size_t ints = flat.size() + 1;
  for (int32_t k = state_begin_[size_t(s)]; k < state_begin_[size_t(s) + 1]; ++k) {
    std::vector<int32_t> list;
    for (int32_t st = state_members_[size_t(k)]; st >= 0; st = node_parent_[size_t(st)]) {
      list.push_back(node_pos_[size_t(st)]);
      if (ints + list.size() > kMaxSharedKeyInts) return {};
    }
    list.push_back(-1);
    ints += list.size();
    if (ints > kMaxSharedKeyInts) return {};
    lists.push_back(std::move(list));
  }
  spend(int64_t(ints + 15) / 16);
  std::sort(lists.begin(), lists.end());
  std::sort(flat.begin(), flat.end());
  flat.push_back(-2);
  for (const auto& l : lists) flat.insert(flat.end(), l.begin(), l.end());
  return std::string(reinterpret_cast<const char*>(flat.data()), flat.size() * sizeof(int32_t));
}

const std::vector<uint32_t>& Matcher::mask(State s) {
  const size_t words = (size_t(vocab_->vocab_size()) + 31) / 32;
  if (auto it = masks_.find(s); it != masks_.end()) {
    ++stats_.masks_cached;
    return *(last_mask_ = it->second);
  }
  if (masks_.size() >= kMaxMasks) masks_.clear();
  // The mask, kept for this matcher (and returned: valid until the next call).
  auto keep = [&](SharedMasks::Mask m) -> const std::vector<uint32_t>& {
    stats_.states = int64_t(state_begin_.size()) - 1;
    stats_.stacks = int64_t(node_pos_.size());
    return *(last_mask_ = masks_[s] = std::move(m));
  };
  const std::string key = shared_ && s != kDead ? shared_key(s) : std::string();
  if (!key.empty())
    if (SharedMasks::Mask m = shared_->find(key)) {
      ++stats_.masks_shared;
      return keep(std::move(m));
    }
  ++stats_.masks_computed;
  std::vector<uint32_t> out(words, 0);
  const VocabTrie& v = *vocab_;
  walk_[0] = s;
  const int32_t n = s == kDead ? 0 : v.n_nodes();
  int64_t visited = 0;
  for (int32_t i = 0; i < n;) {
    ++visited;
    const int32_t d = v.depth(i);
    const State w = walk_[size_t(d - 1)];
    if ((v.plain_subtree(i) && loops_on_plain(w)) || (text_skip_ && v.text_subtree(i) && loops_on_text(w))) {
      // Inside a JSON string (or any state that ignores plain bytes, or all text): every string of
      // the subtree is text the state takes (its tokens end at it or inside a character on the way
      // back to it), so all are allowed without walking them.
      for (const int32_t* id = v.tokens_begin(i); id != v.subtree_tokens_end(i); ++id) out[size_t(*id) >> 5] |= 1u << (*id & 31);
      i = v.subtree_end(i);
      continue;
    }
    const State t = advance(walk_[size_t(d - 1)], v.byte(i));
    if (t == kDead) {
      i = v.subtree_end(i);
      continue;
    }
    walk_[size_t(d)] = t;
    for (const int32_t* id = v.tokens_begin(i); id != v.tokens_end(i); ++id) out[size_t(*id) >> 5] |= 1u << (*id & 31);
    ++i;
  }
  stats_.trie_nodes_visited += visited;
  // Special tokens the grammar names, where a stack expects one.
  for (int32_t k = state_begin_[size_t(s)]; k < state_begin_[size_t(s) + 1]; ++k) {
    const int32_t st = state_members_[size_t(k)];
    if (st < 0) continue;
    const CompiledGrammar::Elem& e = g_->elems[size_t(node_pos_[size_t(st)])];
    if (e.kind == kToken && e.index >= 0 && e.index < v.vocab_size() && v.is_special(e.index))
      out[size_t(e.index) >> 5] |= 1u << (e.index & 31);
  }
  if (accepting(s))
    for (int32_t id : stop_ids_) out[size_t(id) >> 5] |= 1u << (id & 31);
  auto m = std::make_shared<const std::vector<uint32_t>>(std::move(out));
  if (!key.empty()) shared_->insert(key, m);
  return keep(std::move(m));
}

bool Matcher::loops_on_plain(State s) {
  if (size_t(s) >= loops_.size()) loops_.resize(size_t(s) + 1, -1);
  if (loops_[size_t(s)] < 0) {
    bool all = s != kDead;
    for (int b = 0x20; b < 0x7F && all; ++b)
      if (VocabTrie::plain_byte(uint8_t(b))) all = advance(s, uint8_t(b)) == s;
    if (size_t(s) >= loops_.size()) loops_.resize(size_t(s) + 1, -1);  // advance may have made states
    loops_[size_t(s)] = all ? 1 : 0;
  }
  return loops_[size_t(s)] == 1;
}

bool Matcher::loops_on_text(State s) {
  if (size_t(s) >= text_loops_.size()) text_loops_.resize(size_t(s) + 1, -1);
  if (text_loops_[size_t(s)] < 0) {
    // Every (state, decoder state) reachable from s through the bytes of characters above U+007F:
    // a character's last byte must lead back to s, no byte on the way may die.
    bool all = loops_on_plain(s);
    std::vector<std::pair<State, int8_t>> pending, seen;
    if (all) pending.push_back({s, 0});
    while (all && !pending.empty()) {
      const auto [t, u] = pending.back();
      pending.pop_back();
      if (std::find(seen.begin(), seen.end(), std::make_pair(t, u)) != seen.end()) continue;
      seen.push_back({t, u});
      if (seen.size() > 64) {  // a grammar that spells characters out one by one: walk them instead
        all = false;
        break;
      }
      for (int b = 0x80; b < 0x100 && all; ++b) {
        const int8_t next = VocabTrie::utf8_step(u, uint8_t(b));
        if (next < 0) continue;
        const State t2 = advance(t, uint8_t(b));
        if (next == 0)
          all = t2 == s;
        else if (t2 == kDead)
          all = false;
        else
          pending.push_back({t2, next});
      }
    }
    if (size_t(s) >= text_loops_.size()) text_loops_.resize(size_t(s) + 1, -1);  // advance may have made states
    text_loops_[size_t(s)] = all ? 1 : 0;
  }
  return text_loops_[size_t(s)] == 1;
}

bool Matcher::allowed(State s, int32_t id) {
  if (id < 0 || id >= vocab_->vocab_size()) return false;
  if (std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end() && accepting(s)) return true;
  return advance_token(s, id) != kDead;
}

Matcher::State Matcher::after(State s, int32_t id) {
  const State t = advance_token(s, id);
  if (t != kDead) return t;
  // A stop id where the grammar may end (and the grammar does not name it): generation ends here.
  if (std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end() && accepting(s)) return s;
  return kDead;
}

void Matcher::apply(float* logits, int64_t n) {
  const std::vector<uint32_t>& m = mask(cur_);
  n = std::min<int64_t>(n, vocab_->vocab_size());
  for (int64_t i = 0; i < n; ++i)
    if (!((m[size_t(i) >> 5] >> (i & 31)) & 1)) logits[i] = -INFINITY;
}

bool Matcher::commit(int32_t id) {
  const State t = after(cur_, id);
  if (t == kDead) return false;
  cur_ = t;
  ++commits_;
  budget_ = std::min(burst_, budget_ + per_token_);
  // (Every table the memo grows counts: states of many stacks over few nodes grow the members alone.)
  if (node_pos_.size() > max_stacks_ || state_members_.size() > 4 * max_stacks_ ||
      trans_.size() + trans_special_.size() > max_transitions_)
    reset_tables();
  return true;
}

void Matcher::reset_tables() {
  // The current state's stacks as explicit lists (top first), re-interned into empty tables.
  std::vector<std::vector<int32_t>> stacks;
  bool acc = false;
  for (int32_t k = state_begin_[size_t(cur_)]; k < state_begin_[size_t(cur_) + 1]; ++k) {
    int32_t st = state_members_[size_t(k)];
    if (st < 0) {
      acc = true;
      continue;
    }
    std::vector<int32_t> list;
    for (; st >= 0; st = node_parent_[size_t(st)]) list.push_back(node_pos_[size_t(st)]);
    spend(int64_t(list.size()));
    stacks.push_back(std::move(list));
  }
  node_pos_.clear();
  node_parent_.clear();
  node_index_.clear();
  state_begin_.assign(1, 0);
  state_members_.clear();
  state_index_.clear();
  trans_.clear();
  trans_special_.clear();
  masks_.clear();
  loops_.clear();
  text_loops_.clear();
  std::vector<int32_t> none;
  intern_state(none);
  std::vector<int32_t> ids;
  if (acc) ids.push_back(-1);
  for (const auto& list : stacks) {
    int32_t parent = -1;
    for (auto p = list.rbegin(); p != list.rend(); ++p) parent = intern_stack(*p, parent);
    ids.push_back(parent);
  }
  cur_ = intern_state(ids);
  ++stats_.resets;
}

}  // namespace kd::grammar
