// `kdtree run`: load a checkpoint, generate from a prompt, print tokens (or one JSON object).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/deepseek_v3.h"
#include "spec/ar.h"

namespace kd::cli {

void add_run(CLI::App& app, RunOptions& o) {
  auto* c = app.add_subcommand("run", "Generate tokens from a prompt");
  c->add_option("-m,--model", o.model, "Checkpoint directory (config.json + *.safetensors)")->required();
  c->add_option("-p,--prompt", o.prompt, "Prompt text (needs the tokenizer; use --prompt-ids until it lands)");
  c->add_option("--prompt-ids", o.prompt_ids, "Prompt as comma-separated token ids, e.g. 163584,1,2");
  c->add_option("-n,--n-predict", o.n_predict, "Tokens to generate (stops earlier at an EOS id)")->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  c->add_option("-c,--ctx-size", o.ctx_size, "Context limit in tokens (0 = the model's max_position_embeddings)")->check(CLI::NonNegativeNumber);
  c->add_option("--temp", o.temp, "Sampling temperature; 0 = greedy (default)");
  c->add_option("--top-k", o.top_k, "Keep the k most likely tokens (0 = off)");
  c->add_option("--top-p", o.top_p, "Nucleus sampling: keep the smallest set with this much probability (1 = off)");
  c->add_option("--min-p", o.min_p, "Drop tokens below min-p × the top token's probability (0 = off)");
  c->add_option("-s,--seed", o.seed, "Sampling seed: the token at position p uses Philox(seed, p), so runs are reproducible")
      ->check(CLI::NonNegativeNumber);
  c->add_flag("--ignore-eos", o.ignore_eos, "Do not stop at the model's EOS ids");
  c->add_option("--spec", o.spec, "Decoder: ar (plain autoregressive). ddtree / dflash arrive with the DDTree issue");
  c->add_option("--draft", o.draft, "DFlash drafter directory (for --spec ddtree; not available yet)");
  c->add_option("--budget", o.budget, "DDTree node budget (for --spec ddtree; not available yet)");
  c->add_option("--device", o.device, "cpu (default) or cuda (not in this build)");
  c->add_option("--decode-attn", o.decode_attn, "MLA form for decode steps: absorbed (default, over the latent cache) or expanded")
      ->check(CLI::IsMember({"absorbed", "expanded"}));
  c->add_flag("--json", o.json, "Print exactly one JSON object on stdout (ids, finish reason, timings)");
  c->add_option("--dump-logits", o.dump_logits, "Write the logits of every generated position to this safetensors file ('logits' [steps, vocab] F32)");
}

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string tok = s.substr(i, j - i);
    while (!tok.empty() && tok.front() == ' ') tok.erase(tok.begin());
    while (!tok.empty() && tok.back() == ' ') tok.pop_back();
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (tok.empty() || used != tok.size() || v < 0 || v > INT32_MAX)
      fail("--prompt-ids: '", tok, "' (item ", ids.size() + 1, ") is not a non-negative token id");
    ids.push_back(int32_t(v));
    i = j + 1;
  }
  return ids;
}

}  // namespace

