#include "io/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/untrusted.h"

namespace kd {

namespace {
constexpr uint64_t kMaxHeader = 100ull << 20;  // safetensors' own limit
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += cat(i ? ", " : "", shape[i]);
  return s + "]";
}

SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t len, uint64_t file_size,
                                           const std::string& label) {
  if (file_size < 8 || len < 8) fail(label, ": file is ", file_size, " bytes, too short for a safetensors header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeader) fail(label, ": header length ", n, " exceeds the 100 MB limit (corrupt or not safetensors)");
  if (n > file_size - 8) fail(label, ": header length ", n, " runs past the end of the file (", file_size, " bytes): truncated?");
  if (n > len - 8) fail(label, ": only ", len, " bytes given for a header of ", n);
  SafetensorsHeader h;
  h.data_offset = 8 + n;
  const uint64_t data_size = file_size - h.data_offset;

  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), size_t(n));
  const nlohmann::json j = parse_json(text, label + ": header");
  if (!j.is_object()) fail(label, ": header JSON is not an object (it starts '", escaped_excerpt(text, 40), "')");

  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(label, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(label, ": __metadata__ value for '", escaped_excerpt(m.key(), 200), "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = cat(label, ": tensor '", escaped_excerpt(name, 200), "'");
    if (!v.is_object()) fail(where, ": entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) fail(where, ": missing or non-string 'dtype'");
    if (sh == v.end() || !sh->is_array()) fail(where, ": missing or non-array 'shape'");
    if (off == v.end() || !off->is_array() || off->size() != 2) fail(where, ": 'data_offsets' must be [begin, end]");
    TensorInfo t;
    t.name = name;
    const std::string dts = dt->get<std::string>();
    if (!parse_dtype(dts, &t.dtype)) fail(where, ": unknown dtype '", escaped_excerpt(dts, 40), "'");
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) fail(where, ": shape ", json_excerpt(*sh), " has a non-integer or negative dimension");
      uint64_t dim = d.get<uint64_t>();
      if (dim > uint64_t(std::numeric_limits<int64_t>::max())) fail(where, ": dimension ", dim, " too large");
      if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim) overflow = true;
      numel *= dim;
      t.shape.push_back(int64_t(dim));
    }
    const uint64_t item = dtype_size(t.dtype);
    if (overflow || numel > std::numeric_limits<uint64_t>::max() / item) fail(where, ": shape ", json_excerpt(*sh), " overflows");
    for (const auto& o : *off)
      if (!o.is_number_unsigned()) fail(where, ": data_offsets ", json_excerpt(*off), " are not non-negative integers");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.begin > t.end) fail(where, ": data_offsets ", json_excerpt(*off), " end before they begin");
    if (t.end > data_size)
      fail(where, ": data_offsets ", json_excerpt(*off), " run past the data section (", data_size, " bytes): truncated file?");
    if (numel * item != t.end - t.begin)
      fail(where, ": shape ", t.shape_str(), " × ", item, " bytes (", dts, ") = ", numel * item,
           " bytes, but data_offsets cover ", t.end - t.begin);
    h.tensors.push_back(std::move(t));
  }

  std::vector<const TensorInfo*> by_off;
  for (const auto& t : h.tensors) by_off.push_back(&t);
  std::sort(by_off.begin(), by_off.end(), [](auto* a, auto* b) { return a->begin < b->begin || (a->begin == b->begin && a->end < b->end); });
  for (size_t i = 1; i < by_off.size(); ++i) {
    const TensorInfo *a = by_off[i - 1], *b = by_off[i];
    if (b->begin < a->end && b->nbytes() > 0 && a->nbytes() > 0)
      fail(label, ": tensors '", escaped_excerpt(a->name, 200), "' [", a->begin, ", ", a->end, ") and '",
           escaped_excerpt(b->name, 200), "' [", b->begin, ", ",
           b->end, ") overlap");
  }
  return h;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : map_(path) {
  header_ = parse_safetensors_header(map_.data(), map_.size(), map_.size(), path);
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0) fail("safetensors writer: tensor '", name, "' has a negative dimension");
    n *= uint64_t(d);
  }
  total_ += n;
  pending_.push_back({std::move(name), dtype, std::move(shape), n, std::move(fill)});
}

void SafetensorsWriter::add_bytes(std::string name, DType dtype, std::vector<int64_t> shape, const void* data) {
  add(std::move(name), dtype, std::move(shape),
      [data](uint8_t* dst, uint64_t nbytes) {
        if (nbytes) std::memcpy(dst, data, nbytes);  // an empty tensor may come with a null pointer
      });
}

void SafetensorsWriter::write(const std::string& path, const std::function<void(uint64_t)>& on_bytes) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata_.empty()) j["__metadata__"] = metadata_;
  uint64_t off = 0;
  for (const auto& p : pending_) {
    j[p.name] = {{"dtype", std::string(dtype_name(p.dtype))}, {"shape", p.shape}, {"data_offsets", {off, off + p.nbytes}}};
    off += p.nbytes;
  }
  std::string header = j.dump();
  header.resize((header.size() + 7) / 8 * 8, ' ');  // data section starts 8-byte aligned
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f) fail(path, ": cannot open for writing");
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  bool ok = std::fwrite(len, 1, 8, f.get()) == 8 && std::fwrite(header.data(), 1, header.size(), f.get()) == header.size();
  std::vector<uint8_t> buf;
  for (auto& p : pending_) {
    if (!ok) break;
    buf.assign(p.nbytes, 0);
    if (p.fill && p.nbytes) p.fill(buf.data(), p.nbytes);
    ok = std::fwrite(buf.data(), 1, p.nbytes, f.get()) == p.nbytes;
    if (on_bytes) on_bytes(p.nbytes);
  }
  if (!ok || std::fflush(f.get()) != 0) fail(path, ": write failed (disk full?)");
}

}  // namespace kd
