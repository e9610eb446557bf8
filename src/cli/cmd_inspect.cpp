// `kdtree inspect`: what a checkpoint is and what it costs to run, from config.json and the
// safetensors headers only (no tensor data is read).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/int_flag.h"
#include "core/error.h"
#include "core/untrusted.h"
#include "io/checkpoint.h"
#include "model/tensor_plan.h"
#include "model/tp_plan.h"

namespace kd::cli {

void add_inspect(CLI::App& app, InspectOptions& o) {
  auto* c = app.add_subcommand("inspect", "Print a model's architecture, sizes and memory needs without reading weights");
  auto* m = c->add_option("-m,--model", o.model, "Checkpoint directory");
  auto* p = c->add_option("--preset", o.preset, "A built-in shape instead of a directory (tiny, small, medium, k2)");
  auto* f = c->add_option("--config", o.config, "A config.json instead of a directory");
  m->excludes(p, f);
  p->excludes(f);
  c->add_option("--ctx", o.ctx, "Context length for the memory estimate")
      ->transform(whole_number(o.ctx))
      ->check(CLI::PositiveNumber);
  c->add_flag("--json", o.json, "Print one JSON object");
  c->add_option("--tp,--tensor-parallel", o.tp,
                 "Tensor-parallel ranks R (one GPU each): print the per-GPU memory plan (weights per rank, KV per "
                 "token per rank, a workspace estimate, how many KV tokens fit) and say whether it fits --ctx tokens in "
                 "--gpu-memory-limit; R must divide the heads and the MLP slices (K2: 1, 2, 4, 8, 16, 32, 64)")
      ->transform(whole_number(o.tp))
      ->check(CLI::PositiveNumber);
  c->add_option("--gpu-memory-limit,--gpu-memory", o.gpu_memory_gib,
                "GiB kdtree may use on each GPU, as run / serve / bench --gpu-memory-limit take it: the per-GPU plan "
                "(at --tp R, else for one GPU) is checked against it (default with --tp: 139, an H200). A plan that does "
                "not fit is printed, then refused (exit 1) with the numbers and what to do")
      ->check(CLI::PositiveNumber);
}

namespace {
std::string gb(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f GB", double(b) / 1e9);
  return buf;
}
std::string gib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(1ull << 30));
  return buf;
}
std::string count(int64_t n) {
  char buf[32];
  if (n >= 1000000000) std::snprintf(buf, sizeof buf, "%.4g B", double(n) / 1e9);
  else std::snprintf(buf, sizeof buf, "%.4g M", double(n) / 1e6);
  return buf;
}

// The --tp R plan, checked against the GPU before anything is printed: a plan that cannot hold the
// weights, the workspace and --ctx tokens of KV on each GPU is an Error with the numbers and a way out.
struct TpReport {
  TpPlan plan;
  TpMemory mem;
  std::string refusal;  // "" when the plan fits, else why not, with the numbers and what to do
};

// The GPU each rank may use: --gpu-memory-limit, else an H200's 139 GiB.
double gpu_gib(const InspectOptions& o) { return o.gpu_memory_gib > 0 ? o.gpu_memory_gib : 139.0; }
int32_t plan_ranks(const InspectOptions& o) { return o.tp > 0 ? o.tp : 1; }

TpReport tp_report(const ModelConfig& c, const InspectOptions& o) {
  const int32_t R = plan_ranks(o);
  const uint64_t gpu = uint64_t(gpu_gib(o) * double(1ull << 30));
  TpReport t{plan_tp(c, R), {}, ""};
  t.mem = tp_memory(c, t.plan, gpu);
  if (t.mem.kv_tokens_fit >= o.ctx) return t;
  const TpMemory& m = t.mem;
  const uint64_t kv_ctx = m.kv_bytes_per_token * uint64_t(o.ctx);
  std::string fix;
  TpMemory mr;
  if (const int32_t r = tp_ranks_that_fit(c, R, gpu, o.ctx, &mr))
    fix = cat("use more ranks: --tp ", r, " fits (", gb(mr.weight_bytes), " of weights a GPU, room for ", mr.kv_tokens_fit,
              " KV tokens)");
  if (m.kv_tokens_fit > 0) fix = cat("use less context: --ctx ", m.kv_tokens_fit, " or less fits at --tp ", R,
                                     fix.empty() ? "" : "; or ", fix);
  if (fix.empty()) fix = "no valid --tp fits this GPU: use GPUs with more memory";
  t.refusal = cat("inspect --tp ", R, ": the plan does not fit a ", gpu_gib(o), " GiB GPU (", gb(gpu), "): weights ",
                  gb(m.weight_bytes), " a rank + workspace ", gb(m.workspace_bytes), " (estimate) + KV ", gb(kv_ctx), " for ", o.ctx,
                  " tokens (", m.kv_bytes_per_token, " B a token, latent on every rank) = ",
                  gb(m.weight_bytes + m.workspace_bytes + kv_ctx), " a GPU; ", fix);
  return t;
}

