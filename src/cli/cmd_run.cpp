// `kdtree run`: load a checkpoint, generate from a prompt, print tokens (or one JSON object).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/device.h"
#include "cli/int_flag.h"
#include "core/error.h"
#include "core/log.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "engine/generate.h"
#include "model/dflash.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"
#include "decode/synthetic_drafter.h"

namespace kd::cli {

namespace {
constexpr int64_t kDefaultSyntheticBlock = 8;
}

void add_run(CLI::App& app, RunOptions& o) {
  auto* c = app.add_subcommand("run", "Generate tokens from a prompt");
  c->add_option("-m,--model", o.model, "Checkpoint directory (config.json + *.safetensors)")->required();
  c->add_option("-p,--prompt", o.prompt, "Prompt text, encoded with the checkpoint's tokenizer (no BOS is added)");
  c->add_option("--chat", o.chat, "A user message, rendered with the model's chat template (Kimi or DeepSeek-V3)");
  c->add_option("--system", o.system, "System message for --chat (default: the template's own)");
  c->add_option("--template", o.chat_template,
                "Chat template for --chat instead of the checkpoint's: kimi, kimi-k2-thinking, kimi-k25, kimi-k26, deepseek-v3")
      ->check(CLI::IsMember({"kimi", "kimi-k2-thinking", "kimi-k25", "kimi-k26", "deepseek-v3"}));
  c->add_option("--thinking", o.thinking, "Thinking toggle for --chat on thinking models (chat_template_kwargs.thinking)")
      ->check(CLI::IsMember({"on", "off"}));
  c->add_flag("--parse-special", o.parse_special, "Let special-token names in -p text become special tokens");
  c->add_option("--prompt-ids", o.prompt_ids, "Prompt as comma-separated token ids, e.g. 163584,1,2");
  c->add_option("-n,--n-predict", o.n_predict, "Tokens to generate (stops earlier at an EOS id)")
      ->transform(whole_number(o.n_predict))
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  c->add_option("-c,--ctx-size", o.ctx_size, "Context limit in tokens (0 = the model's max_position_embeddings)")
      ->transform(whole_number(o.ctx_size))
      ->check(CLI::NonNegativeNumber);
  c->add_option("--temp", o.temp, "Sampling temperature; 0 = greedy (default)");
  c->add_option("--top-k", o.top_k, "Keep the k most likely tokens (0 = off)")->transform(whole_number(o.top_k));
  c->add_option("--top-p", o.top_p, "Nucleus sampling: keep the smallest set with this much probability (1 = off)");
  c->add_option("--min-p", o.min_p, "Drop tokens below min-p × the top token's probability (0 = off)");
  c->add_option("-s,--seed", o.seed,
                "Sampling seed in [0, 2^64 − 1]: the token at position p uses Philox(seed, p), so runs are reproducible")
      ->transform(whole_number(o.seed));
  c->add_flag("--ignore-eos", o.ignore_eos, "Do not stop at the model's EOS ids");
  c->add_option("--spec", o.spec,
                 "Decoder: ar (plain autoregressive), ddtree (tree speculation) or dflash (the drafter's top-1 chain)")
      ->check(CLI::IsMember({"ar", "ddtree", "dflash"}));
  c->add_option("--draft", o.draft,
                "Drafter for --spec ddtree/dflash: a DFlash checkpoint directory, or synthetic:PROFILE — a stand-in that "
                "knows the target's continuation (it runs AR first) and ranks the true token r-th with the given "
                "probabilities, e.g. synthetic:0.7,0.2 or synthetic:oracle; for measurement only");
  add_draft_yarn_flag(c, o.draft_yarn_legacy_mscale);
  add_budget_flags(c, o.budget);
  o.block_size = 0;  // 0: not given; a synthetic drafter then uses kDefaultSyntheticBlock
  c->add_option("--block-size", o.block_size,
                cat("Block size of a synthetic drafter (default ", kDefaultSyntheticBlock,
                    "); a DFlash drafter brings its own, and a different value here is an error"))
      ->transform(whole_number(o.block_size))
      ->check(CLI::Range(int64_t(2), kMaxDFlashBlockSize));
  c->add_option("--device", o.device, "cpu (default) or cuda (the target and a DFlash drafter on GPU 0)");
  add_tp_flags(c, o.tp);
  c->add_option("--decode-attn", o.decode_attn, "MLA form for decode steps: absorbed (default, over the latent cache) or expanded")
      ->check(CLI::IsMember({"absorbed", "expanded"}));
  c->add_flag("--json", o.json, "Print exactly one JSON object on stdout (ids, finish reason, timings; with --spec "
                                 "the round statistics, and spec.round_tau: each round's τ, the tokens it committed)");
  c->add_option("--json-rounds", o.json_rounds,
                "With --json and --spec: tau (default) reports spec.round_tau only; full adds spec.round_trees, per "
                "round its start position (the root, the bonus token before it), the draft tree — tokens (root first; "
                "the rest drafted), parents, depths — and the accepted path of node indices (τ = its length), so "
                "acceptance can be compared with another implementation round for round")
      ->check(CLI::IsMember({"tau", "full"}));
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
  const bool cuda = use_cuda(o.device);
  if (cuda && o.decode_attn == "expanded")
    fail("--decode-attn expanded: the CUDA backend runs the absorbed MLA form only (the same function); drop the flag");
  const bool spec = o.spec == "ddtree" || o.spec == "dflash";
  if (o.spec != "ar" && !spec) fail("--spec ", o.spec, ": unknown decoder (choose ar, ddtree or dflash)");
  if (spec && o.draft.empty())
    fail("--spec ", o.spec, " needs --draft DIR (a DFlash drafter) or --draft synthetic:PROFILE (e.g. synthetic:oracle)");
  if (!spec && !o.draft.empty()) fail("--draft only applies to --spec ddtree or dflash");
  check_budget_flags(o.budget, o.spec);
  if (o.json_rounds == "full" && (!spec || !o.json)) fail("--json-rounds full needs --json and --spec ddtree or dflash");
  const bool synthetic = spec && o.draft.rfind("synthetic:", 0) == 0;
  if (o.draft_yarn_legacy_mscale && (!spec || synthetic))
    fail("--draft-yarn-legacy-mscale only applies to a DFlash drafter (--spec ddtree/dflash --draft DIR)");
  if (o.block_size != 0 && !spec) fail("--block-size only applies to --spec ddtree or dflash");
  if (o.block_size != 0 && !synthetic) {
    // A DFlash drafter was trained for one block size: refuse a different one rather than ignore it.
    std::error_code ec;
    if (std::filesystem::exists(o.draft + "/config.json", ec)) {
      const DFlashConfig dc = load_dflash_config(o.draft);
      if (dc.block_size != o.block_size)
        fail("--block-size ", o.block_size, " differs from the drafter's block_size = ", dc.block_size, " (", o.draft,
             "/config.json): a DFlash drafter drafts the block it was trained for; drop --block-size");
    }
  }
  const int64_t synthetic_block = o.block_size ? o.block_size : kDefaultSyntheticBlock;
  const int n_prompts = int(!o.prompt.empty()) + int(!o.prompt_ids.empty()) + int(!o.chat.empty());
  if (n_prompts > 1) fail("give one of --prompt, --chat or --prompt-ids");
  if (n_prompts == 0) fail("no prompt: pass -p TEXT, --chat MESSAGE or --prompt-ids 1,2,3");
  if ((!o.system.empty() || !o.thinking.empty() || !o.chat_template.empty()) && o.chat.empty())
    fail("--system, --thinking and --template only apply to --chat");
  // The tokenizer is needed for text in or out; a checkpoint without one still runs on ids.
  std::unique_ptr<Tokenizer> tok;
  const bool has_tokenizer = std::filesystem::exists(o.model + "/tiktoken.model") || std::filesystem::exists(o.model + "/tokenizer.json");
  if (has_tokenizer) tok = load_tokenizer(o.model);
  if (!tok && o.prompt_ids.empty())
    fail(o.model, ": no tokenizer (tiktoken.model or tokenizer.json) for a text prompt: pass token ids with --prompt-ids");
  std::vector<int32_t> prompt;
  std::vector<int32_t> chat_stops;
  if (!o.prompt_ids.empty()) {
    prompt = parse_ids(o.prompt_ids);
  } else if (!o.prompt.empty()) {
    prompt = tok->encode(o.prompt, o.parse_special);
  } else {
    ChatTemplateKind kind;
    if (!o.chat_template.empty()) {
      kind = chat_template_kind_from_name(o.chat_template);
    } else {
      const ChatTemplateChoice choice = chat_template_for_checkpoint(o.model);
      if (!choice.warning.empty()) std::fprintf(stderr, "kdtree: warning: %s\n", choice.warning.c_str());
      kind = choice.kind;
    }
    std::vector<ChatMessage> msgs;
    if (!o.system.empty()) msgs.push_back({"system", o.system, "", "", {}, ""});
    msgs.push_back({"user", o.chat, "", "", {}, ""});
    ChatOptions co;
    if (!o.thinking.empty()) co.thinking = o.thinking == "on";
    prompt = tok->encode(render_chat(kind, msgs, co), /*parse_special=*/true);
    for (const auto& name : chat_stop_tokens(kind))
      if (auto id = tok->special_id(name)) chat_stops.push_back(*id);
  }

  GenerateOptions g;
  g.max_new_tokens = o.n_predict;
  g.sampling = {o.temp, o.top_k, o.top_p, o.min_p, o.seed};
  validate(g.sampling);
  g.ignore_eos = o.ignore_eos;
  g.keep_logits = !o.dump_logits.empty();
  g.decode_form = o.decode_attn == "expanded" ? AttnForm::expanded : AttnForm::absorbed;
  g.context = o.ctx_size;

  const double t0 = now_s();
  // On GPUs the memory plan must hold the prompt and -n new tokens of KV beside the weights.
  const LoadedTarget lt(o.device, o.model, o.tp, int64_t(prompt.size()) + o.n_predict + 1);
  const Target& target = lt.target();
  const ModelConfig& cfg = lt.config();
  g.stop_ids = cfg.eos_token_ids;
  g.stop_ids.insert(g.stop_ids.end(), chat_stops.begin(), chat_stops.end());
  if (tok && tok->vocab_size() > cfg.vocab_size)
    fail(o.model, ": the tokenizer has ", tok->vocab_size(), " ids but the model's vocabulary holds ", cfg.vocab_size);
  std::unique_ptr<Drafter> drafter;
  const std::string kSynthetic = "synthetic:";
  if (spec && o.draft.rfind(kSynthetic, 0) != 0) {
    // DFlash: on the GPU beside a GPU target, fed from its taps on the device.
    const int64_t ctx = o.ctx_size > 0 ? o.ctx_size : cfg.max_position_embeddings;
    DFlashLoadOptions dopt;
    dopt.yarn_legacy_mscale = o.draft_yarn_legacy_mscale;
    drafter = lt.dflash_drafters(o.draft, std::min<int64_t>(ctx, int64_t(prompt.size()) + o.n_predict + 1), dopt).first;
  }
  auto run_ar = [&](const GenerateOptions& go, const std::function<void(int32_t)>& cb) { return generate_ar(target, prompt, go, cb); };
  const double load_ms = (now_s() - t0) * 1e3;
  log_info("loaded ", o.model, " (", cfg.model_type, ", ", cfg.num_hidden_layers, " layers) in ",
           load_ms, " ms");

  if (spec && !drafter) {
    // The synthetic drafter needs the target's own continuation: a plain AR run with the same
    // settings, first. Its time is not counted in the speculative timings.
    const std::vector<double> profile = SyntheticDrafter::parse_profile(o.draft.substr(kSynthetic.size()));
    log_info("synthetic drafter: running AR first to learn the target's continuation …");
    GenerateOptions ga = g;
    ga.keep_logits = false;
    GenerateResult ar = run_ar(ga, {});
    std::vector<int32_t> truth = prompt;
    truth.insert(truth.end(), ar.output_ids.begin(), ar.output_ids.end());
    drafter = std::make_unique<SyntheticDrafter>(std::move(truth), profile, synthetic_block, cfg.vocab_size, o.seed);
  }

  // Streaming: text through a StreamDecoder (partial UTF-8 held back) when there is a tokenizer,
  // else the ids.
  const bool stream = !o.json;
  std::unique_ptr<StreamDecoder> sd;
  if (tok) sd = std::make_unique<StreamDecoder>(*tok);
  auto on_token = [&](int32_t id) {
    if (!stream) return;
    if (sd) {
      const std::string piece = sd->push(id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
    } else {
      std::printf("%d ", id);
    }
    std::fflush(stdout);
  };
  GenerateResult r;
  SpecStats st;
  SpecOptions so;
  apply_budget_flags(o.budget, o.spec, so);
  so.record_trees = o.json_rounds == "full";
  if (spec) {
    SpecResult sr = generate_ddtree(target, *drafter, prompt, g, so, on_token);
    r = std::move(sr.gen);
    st = std::move(sr.stats);
  } else {
    r = run_ar(g, on_token);
  }
  if (stream) {
    if (sd) {
      const std::string tail = sd->flush();
      std::fwrite(tail.data(), 1, tail.size(), stdout);
    }
    std::printf("\n");
  }

  if (!o.dump_logits.empty()) {
    SafetensorsWriter w;
    const int64_t steps = int64_t(r.output_ids.size());
    w.add_bytes("logits", DType::F32, {steps, cfg.vocab_size}, r.logits.data());
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
    if (tok)
      j["text"] = tok->decode(r.output_ids);  // invalid UTF-8 becomes U+FFFD
    else
      j["text"] = nullptr;  // the checkpoint has no tokenizer
    j["finish_reason"] = r.finish_reason;
    j["timings"] = {{"load_ms", load_ms},
                    {"prefill_ms", r.prefill_ms},
                    {"decode_ms", r.decode_ms},
                    {"n_prompt", r.n_prompt},
                    {"n_decoded", n_dec},
                    {"prefill_tokens_per_s", prefill_tps},
                    {"decode_tokens_per_s", decode_tps},
                    {"decode_weight_gb_per_s", decode_gbps}};
    if (spec) {
      j["spec"] = {{"mode", o.spec}, {"drafter", drafter->name()}, {"block_size", drafter->block_size()},
                   {"rounds", st.rounds}, {"target_forwards", st.target_forwards},
                   {"mean_accepted_length", st.mean_tau()}, {"tau_histogram", st.tau_histogram},
                   {"drafted", st.drafted}, {"accepted", st.accepted},
                   {"budget", budget_field(o.spec, so)},
                   {"draft_ms", st.draft_ms}, {"verify_ms", st.verify_ms}, {"round_tau", st.round_tau}};
      j["spec"].update(budget_report_json(so, st));
      if (o.json_rounds == "full") {
        nlohmann::ordered_json rounds = nlohmann::ordered_json::array();
        for (const SpecRoundTree& t : st.round_trees)
          rounds.push_back({{"start", t.start}, {"tau", t.path.size()}, {"tokens", t.tokens}, {"parents", t.parents},
                            {"depths", t.depths}, {"path", t.path}});
        j["spec"]["round_trees"] = std::move(rounds);
      }
    } else {
      j["spec"] = {{"mode", "ar"}, {"rounds", n_dec}, {"target_forwards", r.n_target_forwards},
                   {"mean_accepted_length", 1.0}, {"budget", nullptr}};
    }
    j["sampling"] = {{"temperature", o.temp}, {"top_k", o.top_k}, {"top_p", o.top_p}, {"min_p", o.min_p}, {"seed", o.seed}};
    std::printf("%s\n", j.dump().c_str());
  }
  if (log_level() >= LogLevel::info) {
    std::fprintf(stderr, "\nload time    = %10.2f ms\n", load_ms);
    std::fprintf(stderr, "prompt eval  = %10.2f ms / %5lld tokens (%8.2f tokens/s)\n", r.prefill_ms, (long long)r.n_prompt, prefill_tps);
    std::fprintf(stderr, "eval time    = %10.2f ms / %5lld tokens (%8.2f tokens/s, %.2f GB/s of weights)\n", r.decode_ms,
                 (long long)n_dec, decode_tps, decode_gbps);
    if (spec) {
      std::fprintf(stderr, "decoder      = %s, drafter %s\n", o.spec.c_str(), drafter->name().c_str());
      std::fprintf(stderr, "rounds       = %lld (%lld target forwards incl. prefill), mean accepted length τ = %.3f\n",
                   (long long)st.rounds, (long long)st.target_forwards, st.mean_tau());
      std::fprintf(stderr, "drafted      = %lld nodes, accepted %lld; draft %.1f ms, verify %.1f ms\n", (long long)st.drafted,
                   (long long)st.accepted, st.draft_ms, st.verify_ms);
      std::string hist;
      for (size_t t = 1; t < st.tau_histogram.size(); ++t) hist += cat(t > 1 ? " " : "", "τ", t, ":", st.tau_histogram[t]);
      std::fprintf(stderr, "τ histogram  = %s\n", hist.c_str());
      print_budget_report(stderr, so, st);
    }
    std::fprintf(stderr, "finish       = %s\n", r.finish_reason.c_str());
  }
  return 0;
}

}  // namespace kd::cli
