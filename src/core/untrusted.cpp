#include "core/untrusted.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace kd {

void check_json_depth(std::string_view text, const std::string& label, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth > max_depth) fail(label, ": JSON nests deeper than ", max_depth, " levels (at byte ", i, ")");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

namespace {

template <class J>
J parse_bounded(std::string_view text, const std::string& label, int max_depth) {
  check_json_depth(text, label, max_depth);
  try {
    return J::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error; out_of_range for 1e999
    // nlohmann quotes the token it stopped at ("last read: '…'"), which is the input's own bytes
    // (a whole string token, invalid UTF-8 and all): escaped and cut.
    fail(label, ": not valid JSON: ", escaped_excerpt(e.what(), 200));
  }
}

// Compact JSON of `v` into `out` until `budget` characters are spent.
template <class J>
void excerpt_into(const J& v, std::string& out, size_t budget) {
  if (out.size() >= budget) return;
  if (v.is_array() || v.is_object()) {
    const bool obj = v.is_object();
    out += obj ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() < budget; ++it) {
      if (!first) out += ',';
      first = false;
      if (obj) out += J(it.key()).dump(-1, ' ', false, J::error_handler_t::replace) + ":";
      excerpt_into(*it, out, budget);
    }
    out += obj ? '}' : ']';
    return;
  }
  out += v.dump(-1, ' ', false, J::error_handler_t::replace);
}

template <class J>
std::string excerpt_of(const J& v, size_t max_chars) {
  std::string out;
  excerpt_into(v, out, max_chars);
  if (out.size() > max_chars) {
    out.resize(max_chars);
    // Do not cut a UTF-8 sequence in two.
    while (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xC0) == 0x80) out.pop_back();
    if (!out.empty() && static_cast<unsigned char>(out.back()) >= 0xC0) out.pop_back();
    out += "…";
  }
  return out;
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& label, int max_depth) {
  return parse_bounded<nlohmann::json>(text, label, max_depth);
}

nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& label, int max_depth) {
  return parse_bounded<nlohmann::ordered_json>(text, label, max_depth);
}

std::string json_excerpt(const nlohmann::json& v, size_t max_chars) { return excerpt_of(v, max_chars); }
std::string json_excerpt(const nlohmann::ordered_json& v, size_t max_chars) { return excerpt_of(v, max_chars); }

std::string escaped_excerpt(std::string_view bytes, size_t max_chars) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (out.size() >= max_chars) {
      out += "…";
      break;
    }
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c == '\\') out += "\\\\";
    else if (c >= 0x20 && c < 0x7f) out += char(c);
    else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

std::string printable_message(std::string_view text, size_t max_bytes) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  auto escape = [&](unsigned char c) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  };
  for (size_t i = 0; i < text.size();) {
    if (out.size() >= max_bytes) {
      out += "…";
      break;
    }
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) escape(c);
      else out += char(c);
      ++i;
      continue;
    }
    // The length of a well-formed UTF-8 sequence starting here (no overlongs, no surrogates, ≤ U+10FFFF), or 0.
    size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (n && i + n <= text.size()) {
      const auto b1 = static_cast<unsigned char>(text[i + 1]);
      const unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
      const unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
      bool ok = b1 >= lo && b1 <= hi;
      for (size_t k = 2; k < n && ok; ++k) ok = (static_cast<unsigned char>(text[i + k]) & 0xC0) == 0x80;
      if (ok && c == 0xC2 && b1 < 0xA0) ok = false;  // U+0080..U+009F: C1 controls (0x9B is a terminal's CSI)
      if (ok) {
        out.append(text.data() + i, n);
        i += n;
        continue;
      }
    }
    escape(c);
    ++i;
  }
  return out;
}

nlohmann::json read_json_file(const std::string& path, size_t max_bytes) {
  return parse_json(read_text_file(path, max_bytes), path);
}

std::string read_text_file(const std::string& path, size_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail(path, ": cannot open: ", std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    fail(path, ": not a regular file (", S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket",
         "); point it at the file itself");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path, ": cannot open: ", std::strerror(errno));
  std::string out;
  try {
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) fail(path, ": not a regular file");
    if (size_t(st.st_size) > max_bytes)
      fail(path, ": ", st.st_size, " bytes, more than the ", max_bytes, " this file may have (is it the right file?)");
    out.resize(size_t(st.st_size));
    size_t got = 0;
    while (got < out.size()) {
      const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(path, ": read failed: ", std::strerror(errno));
      if (n == 0) break;  // shrank while we read: take what is there
      got += size_t(n);
    }
    out.resize(got);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

}  // namespace kd