nlohmann::ordered_json tp_json(const ModelConfig& c, const TpReport& t, const InspectOptions& o) {
  const TpPlan& p = t.plan;
  nlohmann::ordered_json by_split;
  for (TpSplit s : {TpSplit::replicated, TpSplit::rows, TpSplit::cols, TpSplit::vocab}) {
    int64_t n = 0;
    for (const auto& tt : p.tensors) n += tt.split == s;
    by_split[tp_split_name(s)] = n;
  }
  return {{"ranks", p.ranks},
          {"heads_per_rank", p.heads_per_rank},
          {"moe_intermediate_per_rank", p.moe_intermediate_per_rank},
          {"shared_intermediate_per_rank", p.shared_intermediate_per_rank},
          {"dense_intermediate_per_rank", p.dense_intermediate_per_rank},
          {"vocab_rows_per_rank", p.vocab_rows_per_rank},
          {"vocab_rows_last_rank", p.vocab_rows(p.ranks - 1)},
          {"tensors_by_split", by_split},
          {"weight_bytes_per_rank", t.mem.weight_bytes},
          {"weight_bytes_by_rank", p.weight_bytes_by_rank},
          {"replicated_bytes", p.replicated_bytes},
          {"kv_bytes_per_token_per_rank", p.kv_bytes_per_token_per_rank_bf16},
          {"workspace", {{"bytes", t.mem.workspace_bytes}, {"fixed_bytes", kTpWorkspaceFixedBytes}, {"rows", kTpWorkspaceRows},
                         {"bytes_per_row", tp_activation_bytes_per_row(c, p)}, {"estimate", true}}},
          {"gpu_memory_bytes", t.mem.gpu_bytes},
          {"kv_tokens_fit", t.mem.kv_tokens_fit},
          {"ctx", o.ctx},
          {"fits", t.refusal.empty()},
          {"refusal", t.refusal},
          {"reductions_per_step", p.reductions_per_step},
          {"reduction_values_per_row", p.reduction_values_per_row},
          {"reduction_bytes_per_row", p.reduction_bytes_per_row}};
}

void print_tp(const ModelConfig& c, const TpReport& t, const InspectOptions& o) {
  const TpPlan& p = t.plan;
  const TpMemory& m = t.mem;
  std::printf("tp            %d ranks: %lld heads, expert slice %lld (INT4 group %d), shared %lld, dense %lld, lm_head %lld vocab rows a rank",
              p.ranks, (long long)p.heads_per_rank, (long long)p.moe_intermediate_per_rank, p.group,
              (long long)p.shared_intermediate_per_rank, (long long)p.dense_intermediate_per_rank, (long long)p.vocab_rows_per_rank);
  if (p.vocab_rows(p.ranks - 1) != p.vocab_rows_per_rank) std::printf(" (the last %lld)", (long long)p.vocab_rows(p.ranks - 1));
  std::printf("\n");
  std::printf("  split       rows by head: q_b_proj, kv_b_proj; columns: o_proj; MLPs: gate/up rows, down columns; lm_head by vocabulary\n");
  std::printf("  replicated  embedding, norms, q_a_proj, kv_a_proj_with_mqa (the latent), router: %s on every rank\n",
              gb(p.replicated_bytes).c_str());
  std::printf("per GPU       weights %s, KV %llu B a token (latent on every rank), workspace %s (estimate: %s fixed + %lld rows × %llu B)\n",
              gb(m.weight_bytes).c_str(), (unsigned long long)m.kv_bytes_per_token, gb(m.workspace_bytes).c_str(),
              gib(kTpWorkspaceFixedBytes).c_str(), (long long)kTpWorkspaceRows, (unsigned long long)tp_activation_bytes_per_row(c, p));
  std::printf("%s %g GiB (%s) a GPU: %lld KV tokens beside weights and workspace (--ctx %lld asked)%s\n",
              t.refusal.empty() ? "fits         " : "DOES NOT FIT ", gpu_gib(o), gb(m.gpu_bytes).c_str(), (long long)m.kv_tokens_fit,
              (long long)o.ctx, t.refusal.empty() ? "" : ": refused (see the error below)");
  std::printf("reductions    %lld a step (2 a layer: after o_proj, after the MLP), %lld fp32 = %llu B a row each\n",
              (long long)p.reductions_per_step, (long long)p.reduction_values_per_row, (unsigned long long)p.reduction_bytes_per_row);
}
}  // namespace

