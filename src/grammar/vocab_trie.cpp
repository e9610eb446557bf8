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
  // Text subtrees: valid[i] bit u says every string from node i down is text when the decoder is in
  // state u before node i's byte; children first (reverse preorder), each ANDed into its parent.
  std::vector<int32_t> parent(byte_.size()), last(size_t(max_depth_) + 1, -1);
  for (size_t i = 0; i < byte_.size(); ++i) {
    const int32_t d = depth_[i];
    parent[i] = d == 1 ? -1 : last[size_t(d - 1)];
    last[size_t(d)] = int32_t(i);
  }
  std::vector<uint8_t> children_ok(byte_.size(), 0xFF);  // AND of the children's valid masks
  text_.resize(byte_.size());
  for (size_t i = byte_.size(); i-- > 0;) {
    uint8_t valid = 0;
    for (int8_t u = 0; u < 8; ++u) {
      const int8_t next = utf8_step(u, byte_[i]);
      if (next >= 0 && ((children_ok[i] >> next) & 1)) valid |= uint8_t(1u << u);
    }
    text_[i] = valid & 1;
    if (parent[i] >= 0) children_ok[size_t(parent[i])] &= valid;
  }
}

int8_t VocabTrie::utf8_step(int8_t u, uint8_t b) {
  const bool cont = b >= 0x80 && b <= 0xBF;
  switch (u) {
    case 0:  // a boundary: a plain byte, or the lead byte of a 2-, 3- or 4-byte character
      if (b < 0x80) return plain_byte(b) ? 0 : -1;
      if (b >= 0xC2 && b <= 0xDF) return 1;
      if (b == 0xE0) return 3;                  // then A0–BF (no overlong forms)
      if (b == 0xED) return 4;                  // then 80–9F (no surrogates)
      if (b >= 0xE1 && b <= 0xEF) return 2;
      if (b == 0xF0) return 6;                  // then 90–BF
      if (b >= 0xF1 && b <= 0xF3) return 5;
      if (b == 0xF4) return 7;                  // then 80–8F (≤ U+10FFFF)
      return -1;
    case 1: return cont ? 0 : -1;               // one continuation byte left
    case 2: return cont ? 1 : -1;               // two left
    case 3: return b >= 0xA0 && b <= 0xBF ? 1 : -1;
    case 4: return b >= 0x80 && b <= 0x9F ? 1 : -1;
    case 5: return cont ? 2 : -1;               // three left
    case 6: return b >= 0x90 && b <= 0xBF ? 2 : -1;
    case 7: return b >= 0x80 && b <= 0x8F ? 2 : -1;
    default: return -1;
  }
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
