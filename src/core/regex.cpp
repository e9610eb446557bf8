#define PCRE2_CODE_UNIT_WIDTH 8
#include "core/regex.h"

#include <pcre2.h>

#include <algorithm>
#include <cstdint>

#include "core/error.h"

namespace kd {

struct Regex::Impl {
  pcre2_code* code = nullptr;
  pcre2_match_context* ctx = nullptr;
  ~Impl() {
    pcre2_match_context_free(ctx);
    pcre2_code_free(code);
  }
};

Regex::Regex(const std::string& pattern) : Regex(pattern, Options{}) {}

Regex::Regex(const std::string& pattern, Options opts) : pattern_(pattern) {
  auto impl = std::make_shared<Impl>();
  int err = 0;
  PCRE2_SIZE off = 0;
  const uint32_t flags = PCRE2_UTF | (opts.ucp ? PCRE2_UCP : 0u);
  impl->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), flags, &err, &off, nullptr);
  if (!impl->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail("regex '", pattern, "': ", reinterpret_cast<const char*>(msg), " at offset ", off);
  }
  // JIT is an optimisation only: where the platform lacks it, the interpreter gives the same matches.
  if (opts.jit) (void)pcre2_jit_compile(impl->code, PCRE2_JIT_COMPLETE);
  impl->ctx = pcre2_match_context_create(nullptr);
  pcre2_set_match_limit(impl->ctx, 1000000);
  pcre2_set_depth_limit(impl->ctx, 10000);
  impl_ = std::move(impl);
}

bool Regex::match_prefix(std::string_view s) const {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, PCRE2_ANCHORED, md, impl_->ctx);
  pcre2_match_data_free(md);
  if (rc >= 0) return true;
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof msg);
  fail("regex '", pattern_, "' on '", s, "': ", reinterpret_cast<const char*>(msg));
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  // The work limit grows with the subject: a tokenizer pattern such as `\s*[\r\n]+|\s+(?!\S)` spends
  // linear steps per match on a long whitespace run, which is legitimate; nested quantifiers still stop.
  pcre2_match_context* ctx = pcre2_match_context_copy(impl_->ctx);
  const uint64_t limit = std::max<uint64_t>(1000000, 64 * uint64_t(s.size()));
  pcre2_set_match_limit(ctx, uint32_t(std::min<uint64_t>(limit, 0xFFFFFFFFu)));
  pcre2_set_depth_limit(ctx, uint32_t(std::min<uint64_t>(std::max<uint64_t>(10000, s.size() + 16), 0xFFFFFFFFu)));
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t pos = 0;
  uint32_t check = 0;  // validate UTF-8 on the first call only: re-checking per match is quadratic
  while (pos <= s.size()) {
    int rc = pcre2_match(impl_->code, subject, s.size(), pos, check, md, ctx);
    check = PCRE2_NO_UTF_CHECK;
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(md);
      pcre2_match_context_free(ctx);
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail("regex '", pattern_, "' at byte ", pos, ": ", reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      pos = e;
    } else {  // empty match: step over one UTF-8 character
      pos = b + 1;
      while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
    }
  }
  pcre2_match_data_free(md);
  pcre2_match_context_free(ctx);
  return out;
}

}  // namespace kd
