// Type- and range-checked reads of config.json fields. Every error names the file (label), the
// field and what was found. Used by the target config (io/config.cpp) and the DFlash drafter
// config (model/dflash.cpp). What was found is printed as a short excerpt (core/untrusted.h): a
// hostile file's value may be megabytes long or nest arbitrarily.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/error.h"
#include "core/untrusted.h"

namespace kd {

struct JsonFields {
  const nlohmann::json& j;
  std::string label;
  const nlohmann::json* alt = nullptr;  // looked up when `j` lacks the key (z-lab: dflash_config, then top level)

  // nullptr when absent or null.
  const nlohmann::json* get(const char* key) const {
    auto it = j.find(key);
    if (it != j.end() && !it->is_null()) return &*it;
    if (alt) {
      auto a = alt->find(key);
      if (a != alt->end() && !a->is_null()) return &*a;
    }
    return nullptr;
  }
  // Absent → `def`, or an error naming the field when there is no default.
  int64_t integer(const char* key, int64_t lo, int64_t hi, std::optional<int64_t> def = {}) const {
    const nlohmann::json* v = get(key);
    if (!v) {
      if (def) return *def;
      fail(label, ": missing required field '", key, "'");
    }
    if (!v->is_number_integer()) fail(label, ": field '", key, "' must be an integer, found ", json_excerpt(*v));
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) fail(label, ": field '", key, "' = ", x, " is out of range [", lo, ", ", hi, "]");
    return x;
  }
  double number(const char* key, double lo, double hi, std::optional<double> def = {}) const {
    const nlohmann::json* v = get(key);
    if (!v) {
      if (def) return *def;
      fail(label, ": missing required field '", key, "'");
    }
    if (!v->is_number()) fail(label, ": field '", key, "' must be a number, found ", json_excerpt(*v));
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi)) fail(label, ": field '", key, "' = ", x, " is out of range [", lo, ", ", hi, "]");
    return x;
  }
  std::string string_or(const char* key, const std::string& def) const {
    const nlohmann::json* v = get(key);
    if (!v) return def;
    if (!v->is_string()) fail(label, ": field '", key, "' must be a string, found ", json_excerpt(*v));
    return v->get<std::string>();
  }
  bool boolean_or(const char* key, bool def) const {
    const nlohmann::json* v = get(key);
    if (!v) return def;
    if (!v->is_boolean()) fail(label, ": field '", key, "' must be true or false, found ", json_excerpt(*v));
    return v->get<bool>();
  }
};

}  // namespace kd
