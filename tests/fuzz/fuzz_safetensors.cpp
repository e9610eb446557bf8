// libFuzzer target: the safetensors header parser must either accept a header whose every tensor
// lies inside the data section, or throw kd::Error — never crash, hang, recurse without bound
// (issue 21: 100k levels of nesting in a `shape`) or read out of bounds.
// Input: a whole file as is when byte 8 is '{' (the fixtures and seeds), or else template mode
// (json_gen.h) over the headers of the fixtures' safetensors files; byte 0 of the template-mode
// input then also says how the 8-byte length prefix lies (exact most of the time), and the data
// section is the fixture's own, cut or padded by byte 1.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "fuzz_common.h"
#include "io/safetensors.h"

namespace {

struct Fixture {
  kdfuzz::Templates headers;
  std::vector<std::string> data;  // each file's data section, by template index
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x;
    for (const char* p : {"tests/fixtures/int4_vectors.safetensors", "tests/fixtures/k2-int4/model.safetensors",
                          "tests/fixtures/k25-sharded/model-00002-of-00003.safetensors",
                          "tests/fixtures/dflash-rope/model.safetensors", "tests/fixtures/k2-int4/golden.safetensors"}) {
      const std::string file = kdfuzz::read_file(kdfuzz::source_path(p));
      const std::string header = kdfuzz::safetensors_header_text(file);
      x.headers.add_text(header);
      x.data.push_back(file.substr(8 + header.size()));
    }
    return x;
  }();
  return f;
}

void check_header(const uint8_t* bytes, size_t size) {
  try {
    kd::SafetensorsHeader h = kd::parse_safetensors_header(bytes, size, size, "fuzz.safetensors");
    const uint64_t data_size = size - h.data_offset;
    for (const auto& t : h.tensors) {
      if (t.begin > t.end || t.end > data_size) std::abort();  // validation let a bad range through
      if (uint64_t(t.numel()) * kd::dtype_size(t.dtype) != t.nbytes()) std::abort();
    }
  } catch (const kd::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= 9 && data[8] == '{') {
    check_header(data, size);
    return 0;
  }
  if (size < 3) return 0;
  const Fixture& f = fixture();
  const uint8_t lie = data[0], cut = data[1];
  const std::string header = f.headers.generate(data + 2, size - 2);
  kdfuzz::dump_if_asked(header);  // KDTREE_FUZZ_DUMP=FILE: the header text this input stands for
  const std::string& body = f.data[data[2] % f.data.size()];
  uint64_t n = header.size();
  switch (lie % 16) {
    case 0: n += 1; break;
    case 1: n -= 1; break;
    case 2: n = ~uint64_t(0); break;
    case 3: n = uint64_t(1) << 63; break;
    case 4: n = 0; break;
    case 5: n = header.size() + body.size() + 1; break;
    default: break;
  }
  std::string file(8, '\0');
  std::memcpy(file.data(), &n, 8);
  file += header;
  switch (cut % 8) {
    case 0: file += body.substr(0, body.size() / 2); break;
    case 1: break;  // no data at all
    case 2: file += body + std::string(cut, '\0'); break;
    default: file += body; break;
  }
  check_header(reinterpret_cast<const uint8_t*>(file.data()), file.size());
  return 0;
}
