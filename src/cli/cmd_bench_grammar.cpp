// `kdtree bench --draft DIR --json-schema FILE | --gbnf FILE`: DDTree under a grammar (bench_grammar.h).
// Every run goes through the engine with one sequence — the path a constrained request takes in
// `serve` — so the masks, the grammar-filtered tree and the exactness check are the server's own.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/bench_grammar.h"
#include "core/error.h"
#include "engine/engine.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "grammar/vocab_trie.h"
#include "model/dflash.h"
#include "tokenizer/tokenizer.h"

namespace kd::cli {

namespace {

std::string read_file(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(flag, " ", path, ": cannot open the file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The constraint as serve compiles it for response_format / grammar: JSON with the separators
// json.dumps uses and no free whitespace; --json-schema closes objects as strict: true does.
grammar::GrammarSpec compile(const BenchOptions& o, const Tokenizer& tok) {
  namespace gr = kd::grammar;
  gr::GrammarSpec spec;
  try {
    if (!o.json_schema.empty()) {
      nlohmann::ordered_json schema;
      try {
        schema = nlohmann::ordered_json::parse(read_file(o.json_schema, "--json-schema"));
      } catch (const nlohmann::json::exception& e) {
        fail("not JSON (", e.what(), ")");
      }
      gr::JsonGrammarOptions jo;
      jo.any_whitespace = false;
      jo.strict = true;
      spec.grammar = std::make_shared<const gr::CompiledGrammar>(gr::json_schema_grammar(schema, jo));
    } else {
      const gr::SpecialTokens specials = [&tok](std::string_view name) { return tok.special_id(name); };
      spec.grammar = std::make_shared<const gr::CompiledGrammar>(gr::parse_gbnf(read_file(o.gbnf, "--gbnf"), "root", specials));
    }
  } catch (const Error& e) {
    fail(o.json_schema.empty() ? "--gbnf " : "--json-schema ", o.json_schema.empty() ? o.gbnf : o.json_schema, ": ", e.what());
  }
  spec.vocab = std::make_shared<const gr::VocabTrie>(gr::VocabTrie::from_tokenizer(tok));
  spec.masks = std::make_shared<gr::SharedMasks>(spec.grammar, spec.vocab);  // every run shares them, as serve's requests do
  return spec;
}

struct Run {
  std::vector<int32_t> ids;
  std::string finish;
  RequestStats stats;
  double tps() const { return stats.decode_ms > 0 ? double(stats.n_generated) / stats.decode_ms * 1e3 : 0; }
  double tau() const { return stats.rounds > 0 ? double(stats.accepted + stats.rounds) / double(stats.rounds) : 0; }
  double drafted_per_round() const { return stats.rounds > 0 ? double(stats.drafted) / double(stats.rounds) : 0; }
};

// One request alone through a fresh engine (no prefix cache: every run pays its own prefill).
Run run_one(const Target& t, const EngineOptions& eo, const std::vector<int32_t>& prompt, const GenerateOptions& g,
            const grammar::GrammarSpec& spec) {
  Engine eng(t, eo);
  std::mutex mu;
  std::condition_variable cv;
  Run r;
  bool done = false;
  EngineRequest q;
  q.prompt = prompt;
  q.gen = g;
  q.grammar = spec;
  std::string error;
  q.on_event = [&](const EngineEvent& ev) {
    std::lock_guard<std::mutex> lk(mu);
    r.ids.insert(r.ids.end(), ev.ids.begin(), ev.ids.end());
    if (ev.done) {
      r.finish = ev.finish_reason;
      r.stats = ev.stats;
      error = ev.error;
      done = true;
      cv.notify_all();
    }
    return true;
  };
  eng.submit(std::move(q));
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done; });
  if (r.finish == "error") fail("bench: the constrained request failed: ", error);
  return r;
}

}  // namespace

void check_constrained(const BenchOptions& o) {
  if (!o.json_schema.empty() && !o.gbnf.empty()) fail("--json-schema and --gbnf: give one constraint");
  if (o.spec != "ddtree") fail("--json-schema / --gbnf: the constrained bench runs --spec ddtree (the tree is what the grammar masks)");
  if (o.tp.tp > 1) fail("--json-schema / --gbnf with --tp: not supported yet (run the constrained bench on one device)");
}

int bench_constrained(const BenchOptions& o, const std::vector<std::vector<int32_t>>& prompts,
                      const std::vector<SpecConfig>& configs, const LoadedTarget& lt, const LoadedTarget::Drafters& drafters) {
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = load_tokenizer(o.model);
  } catch (const Error& e) {
    fail("--json-schema / --gbnf need the checkpoint's tokenizer (the grammar masks its vocabulary): ", e.what());
  }
  const grammar::GrammarSpec spec = compile(o, *tok);
  const Target& target = lt.target();

