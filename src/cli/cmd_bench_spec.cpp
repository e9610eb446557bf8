// `kdtree bench --draft DIR`: speculative decoding against plain AR on real prompts — for each prompt
// and each decoder configuration (DDTree at fixed budgets or auto, the DFlash chain), decode tokens/s
// of AR and of the configuration (the median of -r repetitions, run interleaved so drift hits both),
// the speedup, τ (mean accepted length), --budget auto's AR steps, and whether the output equals AR's
// (it must: a difference is an error). Greedy repetition loops are flagged per prompt, and the summary
// gives the medians over prompts with and without one separately: a loop inflates τ.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/bench_grammar.h"
#include "cli/budget_flags.h"
#include "cli/commands.h"
#include "cli/device.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/generate.h"
#include "model/dflash.h"

namespace kd::cli {

double bench_median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

nlohmann::ordered_json bench_json_head(const BenchOptions& o, const std::string& device) {
  nlohmann::ordered_json j;
  j["model"] = o.model;
  j["draft"] = o.draft;
  j["device"] = device;
  j["spec"] = o.spec;
  if (!o.json_schema.empty()) j["constraint"] = {{"json_schema", o.json_schema}};
  if (!o.gbnf.empty()) j["constraint"] = {{"gbnf", o.gbnf}};
  j["n_gen"] = o.n_gen;
  j["repetitions"] = o.repetitions;
  j["temperature"] = o.temp;
  j["seed"] = o.seed;
  return j;
}

bool has_repetition_loop(const std::vector<int32_t>& ids, int64_t min_len, int64_t min_count) {
  if (min_len < 1 || min_count < 2) fail("repetition loop: an n-gram of at least 1 token seen at least twice");
  const int64_t n = int64_t(ids.size());
  if (n < min_len * min_count) return false;
  // Occurrences need not overlap-free: "a a a a" holds "a a" three times; a loop of period p < min_len
  // repeats every n-gram of it, so this finds it too.
  std::map<std::vector<int32_t>, int64_t> seen;
  for (int64_t i = 0; i + min_len <= n; ++i) {
    std::vector<int32_t> g(ids.begin() + i, ids.begin() + i + min_len);
    if (++seen[std::move(g)] >= min_count) return true;
  }
  return false;
}

namespace {

std::vector<int32_t> parse_id_list(const std::string& s, const std::string& flag) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || v < 0 || v > INT32_MAX)
      fail(flag, ": '", item, "' (item ", ids.size() + 1, ") is not a non-negative token id");
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) fail(flag, ": no token ids");
  return ids;
}

// A JSON array of prompts: each an array of token ids or an object with "ids" (assets/pair/eval_prompts.json).
std::vector<std::vector<int32_t>> read_prompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("--prompts ", path, ": cannot open the file");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    fail("--prompts ", path, ": not JSON (", e.what(), ")");
  }
  if (!j.is_array() || j.empty()) fail("--prompts ", path, ": expected a non-empty JSON array of prompts");
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const nlohmann::json& p = j[i].is_object() && j[i].contains("ids") ? j[i]["ids"] : j[i];
    if (!p.is_array() || p.empty())
      fail("--prompts ", path, ": prompt ", i, " is neither a non-empty array of token ids nor an object with \"ids\"");
    std::vector<int32_t> ids;
    for (const auto& v : p) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
        fail("--prompts ", path, ": prompt ", i, " holds ", v.dump(), ", not a token id");
      ids.push_back(int32_t(v.get<int64_t>()));
    }
    out.push_back(std::move(ids));
  }
  return out;
}

struct Config {
  std::string label;  // "16", "auto", "chain", "chain auto"
  BudgetFlags flags;
  SpecOptions so;
};

struct Sample {
  double tps = 0, tau = 0, tau_drafted = 0, ceiling = 0;
  int64_t ar_steps = 0, rounds = 0;
};

}  // namespace

