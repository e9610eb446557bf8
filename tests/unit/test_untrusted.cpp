// core/untrusted: the limits every file and request parser leans on (issue 21). The depth bound is
// exact (64 levels parse, 65 do not) and ignores brackets inside strings; excerpts stay short and
// escaped whatever they are given; read_text_file refuses FIFOs, directories, devices and oversized
// files by name, at once, without reading them.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "core/untrusted.h"

namespace kd {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::string nested(int depth, char open = '[', char close = ']') {
  return std::string(size_t(depth), open) + std::string(size_t(depth), close);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(UntrustedJson, DepthBoundIsExact) {
  EXPECT_NO_THROW(check_json_depth(nested(kMaxJsonDepth), "x"));
  EXPECT_NO_THROW(parse_json(nested(kMaxJsonDepth), "x"));
  const std::string e = error_of([] { parse_json(nested(kMaxJsonDepth + 1), "cfg.json"); });
  EXPECT_TRUE(has(e, "cfg.json")) << e;
  EXPECT_TRUE(has(e, "deeper than 64 levels")) << e;
  EXPECT_TRUE(has(e, "at byte 64")) << e;  // the 65th '[' is byte 64
  // Objects count the same as arrays, and mixed nesting adds up.
  std::string obj;
  for (int i = 0; i < kMaxJsonDepth; ++i) obj += i % 2 ? "[" : "{\"k\":";
  EXPECT_THROW(check_json_depth(obj + "[", "x"), Error);
  EXPECT_NO_THROW(check_json_depth(obj, "x"));  // unbalanced but not deep: the parser's to refuse
  // Siblings do not add up: depth, not bracket count.
  std::string wide = "[";
  for (int i = 0; i < 1000; ++i) wide += nested(kMaxJsonDepth - 1) + ",";
  wide += "0]";
  EXPECT_NO_THROW(parse_json(wide, "x"));
  // A smaller bound is honoured.
  EXPECT_THROW(check_json_depth("[[[1]]]", "x", 2), Error);
  EXPECT_NO_THROW(check_json_depth("[[1]]", "x", 2));
}

TEST(UntrustedJson, HundredThousandLevelsRefusedQuickly) {
  const std::string deep = nested(100000);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(parse_json(deep, "x"), Error);
  EXPECT_THROW(parse_ordered_json(deep, "x"), Error);
  EXPECT_THROW(parse_json("{\"a\":" + nested(100000, '{', '}'), "x"), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

TEST(UntrustedJson, BracketsInStringsAndEscapesDoNotCount) {
  // 200 '[' inside a string: depth 1.
  EXPECT_NO_THROW(parse_json("[\"" + std::string(200, '[') + "\"]", "x"));
  // An escaped quote does not end the string: the brackets after it are still inside it.
  EXPECT_NO_THROW(parse_json("[\"a\\\"" + std::string(200, '{') + "\"]", "x"));
  // An escaped backslash does end it: \\" closes the string, so the brackets after count.
  EXPECT_THROW(check_json_depth("[\"a\\\\\"" + std::string(200, '[') , "x"), Error);
  // Closing brackets in strings do not lower the depth either.
  EXPECT_THROW(check_json_depth("[\"]]]]]]\"" + nested(kMaxJsonDepth), "x"), Error);
}

TEST(UntrustedJson, ParseErrorsAreKdErrorsNamingTheLabel) {
  const std::string e = error_of([] { parse_json("{\"a\": ", "tools"); });
  EXPECT_TRUE(has(e, "tools: not valid JSON")) << e;
  EXPECT_FALSE(error_of([] { parse_json("1e999", "n"); }).empty());  // beyond a double: not infinity
  EXPECT_FALSE(error_of([] { parse_ordered_json("[1,", "m"); }).empty());
  // The token nlohmann quotes is the input's own bytes: escaped, and the message stays short.
  std::string bad = "[\"" + std::string(100000, 'a') + "\x01\xff";
  const std::string m = error_of([&] { parse_json(bad, "x"); });
  EXPECT_FALSE(m.empty());
  EXPECT_LT(m.size(), 400u) << m.size();
  for (unsigned char c : m) EXPECT_TRUE(c >= 0x20 && c != 0x7f) << "raw control byte " << int(c) << " in " << m;
}

TEST(UntrustedExcerpt, JsonExcerptIsBoundedOnHugeAndDeepValues) {
  json big = json::array();
  for (int i = 0; i < 100000; ++i) big.push_back(i);
  const std::string e = json_excerpt(big);
  EXPECT_LE(e.size(), 60u + 3u);  // "…" is 3 bytes
  EXPECT_EQ(e.rfind("[0,1,2,", 0), 0u) << e;
  EXPECT_TRUE(has(e, "…"));
  // A deep value (built here, not parsed) is excerpted without descending all the way.
  json deep = 1;
  for (int i = 0; i < 2000; ++i) deep = json::array({std::move(deep)});
  EXPECT_LE(json_excerpt(deep, 30).size(), 33u);
  // A long string, and a string with control characters and invalid UTF-8.
  EXPECT_LE(json_excerpt(json(std::string(1 << 20, 'x'))).size(), 63u);
  const std::string ctl = json_excerpt(json(std::string("a\x01\nb\xff")));
  for (unsigned char c : ctl) EXPECT_GE(c, 0x20) << ctl;
  // Short values print whole.
  EXPECT_EQ(json_excerpt(json::parse("{\"a\":[1,2]}")), "{\"a\":[1,2]}");
  EXPECT_EQ(json_excerpt(nlohmann::ordered_json::parse("{\"b\":1,\"a\":2}")), "{\"b\":1,\"a\":2}");
}

TEST(UntrustedExcerpt, EscapedExcerptEscapesAndCuts) {
  EXPECT_EQ(escaped_excerpt("ab\n\t\r\\\x01\x7f\xff"), "ab\\n\\t\\r\\\\\\x01\\x7f\\xff");
  const std::string e = escaped_excerpt(std::string(1000, 'z'), 80);
  EXPECT_EQ(e, std::string(80, 'z') + "…");
  EXPECT_EQ(escaped_excerpt(""), "");
}

TEST(UntrustedExcerpt, PrintableMessageKeepsUtf8EscapesControls) {
  EXPECT_EQ(printable_message("τ ≠ 1 — ok"), "τ ≠ 1 — ok");
  EXPECT_EQ(printable_message("a\x1b[31mb"), "a\\x1b[31mb");
  EXPECT_EQ(printable_message("x\xc2\x9b" "y"), "x\\xc2\\x9by");  // U+009B, a C1 CSI
  EXPECT_EQ(printable_message("\xff\xfe"), "\\xff\\xfe");
  EXPECT_EQ(printable_message("\xe2\x82"), "\\xe2\\x82");  // a sequence cut short
  EXPECT_EQ(printable_message("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a surrogate
  EXPECT_LE(printable_message(std::string(100000, 'q'), 100).size(), 103u);
}

class UntrustedFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kdtree_untrusted_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const char* name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(UntrustedFile, ReadsARegularFile) {
  std::ofstream(path("a.json")) << "{\"x\": 1}";
  EXPECT_EQ(read_text_file(path("a.json"), 100), "{\"x\": 1}");
  EXPECT_EQ(read_json_file(path("a.json"))["x"], 1);
  std::ofstream(path("empty")).close();
  EXPECT_EQ(read_text_file(path("empty"), 0), "");
}

TEST_F(UntrustedFile, RefusesOversized) {
  std::ofstream(path("big")) << std::string(101, 'x');
  EXPECT_EQ(read_text_file(path("big"), 101).size(), 101u);
  const std::string e = error_of([&] { read_text_file(path("big"), 100); });
  EXPECT_TRUE(has(e, path("big")) && has(e, "101 bytes") && has(e, "100")) << e;
  // A sparse file far past the cap is refused from its size alone.
  { std::ofstream(path("sparse")).close(); }
  fs::resize_file(path("sparse"), kMaxConfigBytes + 1);
  EXPECT_TRUE(has(error_of([&] { read_text_file(path("sparse"), kMaxConfigBytes); }), "more than"));
}

TEST_F(UntrustedFile, RefusesFifoWithoutBlocking) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { read_text_file(path("fifo"), 100); });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_TRUE(has(e, path("fifo")) && has(e, "not a regular file") && has(e, "FIFO")) << e;
  // Through a symlink, too.
  fs::create_symlink(path("fifo"), path("link"));
  EXPECT_TRUE(has(error_of([&] { read_text_file(path("link"), 100); }), "FIFO"));
}

TEST_F(UntrustedFile, RefusesDirectoryDevicesAndMissing) {
  fs::create_directories(path("sub"));
  EXPECT_TRUE(has(error_of([&] { read_text_file(path("sub"), 100); }), "a directory"));
  EXPECT_TRUE(has(error_of([] { read_text_file("/dev/null", 100); }), "not a regular file"));
  fs::create_symlink("/dev/zero", path("zero"));
  EXPECT_TRUE(has(error_of([&] { read_text_file(path("zero"), kMaxConfigBytes); }), "a device"));
  const std::string e = error_of([&] { read_text_file(path("nope"), 100); });
  EXPECT_TRUE(has(e, path("nope")) && has(e, "cannot open")) << e;
}

}  // namespace
}  // namespace kd
