// `kdtree ppl`: perplexity over a text file, llama.cpp's convention, and KL divergence against a
// stored reference (model/perplexity.h). The target's forward is the same one `run` and DDTree's
// verify use (row invariance makes a verify row bit-identical to it), on the CPU or the GPU.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/device.h"
#include "kv/paged_kv.h"
#include "cli/int_flag.h"
#include "cli/quality_commands.h"
#include "core/error.h"
#include "core/log.h"
#include "core/untrusted.h"
#include "io/checkpoint.h"
#include "model/deepseek_v3.h"
#include "model/perplexity.h"
#include "tokenizer/tokenizer.h"

namespace kd::cli {

void add_ppl(CLI::App& app, PplCliOptions& o) {
  auto* c = app.add_subcommand(
      "ppl",
      "Perplexity of a text file (llama.cpp's convention: chunks of --ctx, the second half of each scored), and KL "
      "divergence / top-1 agreement against another model's saved distributions");
  c->add_option("-m,--model", o.model, "Checkpoint directory (with its tokenizer)")->required();
  c->add_option("-f,--file", o.file, "Text file to score (tokenized with the checkpoint's tokenizer, special-token names as text)")->required();
  c->add_option("-c,--ctx", o.ctx, "Tokens per chunk (default 512, as llama-perplexity)")->transform(whole_number(o.ctx));
  c->add_option("--stride", o.stride,
                "Sliding windows of --ctx every S tokens, each scoring its last S tokens (llama.cpp's --ppl-stride; no BOS "
                "substitution); 0 = non-overlapping chunks (default)")
      ->transform(whole_number(o.stride));
  c->add_option("--chunks", o.chunks, "Score only the first N chunks/windows (0 = all)")->transform(whole_number(o.chunks));
  c->add_option("--bos", o.bos,
                "Replace each chunk's first token by BOS and start the text with it: on, off, or auto (default: what the "
                "tokenizer_config.json's add_bos_token says; off when it says nothing, as kdtree run -p)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  c->add_option("--device", o.device, "cpu (default) or cuda (GPU 0)");
  c->add_option("--save-logits", o.save_logits,
                "Write this model's per-token distributions (top-k log-probabilities + the true token's exact nll) to a "
                "safetensors file, the reference for --kl-divergence");
  c->add_option("--top-k", o.top_k, "Log-probabilities kept per token by --save-logits (default 32; the rest is one tail bucket)")
      ->transform(whole_number(o.top_k))
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--kl-divergence", o.kl_base,
                "Compare against a --save-logits file of a reference model (same text, --ctx, --stride, BOS): KL(ref ‖ this) "
                "mean and percentiles, top-1 agreement, Δp, PPL ratio and Δppl");
  c->add_flag("--json", o.json, "Print one JSON object on stdout");
}

namespace {

bool tokenizer_adds_bos(const std::string& dir) {
  const std::string p = dir + "/tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(p, ec)) return false;
  const nlohmann::json j = read_json_file(p);
  auto it = j.find("add_bos_token");
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

nlohmann::ordered_json percentiles_json(const Percentiles& p) {
  return {{"max", p.max}, {"99.9%", p.p999}, {"99%", p.p99}, {"95%", p.p95}, {"90%", p.p90}, {"median", p.median},
          {"10%", p.p10}, {"5%", p.p5}, {"1%", p.p1}, {"0.1%", p.p01}, {"min", p.min}};
}

}  // namespace

int cmd_ppl(const PplCliOptions& o) {
  use_cuda(o.device);  // a bad --device fails before the text is read
  if (o.ctx < 4) fail("--ctx ", o.ctx, ": the context must be at least 4 tokens");
  if (!o.save_logits.empty() && !o.kl_base.empty() && o.save_logits == o.kl_base)
    fail("--save-logits and --kl-divergence name the same file");
  const double t0 = now_s();
  std::error_code ec;
  if (!std::filesystem::exists(o.model + "/tiktoken.model", ec) && !std::filesystem::exists(o.model + "/tokenizer.json", ec))
    fail(o.model, ": no tokenizer (tiktoken.model or tokenizer.json): ppl scores text, so it needs the checkpoint's tokenizer");
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(o.model);
  const std::string text = read_text_file(o.file, size_t(1) << 30);
  if (text.empty()) fail(o.file, ": the file is empty");
  const LoadedTarget lt(o.device, o.model);
  const Target& target = lt.target();
  const ModelConfig& cfg = lt.config();
  if (o.ctx > cfg.max_position_embeddings)
    fail("--ctx ", o.ctx, " is more than the model's max_position_embeddings = ", cfg.max_position_embeddings);

  PplOptions po;
  po.ctx = o.ctx;
  po.stride = o.stride;
  po.bos = o.bos == "on" || (o.bos == "auto" && tokenizer_adds_bos(o.model));
  po.bos_id = cfg.bos_token_id;
  if (po.bos && po.bos_id < 0) fail(o.model, "/config.json: no bos_token_id, so --bos on cannot be honoured");
  po.top_k = o.top_k;
  po.keep_logits = !o.save_logits.empty();
  PplLogits base;
  if (!o.kl_base.empty()) {
    base = load_ppl_logits(o.kl_base);
    po.base = &base;
  }
  std::vector<int32_t> tokens;
  if (po.bos) tokens.push_back(po.bos_id);
  const std::vector<int32_t> enc = tok->encode(text, /*parse_special=*/false);
  tokens.insert(tokens.end(), enc.begin(), enc.end());
  po.max_windows = o.chunks;
  const int64_t vocab = cfg.vocab_size;

  // Each window: a fresh sequence over one KV block of --ctx rows, in the target's prefill form
  // (the CPU: expanded, as `run` prefills).
  target.init_kv(1, o.ctx);
  KvPool pool(cfg.num_hidden_layers, cfg.latent_dim(), o.ctx, 1, target.host_kv());
  const std::vector<int32_t> table = {pool.allocate()};
  const PplForward forward = [&](const int32_t* ids, int64_t n, float* logits) {
    std::vector<SeqForward> one(1);
    one[0].kv = pool.view(table);
    one[0].args.ids = ids;
    one[0].args.n = n;
    one[0].args.form = target.prefill_form();
    one[0].args.all_logits = true;
    one[0].args.logits = logits;
    target.forward_batch(one);
  };
  const double load_ms = (now_s() - t0) * 1e3;
  log_info("ppl: ", tokens.size(), " tokens, --ctx ", o.ctx, o.stride ? cat(" --stride ", o.stride) : std::string(),
           ", BOS ", po.bos ? "on" : "off", ", ", o.device);
  std::unique_ptr<Progress> bar;
  const PplResult r = run_perplexity(tokens, vocab, po, forward, [&](int64_t i, int64_t n, const NllStats& s) {
    if (!bar) bar = std::make_unique<Progress>("ppl", uint64_t(n), "chunks");
    bar->add(1);
    log_debug("[", i + 1, "/", n, "] ppl ", s.ppl(), " ± ", s.ppl_stderr());
    if (log_level() >= LogLevel::info && (i + 1 == n || (i + 1) % std::max<int64_t>(1, n / 10) == 0))
      std::fprintf(stderr, "  [%lld/%lld] PPL = %.4f ± %.4f\n", (long long)(i + 1), (long long)n, s.ppl(), s.ppl_stderr());
  });
  if (bar) bar->finish();
  if (po.keep_logits) {
    PplLogits l = r.logits;
    l.model = o.model;
    save_ppl_logits(o.save_logits, l);
  }
  const int64_t scored = r.nll.count;
  const double tps = r.forward_ms > 0 ? double(r.n_windows * o.ctx) / r.forward_ms * 1e3 : 0;
  if (o.json) {
    nlohmann::ordered_json j;
    j["model"] = o.model;
    j["file"] = o.file;
    j["convention"] = o.stride ? "llama.cpp perplexity --ppl-stride (windows every stride tokens, last stride scored)"
                               : "llama.cpp perplexity (chunks of ctx, second half scored, BOS per chunk)";
    j["ctx"] = o.ctx;
    j["stride"] = o.stride;
    j["bos"] = po.bos;
    j["n_tokens"] = r.n_tokens;
    j["n_chunks"] = r.n_windows;
    j["n_scored"] = scored;
    j["ppl"] = r.nll.ppl();
    j["ppl_stderr"] = r.nll.ppl_stderr();
    j["nll_mean"] = r.nll.mean();
    j["running_ppl"] = r.running_ppl;
    j["timings"] = {{"load_ms", load_ms}, {"forward_ms", r.forward_ms}, {"tokens_per_s", tps}};
    if (!o.save_logits.empty()) j["saved"] = {{"file", o.save_logits}, {"top_k", std::min<int64_t>(o.top_k, vocab)}};
    if (r.has_kl) {
      const KlSummary& k = r.kl;
      j["kl"] = {{"reference", o.kl_base},
                 {"reference_top_k", base.k},
                 {"ppl_base", k.ppl_base},
                 {"ppl_base_stderr", k.ppl_base_err},
                 {"cor_ln_ppl", k.cor},
                 {"ln_ppl_ratio", k.ln_ratio},
                 {"ln_ppl_ratio_stderr", k.ln_ratio_err},
                 {"delta_ppl", k.ppl_diff},
                 {"delta_ppl_stderr", k.ppl_diff_err},
                 {"kl_mean", k.kl_mean},
                 {"kl_stderr", k.kl_err},
                 {"kl_percentiles", percentiles_json(k.kl)},
                 {"top1_agreement", k.same_top},
                 {"top1_agreement_stderr", k.same_top_err},
                 {"delta_p_mean", k.p_diff_mean},
                 {"delta_p_stderr", k.p_diff_err},
                 {"delta_p_rms", k.p_diff_rms},
                 {"reference_tail_mass_mean", k.tail_mean},
                 {"reference_tail_mass_max", k.tail_max}};
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("Final estimate: PPL = %.4f +/- %.5f  (%lld tokens scored in %lld chunks of %lld)\n", r.nll.ppl(),
              r.nll.ppl_stderr(), (long long)scored, (long long)r.n_windows, (long long)o.ctx);
  if (r.has_kl) {
    const KlSummary& k = r.kl;
    std::printf("====== Perplexity statistics ======\n");
    std::printf("Mean PPL(Q)                   : %10.6f ± %10.6f\n", r.nll.ppl(), r.nll.ppl_stderr());
    std::printf("Mean PPL(base)                : %10.6f ± %10.6f\n", k.ppl_base, k.ppl_base_err);
    std::printf("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%\n", 100 * k.cor);
    std::printf("Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f\n", k.ln_ratio, k.ln_ratio_err);
    std::printf("Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f\n", k.ppl_diff, k.ppl_diff_err);
    std::printf("====== KL divergence statistics (reference top-%d + tail; mean tail mass %.2e, max %.2e) ======\n", base.k,
                k.tail_mean, k.tail_max);
    std::printf("Mean    KLD: %10.6f ± %10.6f\n", k.kl_mean, k.kl_err);
    std::printf("Maximum KLD: %10.6f\n99.9%%   KLD: %10.6f\n99.0%%   KLD: %10.6f\n95.0%%   KLD: %10.6f\n", k.kl.max, k.kl.p999,
                k.kl.p99, k.kl.p95);
    std::printf("Median  KLD: %10.6f\n 1.0%%   KLD: %10.6f\nMinimum KLD: %10.6f\n", k.kl.median, k.kl.p1, k.kl.min);
    std::printf("====== Token probability statistics ======\n");
    std::printf("Mean    Δp: %6.3f ± %5.3f %%\nRMS Δp    : %6.3f %%\n", 100 * k.p_diff_mean, 100 * k.p_diff_err, 100 * k.p_diff_rms);
    std::printf("Same top p: %6.3f ± %5.3f %%\n", 100 * k.same_top, 100 * k.same_top_err);
  }
  log_info("forward: ", r.forward_ms, " ms for ", r.n_windows, " chunks (", tps, " tokens/s), load ", load_ms, " ms");
  return 0;
}

}  // namespace kd::cli