int cmd_inspect(const InspectOptions& o) {
  ModelConfig c;
  std::unique_ptr<Checkpoint> ck;
  std::string source;
  if (!o.model.empty()) {
    ck = std::make_unique<Checkpoint>(o.model);
    c = ck->config();
    source = o.model;
  } else if (!o.preset.empty()) {
    c = parse_model_config(preset_config_json(o.preset), "preset " + o.preset);
    source = "preset " + o.preset;
  } else if (!o.config.empty()) {
    c = parse_model_config(read_text_file(o.config, kMaxConfigBytes), o.config);
    source = o.config;
  } else {
    fail("inspect needs -m DIR, --preset NAME or --config FILE");
  }
  const ModelStats s = model_stats(c);
  const uint64_t kv_ctx = s.kv_bytes_per_token_bf16 * uint64_t(o.ctx);
  std::optional<TpReport> tp;
  if (o.tp > 0 || o.gpu_memory_gib > 0) tp = tp_report(c, o);

  std::map<std::string, int64_t> by_dtype;
  int64_t unused = 0;
  if (ck) {
    std::map<std::string, bool> planned;
    for (const auto& t : plan_tensors(c)) {
      if (t.int4) {
        for (const char* suf : {".weight_packed", ".weight_scale", ".weight_shape"}) planned[t.name + suf] = true;
      } else {
        planned[t.name] = true;
      }
    }
    for (const auto& [name, ref] : ck->tensors()) {
      by_dtype[std::string(dtype_name(ref.info->dtype))]++;
      if (!planned.count(name)) ++unused;
    }
  }

  if (o.json) {
    nlohmann::ordered_json j;
    j["source"] = source;
    j["architecture"] = c.architecture;
    j["model_type"] = c.model_type;
    j["tensor_prefix"] = c.tensor_prefix;
    j["layers"] = {{"total", c.num_hidden_layers}, {"dense", c.first_k_dense_replace}, {"moe", c.num_hidden_layers - c.first_k_dense_replace}};
    j["hidden_size"] = c.hidden_size;
    j["vocab_size"] = c.vocab_size;
    j["attention"] = {{"heads", c.num_attention_heads}, {"q_lora_rank", c.q_lora_rank}, {"kv_lora_rank", c.kv_lora_rank},
                      {"qk_nope_head_dim", c.qk_nope_head_dim}, {"qk_rope_head_dim", c.qk_rope_head_dim},
                      {"v_head_dim", c.v_head_dim}, {"softmax_scale", c.softmax_scale()}};
    j["rope"] = {{"theta", c.rope_theta}, {"yarn", c.rope.yarn}, {"factor", c.rope.factor}, {"beta_fast", c.rope.beta_fast},
                 {"beta_slow", c.rope.beta_slow}, {"attention_scaling", c.rope_attention_scaling()}};
    j["moe"] = {{"n_routed_experts", c.n_routed_experts}, {"num_experts_per_tok", c.num_experts_per_tok},
                {"n_shared_experts", c.n_shared_experts}, {"n_group", c.n_group}, {"topk_group", c.topk_group},
                {"routed_scaling_factor", c.routed_scaling_factor}};
    j["int4"] = {{"enabled", c.quant.enabled}, {"group_size", c.quant.group_size}, {"modules", s.int4_modules}};
    j["params"] = {{"total", s.total_params}, {"active", s.active_params}, {"active_with_embedding", s.active_params_with_embed}};
    j["bytes"] = {{"weights_stored", s.stored_bytes}, {"per_decoded_token", s.bytes_per_token},
                  {"kv_per_token_bf16", s.kv_bytes_per_token_bf16}, {"kv_per_token_f32_cpu", s.kv_bytes_per_token_f32}};
    nlohmann::ordered_json roles;
    for (int r = 0; r < 9; ++r) roles[role_name(TensorRole(r))] = s.bytes_per_token_by_role[r];
    j["bytes"]["per_decoded_token_by_role"] = roles;
    j["memory"] = {{"ctx", o.ctx}, {"kv_bytes", kv_ctx}, {"total_bytes", s.stored_bytes + kv_ctx}};
    if (ck) j["checkpoint"] = {{"files", ck->files().size()}, {"bytes", ck->total_bytes()}, {"tensors", ck->tensors().size()},
                               {"tensors_by_dtype", by_dtype}, {"tensors_not_used", unused}};
    if (tp) j["tp"] = tp_json(c, *tp, o);
    std::printf("%s\n", j.dump(2).c_str());
    if (tp && !tp->refusal.empty()) fail(tp->refusal);  // the plan is on stdout; exit 1 says it does not fit
    return 0;
  }
  std::printf("source        %s\n", source.c_str());
  std::printf("architecture  %s (model_type %s, tensors under '%s')\n", c.architecture.c_str(), c.model_type.c_str(), c.tensor_prefix.c_str());
  std::printf("layers        %lld (%lld dense + %lld MoE), hidden %lld, vocab %lld\n", (long long)c.num_hidden_layers,
              (long long)c.first_k_dense_replace, (long long)(c.num_hidden_layers - c.first_k_dense_replace),
              (long long)c.hidden_size, (long long)c.vocab_size);
  std::printf("attention     MLA, %lld heads, q_lora %lld, kv_lora %lld, qk %lld+%lld, v %lld, softmax scale %.6f\n",
              (long long)c.num_attention_heads, (long long)c.q_lora_rank, (long long)c.kv_lora_rank,
              (long long)c.qk_nope_head_dim, (long long)c.qk_rope_head_dim, (long long)c.v_head_dim, c.softmax_scale());
  if (c.rope.yarn)
    std::printf("rope          YaRN θ=%g factor %g, beta %g/%g, original ctx %lld, max ctx %lld\n", c.rope_theta, c.rope.factor,
                c.rope.beta_fast, c.rope.beta_slow, (long long)c.rope.original_max_position_embeddings, (long long)c.max_position_embeddings);
  else
    std::printf("rope          θ=%g, max ctx %lld\n", c.rope_theta, (long long)c.max_position_embeddings);
  std::printf("moe           %lld routed experts, top-%lld, %lld shared, groups %lld/%lld, scaling %g\n",
              (long long)c.n_routed_experts, (long long)c.num_experts_per_tok, (long long)c.n_shared_experts,
              (long long)c.topk_group, (long long)c.n_group, c.routed_scaling_factor);
  if (c.quant.enabled)
    std::printf("int4          %lld Linear modules INT4 (group %d, compressed-tensors pack-quantized), %lld dense tensors\n",
                (long long)s.int4_modules, c.quant.group_size, (long long)s.dense_tensors);
  else
    std::printf("int4          none (all weights dense)\n");
  std::printf("params        %s total, %s active per token (%s with the embedding)\n", count(s.total_params).c_str(),
              count(s.active_params).c_str(), count(s.active_params_with_embed).c_str());
  std::printf("weights       %s as stored\n", gb(s.stored_bytes).c_str());
  std::printf("per token     %s of weights read per decoded token (batch 1):\n", gb(s.bytes_per_token).c_str());
  for (int r = 0; r < 9; ++r)
    if (s.bytes_per_token_by_role[r]) std::printf("                %-15s %s\n", role_name(TensorRole(r)), gb(s.bytes_per_token_by_role[r]).c_str());
  std::printf("kv cache      %llu B per token (bf16 latent, %lld values × %lld layers); %llu B on the CPU (fp32)\n",
              (unsigned long long)s.kv_bytes_per_token_bf16, (long long)c.latent_dim(), (long long)c.num_hidden_layers,
              (unsigned long long)s.kv_bytes_per_token_f32);
  std::printf("memory        %s weights + %s KV at %lld tokens = %s\n", gb(s.stored_bytes).c_str(), gb(kv_ctx).c_str(),
              (long long)o.ctx, gb(s.stored_bytes + kv_ctx).c_str());
  if (ck) {
    std::printf("checkpoint    %zu file(s), %s, %zu tensors (", ck->files().size(), gb(ck->total_bytes()).c_str(), ck->tensors().size());
    bool first = true;
    for (const auto& [d, n] : by_dtype) {
      std::printf("%s%lld %s", first ? "" : ", ", (long long)n, d.c_str());
      first = false;
    }
    std::printf("); %lld not used by the text model (e.g. vision)\n", (long long)unused);
  }
  if (tp) print_tp(c, *tp, o);
  if (tp && !tp->refusal.empty()) {
    std::fflush(stdout);
    fail(tp->refusal);
  }
  return 0;
}

}  // namespace kd::cli