  GenerateOptions g;
  g.max_new_tokens = o.n_gen;
  g.ignore_eos = false;  // a constrained answer ends where its grammar does
  g.sampling.temperature = float(o.temp);
  g.sampling.seed = o.seed;
  validate(g.sampling);
  int64_t longest = 0, budget = 1;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, int64_t(p.size()));
  for (const SpecConfig& c : configs) budget = std::max(budget, c.so.budget);
  EngineOptions base;
  base.n_parallel = 1;
  base.context = longest + o.n_gen + budget + 2;
  base.kv_tokens = base.context + 2 * base.kv_block;
  base.prefix_cache = false;
  base.prefill_chunk = longest;
  base.step_prefill_tokens = 0;
  auto spec_options = [&](const SpecConfig& c, bool masked) {
    EngineOptions eo = base;
    eo.make_drafter = drafters.make;
    eo.spec = c.so;
    eo.spec.grammar_draft = masked;
    return eo;
  };

  run_one(target, base, prompts[0], g, spec);  // untimed: first-use costs (AR, then the drafter and the tree)
  run_one(target, spec_options(configs[0], true), prompts[0], g, spec);
  const bool tty = !o.json;
  if (tty) {
    std::printf("%s on %s under %s: at most %lld tokens a run, T = %g, median of %lld\n", o.model.c_str(), target.device().c_str(),
                o.json_schema.empty() ? ("--gbnf " + o.gbnf).c_str() : ("--json-schema " + o.json_schema).c_str(),
                (long long)o.n_gen, o.temp, (long long)o.repetitions);
    std::printf("%-7s %6s %-6s %9s", "prompt", "tokens", "finish", "AR tok/s");
    for (const SpecConfig& c : configs) std::printf(" | %-6s masked: tau nodes tok/s | unmasked: tau nodes tok/s", c.label.c_str());
    std::printf("\n");
  }
  nlohmann::ordered_json jprompts = nlohmann::ordered_json::array();
  std::vector<std::vector<double>> tau_m(configs.size()), tau_u(configs.size()), x_m(configs.size()), x_u(configs.size());
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    std::vector<double> ar_tps;
    Run ar;
    std::vector<std::vector<Run>> runs(configs.size() * 2);
    for (int64_t rep = 0; rep < o.repetitions; ++rep) {
      const Run a = run_one(target, base, prompts[pi], g, spec);
      if (rep == 0) ar = a;
      else if (a.ids != ar.ids) fail("prompt ", pi, ": AR under the grammar gave different tokens on repetition ", rep);
      ar_tps.push_back(a.tps());
      for (size_t ci = 0; ci < configs.size(); ++ci)
        for (int masked = 1; masked >= 0; --masked) {
          Run s = run_one(target, spec_options(configs[ci], masked == 1), prompts[pi], g, spec);
          if (s.ids != ar.ids)
            fail("prompt ", pi, ", --budget ", configs[ci].label, masked ? ", masked" : ", unmasked",
                 " draft: the output differs from AR's under the same grammar — a bug (DDTree must give AR's tokens exactly)");
          runs[2 * ci + size_t(1 - masked)].push_back(std::move(s));
        }
    }
    const double ar_med = bench_median(ar_tps);
    nlohmann::ordered_json jp;
    jp["index"] = pi;
    jp["n_prompt"] = prompts[pi].size();
    jp["n_generated"] = ar.ids.size();
    jp["finish_reason"] = ar.finish;
    jp["ar_tokens_per_s"] = ar_med;
    jp["output_ids"] = ar.ids;
    jp["text"] = tok->decode(ar.ids);
    if (tty) std::printf("%-7zu %6zu %-6s %9.0f", pi, ar.ids.size(), ar.finish.c_str(), ar_med);
    nlohmann::ordered_json jr = nlohmann::ordered_json::array();
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      nlohmann::ordered_json r;
      r["config"] = configs[ci].label;
      for (int k = 0; k < 2; ++k) {
        std::vector<double> tps, tau, nodes, rounds;
        for (const Run& s : runs[2 * ci + size_t(k)])
          tps.push_back(s.tps()), tau.push_back(s.tau()), nodes.push_back(s.drafted_per_round()), rounds.push_back(double(s.stats.rounds));
        const double t = bench_median(tps), ta = bench_median(tau), nd = bench_median(nodes), x = ar_med > 0 ? t / ar_med : 0;
        (k == 0 ? tau_m : tau_u)[ci].push_back(ta);
        (k == 0 ? x_m : x_u)[ci].push_back(x);
        nlohmann::ordered_json m;
        m["tau"] = ta;
        m["drafted_per_round"] = nd;
        m["rounds"] = bench_median(rounds);
        m["tokens_per_s"] = t;
        m["speedup"] = x;
        m["exact"] = true;
        r[k == 0 ? "masked" : "unmasked"] = m;
        if (tty) std::printf(" %s %5.2f %5.1f %6.0f", k == 0 ? "|" : "  ", ta, nd, t);
      }
      jr.push_back(r);
    }
    if (tty) std::printf("\n");
    jp["runs"] = jr;
    jprompts.push_back(jp);
  }
  nlohmann::ordered_json jsum = nlohmann::ordered_json::array();
  for (size_t ci = 0; ci < configs.size(); ++ci) {
    nlohmann::ordered_json s;
    s["config"] = configs[ci].label;
    s["masked_median_tau"] = bench_median(tau_m[ci]);
    s["masked_median_speedup"] = bench_median(x_m[ci]);
    s["unmasked_median_tau"] = bench_median(tau_u[ci]);
    s["unmasked_median_speedup"] = bench_median(x_u[ci]);
    jsum.push_back(s);
    if (tty)
      std::printf("%-6s: median over %zu prompts — masked draft τ %.2f, %.2f× AR; unmasked τ %.2f, %.2f× AR (outputs == AR)\n",
                  configs[ci].label.c_str(), prompts.size(), bench_median(tau_m[ci]), bench_median(x_m[ci]), bench_median(tau_u[ci]), bench_median(x_u[ci]));
  }
  if (o.json) {
    nlohmann::ordered_json j = bench_json_head(o, target.device());
    j["prompts"] = jprompts;
    j["summary"] = jsum;
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace kd::cli
