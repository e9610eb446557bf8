// `kdtree ppl`: perplexity of a token stream with llama.cpp's convention (tools/perplexity/
// perplexity.cpp), and the KL divergence of a model's next-token distributions against a stored
// reference (its --kl-divergence), written once against a forward callback so the CPU model and the
// CUDA target share it.
//
// Convention (llama.cpp `perplexity`, default mode): the text is tokenized once (BOS first when the
// model adds one), cut into n_tokens / ctx non-overlapping chunks of ctx tokens (at least 2·ctx
// tokens are needed); each chunk runs from an empty cache with its first token replaced by BOS
// (when BOS is on); the predictions at positions ctx/2 … ctx−2 are scored — the second half, so
// every scored token sees at least ctx/2 of context: ctx − 1 − ctx/2 tokens per chunk.
// PPL = exp(mean nll); its standard error = PPL · sqrt((mean nll² − mean²) / (count − 1)).
// --stride S (llama.cpp `--ppl-stride`, its perplexity_v2): windows of ctx tokens starting every S
// tokens, each scoring its last S predictions; no BOS substitution (llama.cpp writes the BOS into
// its token array only after the decode, so its model never sees it either).
//
// KL (llama.cpp `--kl-divergence`): KL(base ‖ current) per scored token, with the base stored as its
// top-k log-probabilities plus the exact log-probability of the true token. The rest of the
// vocabulary is one "tail" bucket (mass 1 − Σ top-k on each side), so the reported KL is the KL of
// the coarse-grained distributions: never more than the true KL (log-sum inequality), short of it
// by p_tail · KL(base tail ‖ current tail). The tail mass is reported so the error can be judged.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kd {

struct PplWindow {
  int64_t start = 0;     // first token of the window in the stream
  int64_t first = 0;     // first scored position j in the window (its logits predict token j + 1)
  int64_t n_scored = 0;  // positions first … first + n_scored − 1
  bool bos = false;      // window token 0 is replaced by BOS
};

// The windows for n_tokens tokens. Throws kd::Error when the text is too short (fewer than 2·ctx
// tokens, as llama.cpp requires), ctx < 4, or the stride is out of [1, ctx − 1].
std::vector<PplWindow> ppl_windows(int64_t n_tokens, int64_t ctx, int64_t stride, bool bos);

// Running mean of nll and its standard error, llama.cpp's formulas.
struct NllStats {
  double sum = 0, sum2 = 0;
  int64_t count = 0;
  void add(double nll) { sum += nll, sum2 += nll * nll, ++count; }
  double mean() const { return count ? sum / double(count) : 0; }
  double ppl() const;
  double ppl_stderr() const;  // 0 when fewer than 2 values
};

// One row of logits [vocab] (fp32) scored against `target`: nll in double (log-sum-exp with the
// max subtracted), the argmax, and the k most likely ids with their log-probabilities (descending;
// ties broken by the lower id).
struct RowScore {
  double nll = 0;
  int32_t argmax = 0;
};
RowScore score_row(const float* logits, int64_t vocab, int32_t target, int32_t k, int32_t* topk_ids, float* topk_logprobs);

// KL(base ‖ current) of one position with the base as top-k + tail (see the header comment);
// p_diff = p_current(target) − p_base(target); tail = the base's mass outside its top-k.
struct KlRow {
  double kl = 0, p_diff = 0, tail = 0;
  bool same_top = false;
};
KlRow kl_row(const float* logits, int64_t vocab, int32_t target, double base_nll, const int32_t* base_ids,
             const float* base_logprobs, int32_t k);

// The stored reference: what --save-logits writes (a safetensors file; see save_ppl_logits).
struct PplLogits {
  int64_t ctx = 0, stride = 0, vocab = 0;
  int32_t k = 0;
  bool bos = false;
  int32_t bos_id = -1;
  std::string model;              // where it came from, for messages
  std::vector<int32_t> tokens;    // [n_tokens] the whole tokenized stream
  std::vector<int32_t> target;    // [n_scored]
  std::vector<double> nll;        // [n_scored]
  std::vector<int32_t> topk_ids;  // [n_scored, k]
  std::vector<float> topk_logprobs;  // [n_scored, k]
};
void save_ppl_logits(const std::string& path, const PplLogits& l);
PplLogits load_ppl_logits(const std::string& path);  // validates shapes, ids and values; errors name the file

struct PplOptions {
  int64_t ctx = 512, stride = 0;
  bool bos = false;
  int32_t bos_id = -1;
  int64_t max_windows = 0;    // score only the first N windows (llama.cpp --chunks); 0 = all
  int32_t top_k = 32;         // stored per position with --save-logits
  bool keep_logits = false;   // fill result.logits (for --save-logits)
  const PplLogits* base = nullptr;  // --kl-divergence: compare against it
};

struct Percentiles {
  double min = 0, p01 = 0, p1 = 0, p5 = 0, p10 = 0, median = 0, p90 = 0, p95 = 0, p99 = 0, p999 = 0, max = 0;
};
Percentiles percentiles(std::vector<double> v);  // llama.cpp's linear interpolation

struct KlSummary {
  double ppl_base = 0, ppl_base_err = 0, ln_ratio = 0, ln_ratio_err = 0, ppl_diff = 0, ppl_diff_err = 0, cor = 0;
  double kl_mean = 0, kl_err = 0;
  Percentiles kl;
  double same_top = 0, same_top_err = 0;
  double p_diff_mean = 0, p_diff_err = 0, p_diff_rms = 0;
  double tail_mean = 0, tail_max = 0;
};

struct PplResult {
  NllStats nll;
  std::vector<double> running_ppl, running_err;  // after each window
  int64_t n_windows = 0, n_tokens = 0;
  double forward_ms = 0;
  PplLogits logits;  // keep_logits
  bool has_kl = false;
  KlSummary kl;
};

// forward(ids, n, logits): one fresh-cache forward over n tokens, logits [n, vocab] for every row.
using PplForward = std::function<void(const int32_t* ids, int64_t n, float* logits)>;
// on_window(i, n_windows, running): progress after each window.
PplResult run_perplexity(const std::vector<int32_t>& tokens, int64_t vocab, const PplOptions& o, const PplForward& forward,
                         const std::function<void(int64_t, int64_t, const NllStats&)>& on_window = {});

}  // namespace kd
