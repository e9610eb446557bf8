// The made model of the tensor-parallel tests (tests/unit/test_tensor_parallel.cpp on the CPU,
// tests/gpu/test_cuda_tp.cpp on the GPU): the "small" preset with 8 heads, 256-wide INT4 experts and a
// 1000-token vocabulary, so that R = 8 divides every shape (the HF fixtures have 4 heads). Random
// weights (make_model, seed 11), written once per test process to a temporary directory, removed at exit.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/make_model.h"

namespace kd::test {

inline std::string tp8_model_dir() {
  static std::string dir;
  if (!dir.empty()) return dir;
  namespace fs = std::filesystem;
  dir = (fs::temp_directory_path() / cat("kdtree_test_tp8_", ::getpid())).string();
  nlohmann::ordered_json c = nlohmann::ordered_json::parse(preset_config_json("small"));
  c["moe_intermediate_size"] = 256;
  c["num_hidden_layers"] = 3;
  c["vocab_size"] = 1000;  // 125 rows a rank at R = 8
  const std::string cfg = dir + ".config.json";
  std::ofstream(cfg) << c.dump(2);
  MakeModelOptions o;
  o.config_path = cfg;
  o.out_dir = dir;
  o.seed = 11;
  o.force = true;
  make_model(o);
  fs::remove(cfg);
  // Removed at exit (ctest runs every test in a process of its own: one model each).
  static const struct Remove {
    std::string d;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  } remove_at_exit{dir};
  return dir;
}

}  // namespace kd::test
