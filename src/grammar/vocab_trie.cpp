#include "grammar/vocab_trie.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace kd::grammar {

VocabTrie::VocabTrie(const std::vector<std::string>& token_bytes, const std::vector<bool>& special)
    : vocab_size_(int32_t(token_bytes.size())), bytes_(token_bytes), special_(special) {
  if (special_.size() != bytes_.size()) fail("vocab trie: ", bytes_.size(), " tokens but ", special_.size(), " special flags");
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < vocab_size_; ++i)
    if (!special_[size_t(i)] && !bytes_[size_t(i)].empty()) ids.push_back(i);
  // Sorted byte strings list the trie's nodes in preorder: each token adds the nodes of its bytes
  // past the longest common prefix with the previous one.
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return bytes_[size_t(a)] < bytes_[size_t(b)] || (bytes_[size_t(a)] == bytes_[size_t(b)] && a < b);
  });
  std::vector<int32_t> path;  // node of each depth on the current path
  std::vector<int32_t> node_of(ids.size());
  const std::string* prev = nullptr;
  for (size_t k = 0; k < ids.size(); ++k) {
    const std::string& s = bytes_[size_t(ids[k])];
    size_t lcp = 0;
    if (prev) {
      const size_t m = std::min(prev->size(), s.size());
      while (lcp < m && (*prev)[lcp] == s[lcp]) ++lcp;
    }
    while (path.size() > lcp) {
      end_[size_t(path.back())] = int32_t(byte_.size());
      path.pop_back();
    }
    for (size_t d = lcp; d < s.size(); ++d) {
      path.push_back(int32_t(byte_.size()));
      byte_.push_back(uint8_t(s[d]));
      depth_.push_back(int32_t(d + 1));
      end_.push_back(0);
    }
    node_of[k] = path.back();
    max_depth_ = std::max(max_depth_, int32_t(s.size()));
    prev = &s;
  }
  for (int32_t n : path) end_[size_t(n)] = int32_t(byte_.size());
  tok_begin_.assign(byte_.size() + 1, 0);
  for (int32_t n : node_of) ++tok_begin_[size_t(n) + 1];
  std::partial_sum(tok_begin_.begin(), tok_begin_.end(), tok_begin_.begin());
  toks_.resize(ids.size());
  std::vector<int32_t> fill(tok_begin_.begin(), tok_begin_.end() - 1);
  for (size_t k = 0; k < ids.size(); ++k) toks_[size_t(fill[size_t(node_of[k])]++)] = ids[k];
  // A subtree is plain when no node in [i, end) has a non-plain byte (prefix counts over preorder).
  std::vector<int32_t> bad(byte_.size() + 1, 0);
  for (size_t i = 0; i < byte_.size(); ++i) bad[i + 1] = bad[i] + (plain_byte(byte_[i]) ? 0 : 1);
  plain_.resize(byte_.size());
  for (size_t i = 0; i < byte_.size(); ++i) plain_[i] = bad[size_t(end_[i])] == bad[i];
}

VocabTrie VocabTrie::from_tokenizer(const Tokenizer& tok) {
  const int32_t n = tok.vocab_size();
  std::vector<std::string> bytes(static_cast<size_t>(n));
  std::vector<bool> special(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    bytes[size_t(i)] = tok.token_bytes(i);
    special[size_t(i)] = tok.is_special(i);
  }
  return VocabTrie(bytes, special);
}

}  // namespace kd::grammar
