// The model's vocabulary as a byte trie in preorder — the context-independent half of a token mask.
//
// A mask walks the trie once (grammar/matcher.h): a node's bytes extend its parent's, so a byte
// prefix the grammar rejects prunes every token under it in one step (subtree_end), and tokens that
// share a prefix share its work. Built once per tokenizer and shared, read-only, by every request.
// Special tokens (chat markers, EOS) are not text: they are left out of the trie, and the matcher
// allows the stop ids it is given only where the grammar may end.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kd {
class Tokenizer;
}

namespace kd::grammar {

class VocabTrie {
 public:
  // token_bytes[id]; special[id] true for ids that are not text (left out). Empty tokens are left out.
  VocabTrie(const std::vector<std::string>& token_bytes, const std::vector<bool>& special);
  static VocabTrie from_tokenizer(const Tokenizer& tok);

  int32_t vocab_size() const { return vocab_size_; }
  int32_t n_nodes() const { return int32_t(byte_.size()); }
  int32_t max_depth() const { return max_depth_; }
  const std::string& token_bytes(int32_t id) const { return bytes_[size_t(id)]; }
  bool is_special(int32_t id) const { return special_[size_t(id)]; }

  // Node i (preorder; node 0 is the first child of the root, the empty prefix is implicit):
  uint8_t byte(int32_t i) const { return byte_[size_t(i)]; }            // the byte this node adds
  int32_t depth(int32_t i) const { return depth_[size_t(i)]; }          // 1 for a first byte
  int32_t subtree_end(int32_t i) const { return end_[size_t(i)]; }      // first node after i's subtree
  // Ids whose bytes end exactly at node i.
  const int32_t* tokens_begin(int32_t i) const { return toks_.data() + tok_begin_[size_t(i)]; }
  const int32_t* tokens_end(int32_t i) const { return toks_.data() + tok_begin_[size_t(i) + 1]; }
  // Every id in node i's subtree (i and below): one contiguous run.
  const int32_t* subtree_tokens_end(int32_t i) const { return toks_.data() + tok_begin_[size_t(end_[size_t(i)])]; }
  // True when node i's byte and every byte below it are "plain": printable ASCII but '"' and '\'.
  // A state that loops on every plain byte (inside a JSON string) allows the whole subtree at once.
  bool plain_subtree(int32_t i) const { return plain_[size_t(i)]; }
  static bool plain_byte(uint8_t b) { return b >= 0x20 && b < 0x7F && b != '"' && b != '\\'; }
  // True when every byte string from node i down to a token's end (node i's byte first) is *text*:
  // plain bytes and well-formed UTF-8 characters above U+007F (RFC 3629: no overlong forms, no
  // surrogates, ≤ U+10FFFF), the last one possibly cut short — what a JSON string holds unescaped,
  // Chinese included. A state that loops on every plain byte and every such character allows the
  // whole subtree at once (Matcher::loops_on_text). Plain subtrees are text subtrees.
  bool text_subtree(int32_t i) const { return text_[size_t(i)]; }
  // The UTF-8 decoder behind text_subtree: u = 0 at a character boundary, 1 … 7 inside a character
  // (what the next bytes may be); the state after byte b, or −1 where b cannot come next in text.
  static int8_t utf8_step(int8_t u, uint8_t b);

 private:
  int32_t vocab_size_ = 0, max_depth_ = 0;
  std::vector<std::string> bytes_;  // [vocab] token bytes (specials: their names, for messages)
  std::vector<bool> special_;       // [vocab]
  std::vector<uint8_t> byte_;       // [nodes]
  std::vector<int32_t> depth_;      // [nodes]
  std::vector<int32_t> end_;        // [nodes]
  std::vector<int32_t> tok_begin_;  // [nodes + 1] into toks_
  std::vector<int32_t> toks_;       // token ids grouped by node
  std::vector<bool> plain_;         // [nodes] plain_subtree
  std::vector<bool> text_;          // [nodes] text_subtree
};

}  // namespace kd::grammar
