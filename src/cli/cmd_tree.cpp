// `kdtree tree`: build DDTree's draft tree from per-position draft logits and print it — for
// people tuning budgets, and for the tests that check the builder against a Python reference.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/int_flag.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "decode/tree.h"

namespace kd::cli {

void add_tree(CLI::App& app, TreeOptions& o) {
  auto* c = app.add_subcommand("tree", "Build a DDTree draft tree from draft logits and print it");
  c->add_option("--logits", o.logits, "safetensors file with tensor 'logits' F32 [positions, vocab]")->required();
  c->add_option("--budget", o.budget, cat("Tree nodes, root excluded (at most ", kMaxTreeBudget, ")"))
      ->required()
      ->transform(whole_number(o.budget));
  c->add_flag("--chain", o.chain, "Build the top-1 chain (DFlash verify) instead of a tree");
  c->add_flag("--json", o.json, "Print one JSON object");
}

int cmd_tree(const TreeOptions& o) {
  if (o.budget < 1) fail("--budget must be at least 1 (got ", o.budget, ")");
  if (o.budget > kMaxTreeBudget)
    fail("--budget ", o.budget, " is more than ", kMaxTreeBudget, " tree nodes (the printed visibility mask is budget² entries)");
  SafetensorsFile f(o.logits);
  const TensorInfo* t = f.find("logits");
  if (!t) fail(o.logits, ": no tensor 'logits'");
  if (t->dtype != DType::F32) fail(o.logits, ": tensor 'logits' is ", dtype_name(t->dtype), ", expected F32");
  if (t->shape.size() != 2 || t->shape[0] < 1 || t->shape[1] < 1)
    fail(o.logits, ": tensor 'logits' has shape ", t->shape_str(), ", expected [positions, vocab]");
  const int64_t L = t->shape[0], V = t->shape[1];
  std::vector<float> logits(static_cast<size_t>(L * V));
  std::memcpy(logits.data(), f.data(*t), t->nbytes());
  const DraftTree tree = o.chain ? build_draft_chain(logits.data(), L, V) : build_draft_tree(logits.data(), L, V, o.budget);
  const int64_t n = tree.size() - 1;
  const std::vector<uint8_t> vis = tree.visibility();
  if (o.json) {
    nlohmann::ordered_json j;
    j["budget"] = o.budget;
    j["positions"] = L;
    j["vocab"] = V;
    j["n_nodes"] = n;
    j["tokens"] = std::vector<int32_t>(tree.tokens.begin() + 1, tree.tokens.end());
    j["depths"] = std::vector<int32_t>(tree.depths.begin() + 1, tree.depths.end());
    j["parents"] = tree.parents;
    j["ranks"] = std::vector<int32_t>(tree.ranks.begin() + 1, tree.ranks.end());
    j["scores"] = std::vector<double>(tree.scores.begin() + 1, tree.scores.end());
    nlohmann::ordered_json visible = nlohmann::ordered_json::array();
    for (int64_t i = 0; i <= n; ++i) {
      std::vector<int64_t> row;
      for (int64_t k = 0; k <= n; ++k)
        if (vis[size_t(i * (n + 1) + k)]) row.push_back(k);
      visible.push_back(row);
    }
    j["visible"] = visible;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("%lld nodes over %lld positions (vocab %lld)\n", (long long)n, (long long)L, (long long)V);
  std::printf("%6s %6s %6s %6s %8s %12s  path\n", "node", "parent", "depth", "rank", "token", "log q");
  for (int64_t i = 1; i <= n; ++i) {
    std::string path;
    for (int64_t a = i; a > 0; a = tree.parents[size_t(a)]) path = cat(tree.tokens[size_t(a)], path.empty() ? "" : " ", path);
    std::printf("%6lld %6d %6d %6d %8d %12.6f  %s\n", (long long)i, tree.parents[size_t(i)], tree.depths[size_t(i)],
                tree.ranks[size_t(i)], tree.tokens[size_t(i)], tree.scores[size_t(i)], path.c_str());
  }
  return 0;
}

}  // namespace kd::cli