int cmd_run(const RunOptions& o) {
  if (o.device != "cpu")
    fail("--device ", o.device, ": this build has only the CPU backend (the CUDA backend is a later issue); use --device cpu");
  if (o.spec != "ar") {
    if (o.spec == "ddtree" || o.spec == "dflash")
      fail("--spec ", o.spec, " is not available in this build yet (DDTree arrives with its own issue); use --spec ar");
    fail("--spec ", o.spec, ": unknown decoder (choose ar)");
  }
  if (!o.draft.empty() || o.budget != 0) fail("--draft / --budget only apply to --spec ddtree, which is not available yet");
  if (!o.prompt.empty() && !o.prompt_ids.empty()) fail("give either --prompt or --prompt-ids, not both");
  if (!o.prompt.empty())
    fail("text prompts need the tokenizer, which is not in this build yet: pass token ids with --prompt-ids");
  if (o.prompt_ids.empty()) fail("no prompt: pass --prompt-ids 1,2,3");
  const std::vector<int32_t> prompt = parse_ids(o.prompt_ids);

  GenerateOptions g;
  g.max_new_tokens = o.n_predict;
  g.sampling = {o.temp, o.top_k, o.top_p, o.min_p, o.seed};
  validate(g.sampling);
  g.ignore_eos = o.ignore_eos;
  g.keep_logits = !o.dump_logits.empty();
  g.decode_form = o.decode_attn == "expanded" ? AttnForm::expanded : AttnForm::absorbed;
  g.context = o.ctx_size;

  const double t0 = now_s();
  Checkpoint ckpt(o.model);
  DeepseekV3 model(ckpt);
  const double load_ms = (now_s() - t0) * 1e3;
  g.stop_ids = model.config().eos_token_ids;
  log_info("loaded ", o.model, " (", model.config().model_type, ", ", model.config().num_hidden_layers, " layers) in ",
           load_ms, " ms");

  const bool stream = !o.json && log_level() >= LogLevel::quiet;
  GenerateResult r = generate_ar(model, prompt, g, [&](int32_t tok) {
    if (stream) {
      std::printf("%d ", tok);
      std::fflush(stdout);
    }
  });
  if (stream) std::printf("\n");

  if (!o.dump_logits.empty()) {
    SafetensorsWriter w;
    const int64_t steps = int64_t(r.output_ids.size());
    w.add_bytes("logits", DType::F32, {steps, model.config().vocab_size}, r.logits.data());
    w.add_bytes("output_ids", DType::I32, {steps}, r.output_ids.data());
    w.set_metadata("producer", "kdtree run --dump-logits");
    w.write(o.dump_logits);
  }

  const int64_t n_dec = int64_t(r.output_ids.size());
  const double prefill_tps = r.prefill_ms > 0 ? double(r.n_prompt) / r.prefill_ms * 1e3 : 0;
  const double decode_tps = r.decode_ms > 0 ? double(n_dec) / r.decode_ms * 1e3 : 0;
  const double decode_gbps = r.decode_ms > 0 ? double(r.decode_weight_bytes) / (r.decode_ms * 1e-3) / 1e9 : 0;
  if (o.json) {
    nlohmann::ordered_json j;
    j["model"] = o.model;
    j["prompt_ids"] = prompt;
    j["output_ids"] = r.output_ids;
    j["text"] = nullptr;  // no tokenizer yet
    j["finish_reason"] = r.finish_reason;
    j["timings"] = {{"load_ms", load_ms},
                    {"prefill_ms", r.prefill_ms},
                    {"decode_ms", r.decode_ms},
                    {"n_prompt", r.n_prompt},
                    {"n_decoded", n_dec},
                    {"prefill_tokens_per_s", prefill_tps},
                    {"decode_tokens_per_s", decode_tps},
                    {"decode_weight_gb_per_s", decode_gbps}};
    j["spec"] = {{"mode", "ar"}, {"rounds", n_dec}, {"target_forwards", r.n_target_forwards},
                 {"mean_accepted_length", 1.0}, {"budget", nullptr}};
    j["sampling"] = {{"temperature", o.temp}, {"top_k", o.top_k}, {"top_p", o.top_p}, {"min_p", o.min_p}, {"seed", o.seed}};
    std::printf("%s\n", j.dump().c_str());
  }
  if (log_level() >= LogLevel::info) {
    std::fprintf(stderr, "\nload time    = %10.2f ms\n", load_ms);
    std::fprintf(stderr, "prompt eval  = %10.2f ms / %5lld tokens (%8.2f tokens/s)\n", r.prefill_ms, (long long)r.n_prompt, prefill_tps);
    std::fprintf(stderr, "eval time    = %10.2f ms / %5lld tokens (%8.2f tokens/s, %.2f GB/s of weights)\n", r.decode_ms,
                 (long long)n_dec, decode_tps, decode_gbps);
    std::fprintf(stderr, "finish       = %s\n", r.finish_reason.c_str());
  }
  return 0;
}

}  // namespace kd::cli