int cmd_bench_spec(const BenchOptions& o) {
  if (o.spec != "ddtree" && o.spec != "dflash")
    fail("--spec ", o.spec, ": bench compares ddtree or dflash (the chain) with AR");
  if (!o.preset.empty()) fail("--preset: the speculative bench runs a checkpoint and its drafter (-m DIR --draft DIR)");
  if (o.model.empty()) fail("bench --draft needs -m DIR (the target the drafter was trained for)");
  if (!o.serve.empty() || o.verify_curve || !o.verify_sizes.empty())
    fail("--serve, --verify-curve and --verify-sizes are the plain bench's; drop them with --draft");
  if (o.prompt_ids.empty() == o.prompts.empty()) fail("bench --draft needs one of --prompt-ids 1,2,3 or --prompts FILE.json");
  if (o.temp < 0) fail("--temp must be ≥ 0 (got ", o.temp, ")");
  if (!o.json_schema.empty() || !o.gbnf.empty()) check_constrained(o);
  std::vector<std::vector<int32_t>> prompts =
      o.prompts.empty() ? std::vector<std::vector<int32_t>>{parse_id_list(o.prompt_ids, "--prompt-ids")} : read_prompts(o.prompts);
  if (o.prompt_limit > 0 && int64_t(prompts.size()) > o.prompt_limit) prompts.resize(size_t(o.prompt_limit));

  std::vector<Config> configs;
  std::vector<std::string> budgets = o.budgets;
  if (budgets.empty()) budgets.push_back(o.spec == "ddtree" ? "auto" : "");
  if (!o.budget_max.empty() && o.spec != "ddtree") fail("--budget-max only applies to --spec ddtree (with --budget auto)");
  if (!o.budget_max.empty() && std::find(budgets.begin(), budgets.end(), "auto") == budgets.end())
    fail("--budget-max applies to --budget auto, which is not among --budget ", o.budgets.empty() ? "" : o.budgets[0], "…");
  auto whole = [](const std::string& s) { return !s.empty() && s.size() < 10 && std::all_of(s.begin(), s.end(), ::isdigit); };
  if (!o.budget_max.empty() && !whole(o.budget_max)) fail("--budget-max '", o.budget_max, "' is not a whole number of tree nodes");
  for (std::string b : budgets) {
    if (b == "chain") {
      if (o.spec != "dflash") fail("--budget chain (the whole chain) applies to --spec dflash");
      b.clear();
    }
    if (!b.empty() && b != "auto" && !whole(b)) fail("--budget '", b, "' is not auto, chain or a whole number of tree nodes");
    Config c;
    c.flags.budget = b;
    c.flags.budget_max = b == "auto" && o.spec == "ddtree" ? o.budget_max : "";
    check_budget_flags(c.flags, o.spec);
    apply_budget_flags(c.flags, o.spec, c.so);
    c.label = o.spec == "dflash" ? (b == "auto" ? "chain auto" : "chain") : b;
    configs.push_back(c);
  }

  const LoadedTarget lt(o.device, o.model, o.tp);  // --tp R: the tensor-parallel target, as run makes it
  const Target& target = lt.target();
  const ModelConfig& cfg = lt.config();
  for (const auto& p : prompts)
    for (int32_t id : p)
      if (id >= cfg.vocab_size) fail("prompt token ", id, " is outside the model's vocabulary of ", cfg.vocab_size);
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, int64_t(p.size()));
  const LoadedTarget::Drafters drafters = lt.dflash_drafters(o.draft, longest + o.n_gen + 1);

  GenerateOptions g;
  g.max_new_tokens = o.n_gen;
  g.ignore_eos = true;  // every run decodes -n tokens: rates over the same lengths
  g.sampling.temperature = float(o.temp);
  g.sampling.seed = o.seed;
  validate(g.sampling);

  if (!o.json_schema.empty() || !o.gbnf.empty()) {
    std::vector<SpecConfig> sc;
    for (const Config& c : configs) sc.push_back({c.label, c.so});
    return bench_constrained(o, prompts, sc, lt, drafters);
  }

  // One untimed AR and speculative run first: caches, kernels' first launches, lazy loading.
  generate_ar(target, prompts[0], g);
  {
    std::unique_ptr<Drafter> d = drafters.make();
    generate_ddtree(target, *d, prompts[0], g, configs[0].so);
  }

  nlohmann::ordered_json jprompts = nlohmann::ordered_json::array();
  std::vector<std::vector<double>> speedups(configs.size()), speedups_loop(configs.size()), taus(configs.size()),
      taus_loop(configs.size());
  const bool tty = !o.json;
  if (tty) {
    std::printf("%s on %s: %lld tokens a run, T = %g, median of %lld\n", o.model.c_str(), target.device().c_str(),
                (long long)o.n_gen, o.temp, (long long)o.repetitions);
    std::printf("%-7s %6s %-5s %10s", "prompt", "tokens", "loop", "AR tok/s");
    for (const Config& c : configs) std::printf(" | %-10s: tau  tok/s   x AR", c.label.c_str());
    std::printf("\n");
  }
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    const std::vector<int32_t>& prompt = prompts[pi];
    std::vector<double> ar_tps;
    std::vector<std::vector<Sample>> samples(configs.size());
    std::vector<int32_t> ar_ids;
    for (int64_t rep = 0; rep < o.repetitions; ++rep) {
      const GenerateResult ar = generate_ar(target, prompt, g);
      ar_tps.push_back(ar.decode_ms > 0 ? double(ar.output_ids.size()) / ar.decode_ms * 1e3 : 0);
      if (rep == 0) ar_ids = ar.output_ids;
      else if (ar.output_ids != ar_ids) fail("prompt ", pi, ": AR gave different tokens on repetition ", rep);
      for (size_t ci = 0; ci < configs.size(); ++ci) {
        std::unique_ptr<Drafter> d = drafters.make();
        const SpecResult s = generate_ddtree(target, *d, prompt, g, configs[ci].so);
        if (s.gen.output_ids != ar_ids)
          fail("prompt ", pi, ", ", o.spec, " --budget ", configs[ci].label,
               ": the output differs from AR's — a bug (speculative decoding must give AR's tokens exactly)");
        Sample x;
        x.tps = s.gen.decode_ms > 0 ? double(s.gen.output_ids.size()) / s.gen.decode_ms * 1e3 : 0;
        x.tau = s.stats.mean_tau();
        x.ar_steps = s.stats.ar_steps;
        x.rounds = s.stats.rounds;
        x.ceiling = s.stats.auto_ceiling;
        const int64_t drafted_rounds = s.stats.rounds - s.stats.ar_steps;
        x.tau_drafted = drafted_rounds > 0 ? double(s.stats.accepted + drafted_rounds) / double(drafted_rounds) : 0;
        samples[ci].push_back(x);
      }
    }
    const bool loop = has_repetition_loop(ar_ids, kLoopNgram, kLoopCount);
    const double ar_med = bench_median(ar_tps);
    nlohmann::ordered_json jp;
    jp["index"] = pi;
    jp["n_prompt"] = prompt.size();
    jp["loop"] = loop;
    jp["ar_tokens_per_s"] = ar_med;
    jp["ar_tokens_per_s_runs"] = ar_tps;
    jp["output_ids"] = ar_ids;  // AR's, which every configuration reproduced
    nlohmann::ordered_json jr = nlohmann::ordered_json::array();
    if (tty) std::printf("%-7zu %6zu %-5s %10.0f", pi, prompt.size(), loop ? "yes" : "no", ar_med);
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      std::vector<double> tps, ar_steps;
      for (const Sample& x : samples[ci]) tps.push_back(x.tps), ar_steps.push_back(double(x.ar_steps));
      std::vector<double> tau_runs;
      for (const Sample& x : samples[ci]) tau_runs.push_back(x.tau);
      const double t_med = bench_median(tps), tau_med = bench_median(tau_runs), speedup = ar_med > 0 ? t_med / ar_med : 0;
      (loop ? speedups_loop : speedups)[ci].push_back(speedup);
      (loop ? taus_loop : taus)[ci].push_back(tau_med);
      nlohmann::ordered_json r;
      r["config"] = configs[ci].label;
      r["budget"] = budget_field(o.spec, configs[ci].so);
      r["tokens_per_s"] = t_med;
      r["tokens_per_s_runs"] = tps;
      r["speedup"] = speedup;
      r["tau"] = tau_med;
      if (configs[ci].so.auto_budget) {
        std::vector<double> td;
        for (const Sample& x : samples[ci]) td.push_back(x.tau_drafted);
        r["tau_drafted_rounds"] = bench_median(td);
        std::vector<double> rounds;
        for (const Sample& x : samples[ci]) rounds.push_back(double(x.rounds));
        r["ar_steps"] = bench_median(ar_steps);  // (auto's choices follow measured costs: they vary between repetitions)
        r["rounds"] = bench_median(rounds);
        // A drafter always right, × AR, from each repetition's start-up profile; below
        // kSpeculationGate that repetition drafted no round.
        std::vector<double> ceil;
        for (const Sample& x : samples[ci]) ceil.push_back(x.ceiling);
        r["ceiling_x_ar"] = bench_median(ceil);
        r["ceiling_x_ar_runs"] = ceil;
      }
      r["exact"] = true;
      jr.push_back(r);
      if (tty) std::printf(" | %11s %5.2f %6.0f %5.2fx", "", tau_med, t_med, speedup);
    }
    if (tty) std::printf("\n");
    jp["runs"] = jr;
    jprompts.push_back(jp);
  }
  nlohmann::ordered_json jsum = nlohmann::ordered_json::array();
  for (size_t ci = 0; ci < configs.size(); ++ci) {
    nlohmann::ordered_json s;
    s["config"] = configs[ci].label;
    s["median_speedup"] = bench_median(speedups[ci]);
    s["median_tau"] = bench_median(taus[ci]);
    s["prompts"] = speedups[ci].size();
    s["loop_median_speedup"] = bench_median(speedups_loop[ci]);
    s["loop_median_tau"] = bench_median(taus_loop[ci]);
    s["loop_prompts"] = speedups_loop[ci].size();
    jsum.push_back(s);
    if (tty)
      std::printf("%-10s: median over %zu prompts without a loop τ %.2f, %.2f× AR; over %zu with one τ %.2f, %.2f× AR\n",
                  configs[ci].label.c_str(), speedups[ci].size(), bench_median(taus[ci]), bench_median(speedups[ci]),
                  speedups_loop[ci].size(), bench_median(taus_loop[ci]), bench_median(speedups_loop[ci]));
  }
  if (o.json) {
    nlohmann::ordered_json j = bench_json_head(o, target.device());
    j["loop_rule"] = {{"ngram", kLoopNgram}, {"count", kLoopCount}};
    j["prompts"] = jprompts;
    j["summary"] = jsum;
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace kd::cli
