// HuggingFace `tokenizers` tokenizer.json, the byte-level BPE subset DeepSeek-V3/R1 ship
// (SPEC-MODEL.md §4, issue 3): model BPE (vocab + merges, either "a b" or ["a", "b"] merges),
// a pre_tokenizer Sequence of Split(Regex, Isolated) + ByteLevel(use_regex=false), no normalizer,
// ByteLevel decoder, added_tokens. Anything else is refused with a kd::Error naming its JSON path,
// so a tokenizer we would get subtly wrong never loads.
#pragma once
#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"

namespace kd {

// `path`: a tokenizer.json file. Encoding matches tokenizers' `encode(text, add_special_tokens=False)`:
// added tokens that are not special are always matched in the text (as tokenizers does); special ones
// only with parse_special (otherwise they are encoded as text, tokenizers' encode_special_tokens=True).
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path);

}  // namespace kd
