// The safetensors reader: a valid file round-trips through the writer, and every way a header can
// lie is refused with a message naming the file and the tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "io/safetensors.h"

namespace kd {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kdtree_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

// A file image: 8-byte length, header JSON, then `data_bytes` bytes of data.
std::string image(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\x01');
}

std::string parse_error(const std::string& img) {
  try {
    parse_safetensors_header(reinterpret_cast<const uint8_t*>(img.data()), img.size(), img.size(), "t.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, WriterRoundTripsAndAlignsData) {
  const std::string path = temp_path("rt.safetensors");
  SafetensorsWriter w;
  const float f[3] = {1.5f, -2.0f, 3.25f};
  const uint16_t h[2] = {0x3f80, 0xc000};
  w.add_bytes("a.weight", DType::F32, {3}, f);
  w.add_bytes("b", DType::BF16, {1, 2}, h);
  w.set_metadata("format", "pt");
  w.write(path);
  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 2u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  const TensorInfo* a = file.find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, std::vector<int64_t>{3});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(file.data(*a)) % 8, 0u);  // header padded to 8 bytes
  EXPECT_EQ(std::memcmp(file.data(*a), f, sizeof f), 0);
  const TensorInfo* b = file.find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::BF16);
  EXPECT_EQ(std::memcmp(file.data(*b), h, sizeof h), 0);
  EXPECT_EQ(file.find("missing"), nullptr);
  std::filesystem::remove(path);
}

TEST(Safetensors, AcceptsEmptyTensorsAndZeroDims) {
  EXPECT_EQ(parse_error(image(R"({"a":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},"b":{"dtype":"I32","shape":[],"data_offsets":[0,4]}})", 4)), "");
}

struct BadCase {
  const char* what;
  std::string img;
  const char* expect;  // a substring the message must hold
};

TEST(Safetensors, RefusesBrokenHeaders) {
  const std::string ok_tensor = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::string huge(8, '\0');
  huge[7] = 0x7f;
  std::string beyond = image("{" + ok_tensor + "}", 8);
  beyond[0] = char(0xff);  // header length 255+: past the end of this small file
  const BadCase cases[] = {
      {"too short", std::string("\x01\x02\x03", 3), "too short"},
      {"length beyond EOF", beyond, "runs past the end"},
      {"length over 100 MB", huge + std::string(16, ' '), "100 MB"},
      {"bad JSON", image("{\"w\": {", 0), "not valid JSON"},
      {"not an object", image("[1,2]", 0), "not an object"},
      {"entry not an object", image(R"({"w": 3})", 0), "tensor 'w'"},
      {"unknown dtype", image(R"({"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'Q4_K'"},
      {"missing dtype", image(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8), "dtype"},
      {"negative dim", image(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "negative"},
      {"shape/size mismatch", image(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "data_offsets cover 8"},
      {"offsets past data", image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 8), "past the data section"},
      {"offsets reversed", image(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8), "end before they begin"},
      {"overlap", image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "overlap"},
      {"overflowing shape", image(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8), "overflows"},
      {"metadata not strings", image(R"({"__metadata__":{"a":1}})", 0), "__metadata__"},
      {"offsets not ints", image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}})", 8), "data_offsets"},
  };
  for (const auto& c : cases) {
    std::string msg = parse_error(c.img);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": got '" << msg << "'";
    EXPECT_NE(msg.find("t.safetensors"), std::string::npos) << c.what << ": message must name the file: " << msg;
  }
}

TEST(Safetensors, OpenNamesMissingAndTruncatedFiles) {
  EXPECT_THROW(SafetensorsFile("/nonexistent/x.safetensors"), Error);
  const std::string path = temp_path("trunc.safetensors");
  std::string img = image(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16);
  img.resize(img.size() - 5);
  std::ofstream(path, std::ios::binary) << img;
  try {
    SafetensorsFile f(path);
    FAIL() << "truncated file accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kd
