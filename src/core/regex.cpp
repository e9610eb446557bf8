#define PCRE2_CODE_UNIT_WIDTH 8
#include "core/regex.h"

#include <pcre2.h>

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

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  auto impl = std::make_shared<Impl>();
  int err = 0;
  PCRE2_SIZE off = 0;
  impl->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF, &err, &off, nullptr);
  if (!impl->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail("regex '", pattern, "': ", reinterpret_cast<const char*>(msg), " at offset ", off);
  }
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

}  // namespace kd
