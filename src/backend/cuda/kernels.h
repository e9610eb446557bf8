// Launchers of the CUDA backend's kernels (internal to src/backend/cuda/; model code never sees
// this header). Activations are fp32 on the device, weights bf16 or INT4 (docs/formats.md §device
// INT4), the latent KV cache bf16, every accumulation fp32 (DESIGN.md §4).
//
// Row invariance (DESIGN.md §2): every output element is reduced by one warp or one block in an
// order fixed by the problem's inner dimension alone — never by the number of rows M, the row's
// place in the batch, or which template (M-tile) variant runs it; all multiply-adds are explicit
// fmaf, so the compiler cannot contract differently in different instantiations.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kd::cuda {

// A weight matrix on the device, row-major [rows = out, cols = in].
struct DevMatrix {
  int64_t rows = 0, cols = 0;
  bool int4 = false;
  const void* w = nullptr;           // bf16 [rows, cols], or INT4 uint32 [rows, cols / 8] (8 LSB-first nibbles)
  const uint16_t* scales = nullptr;  // INT4: bf16 [rows, cols / 32], one per group of 32 along cols
};

// What a linear kernel does with each output value v of row m, column r.
enum class Epilogue : int {
  store = 0,   // y[m, r] = v
  add = 1,     // y[m, r] = y[m, r] + v (fused residual add)
  swiglu = 2,  // rows interleave gate/up (2j, 2j+1): y[m, j] = silu(v_2j) · v_2j+1
};

// y[m, ·] (ldy) = epilogue(x[m, ·] (ldx) · wᵀ) for m < M. bf16: cols % 8 == 0; INT4: cols % 32 == 0.
void linear(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep,
            cudaStream_t s);

// Routed experts of one layer, their rows grouped by expert (see dispatch()). Expert e's matrix
// starts at w.w + e · w_stride_bytes (scales: + e · scale_stride_elems). Entry j of active expert a
// (entries act_off[a] … act_off[a] + act_cnt[a]) reads x row in_row[j], writes y row out_row[j].
struct ExpertBatch {
  DevMatrix w;  // expert 0
  int64_t w_stride_bytes = 0, scale_stride_elems = 0;
  const int32_t* n_active = nullptr;  // [1] distinct experts in use
  const int32_t* act_expert = nullptr, *act_off = nullptr, *act_cnt = nullptr;  // [max_active]
  const int32_t* in_row = nullptr, *out_row = nullptr;                          // [entries]
  int64_t max_active = 0;           // grid bound: min(n_experts, rows × top_k)
  int64_t max_rows_per_expert = 1;  // the forward's row count: 1 selects the decode variant
};
void expert_linear(const ExpertBatch& b, const float* x, int64_t ldx, float* y, int64_t ldy, Epilogue ep, cudaStream_t s);

// out[i, d] = table[ids[i], d] as fp32 (bf16 table [vocab, dim]).
void embed(const uint16_t* table, int64_t dim, const int32_t* ids, int64_t n, float* out, cudaStream_t s);

// out[i] = x[i] · rsqrt(mean(x[i]²) + eps) · w, rows of dim (strides ldx, ldo); the mean in fp64
// as the CPU reference does. out may alias x.
void rmsnorm(const float* x, int64_t ldx, const float* w, int64_t rows, int64_t dim, double eps, float* out,
             int64_t ldo, cudaStream_t s);

// GPT-J RoPE (pairs 2i, 2i+1) in place on q [n, heads, head_dim] at offset `off` within each head,
// `half` pairs; angle = fp32(inv_freq[i]) × fp32(position), cos/sin × attn_scaling (YaRN).
void rope_q(float* q, int64_t n, int64_t heads, int64_t head_dim, int64_t off, int64_t half, const float* inv_freq,
            const int32_t* positions, float attn_scaling, cudaStream_t s);

// Latent cache write for n new rows: cache[*row0 + i] = bf16([RMSNorm(kv[i, :Lr]) | RoPE(kv[i, Lr:])]).
void latent_write(const float* kv, int64_t n, int64_t Lr, int64_t dr, const float* norm_w, double eps,
                  const float* inv_freq, const int32_t* positions, float attn_scaling, uint16_t* cache_layer,
                  const int32_t* row0, cudaStream_t s);

// Absorbed MLA attention for n new rows over a bf16 latent cache [rows, Lr + dr]. Row i attends to
// cache rows 0 … start−1, then the new rows vis_rows[i · n + 0 … vis_cnt[i]) (offsets from start,
// ascending: its tree ancestors and itself) — the AR order of the same prefix.
struct MlaParams {
  const float* q = nullptr;           // [n, H, dn + dr], rope applied
  const uint16_t* kv_b = nullptr;     // bf16 [H × (dn + dv), Lr]: per head W_UK rows then W_UV rows
  const uint16_t* cache = nullptr;    // bf16 [capacity, Lr + dr] of this layer
  const int32_t* vis_rows = nullptr;  // [n, n]
  const int32_t* vis_cnt = nullptr;   // [n]
  float* out = nullptr;               // [n, H × dv]
  float* qlat = nullptr, *olat = nullptr;  // work: [n, H, Lr] each
  const int32_t* start = nullptr;     // [1] committed rows (on the device, so a captured graph replays)
  int64_t max_keys = 0;               // bound on start + n (sizes the shared score buffer)
  int64_t n = 0, H = 0, dn = 0, dr = 0, dv = 0, Lr = 0;
  float softmax_scale = 1.0f;
};
void mla_attention(const MlaParams& p, cudaStream_t s);
int64_t mla_max_keys(int64_t Lr, int64_t dr);  // longest key list the shared-memory score buffer holds
// (kv_b must be bf16; qk_nope_head_dim ≤ 512)

// MoE router of n rows (SPEC-MODEL.md §2): sigmoid scores, selection on score + bias with group
// limits, ties to the lower id, chosen ids ascending, weights normalised in that order.
struct RouteParams {
  int64_t E = 0, K = 0, G = 1, topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling = 1.0f;
};
void route(const float* logits, const float* bias, int64_t n, const RouteParams& p, int32_t* chosen, float* weights,
           cudaStream_t s);

// Groups the n × K choices by expert (ascending id; rows ascending inside an expert) for
// expert_linear(): gate/up entries read token rows, down entries read slot rows (slot = i·K + k).
// Also records the distinct-expert count into *active_log (for verify-cost reports).
struct Dispatch {
  int32_t* n_active;                         // [1]
  int32_t* act_expert, *act_off, *act_cnt;   // [E]
  int32_t* entry_token, *entry_slot;         // [n × K]
};
void dispatch(const int32_t* chosen, int64_t n, int64_t K, int64_t E, const Dispatch& d, int32_t* active_log,
              cudaStream_t s);

// x[i, d] += (Σ_k w[i, k] · y[i·K + k, d], k ascending) + shared[i, d] (shared may be null).
void moe_combine(float* x, const float* y, const float* w, const float* shared, int64_t n, int64_t K, int64_t hid,
                 cudaStream_t s);

// out[i] = index of the largest of logits[i, 0 … V) (lowest index on ties); −1 if the row has a NaN.
void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out, cudaStream_t s);

// DDTree compaction: rows start + keep[k] → start + k of every layer, in k order (keep ascending,
// keep[k] ≥ k, so no row is overwritten before it is read).
void compact_rows(uint16_t* cache, int64_t layers, int64_t layer_stride_elems, int64_t dim, int64_t start,
                  const int32_t* keep, int64_t n_keep, cudaStream_t s);

// The causal key lists of n new rows after *start committed ones: positions *start + i, row i sees
// new rows 0 … i (device-side, so a decode loop needs no host upload per step).
void causal_setup(int32_t* positions, int32_t* vis_cnt, int32_t* vis_rows, const int32_t* start, int64_t n, cudaStream_t s);
// *counter += by (a captured decode step advances its own start).
void advance(int32_t* counter, int32_t by, cudaStream_t s);

// Seeded uniform random fill (benchmarks): bf16 values in [−a, a); words with random bits.
void fill_bf16(uint16_t* p, int64_t n, float a, uint64_t seed, cudaStream_t s);
void fill_f32(float* p, int64_t n, float lo, float hi, uint64_t seed, cudaStream_t s);
void fill_words(uint32_t* p, int64_t n, uint64_t seed, cudaStream_t s);

// Read-only streaming bandwidth of the device over `bytes` (≥ 1 GiB), GB/s, median of `reps`.
double measure_read_gbps(int64_t bytes, int reps);

// DFlash drafter (dflash_kernels.cu). x [rows, heads, hd] in place: per-head RMSNorm (weight w [hd],
// sum of squares in fp64), then neox RoPE (pairs j, j + hd/2) at positions first + row,
// angle = fp32(inv_freq[j]) × fp32(position), cos/sin × scaling.
void head_norm_rope(float* x, int64_t rows, int64_t heads, int64_t hd, const float* w, double eps, const float* inv_freq,
                    int64_t first, float scaling, cudaStream_t s);
// Non-causal attention of B queries q [B, nh, hd] over S keys/values k, v [S, nkv·hd] (GQA:
// consecutive query heads share a KV head); out [B, nh·hd]; scores: scratch [B, nh, S].
void block_attention(const float* q, const float* k, const float* v, float* out, float* scores, int64_t B, int64_t nh,
                     int64_t nkv, int64_t hd, int64_t S, float scale, cudaStream_t s);

// DDTree round on the device (sample_kernels.cu). Per row of draft logits [rows, V]: the k best
// entries (logit desc, id asc; −0 == +0) as ids [rows, k] and their logits vals [rows, k], and
// DraftRowInfo: the max, the first NaN / +inf index (−1: none), and bounds lo ≤ S ≤ hi on the CPU
// tree builder's Σ_v exp(double(x_v) − max) summed in token order (0, 0 when bad or no finite max).
struct DraftRowInfo {
  double lo, hi;
  float max;
  int32_t bad;
};
// scratch: draft_top_k_scratch(rows, V, k) entries (per-chunk candidates; 0 for large k).
int64_t draft_top_k_scratch(int64_t rows, int64_t V, int64_t k);
// sequential_sum: the bounds added one term at a time (the reference of the warp-wide adder).
void draft_top_k(const float* logits, int64_t rows, int64_t V, int64_t k, unsigned long long* scratch, int32_t* ids,
                 float* vals, DraftRowInfo* info, bool sequential_sum, cudaStream_t s);
// out[i] = logits[i, ids[i]] (NaN when ids[i] is outside [0, V)): the value argmax_rows picked.
void gather_row_values(const float* logits, int64_t V, const int32_t* ids, int64_t n, float* out, cudaStream_t s);

// Aborts with a kd::Error naming the call and the CUDA error.
void check(cudaError_t e, const char* what);
void check_launch(const char* what);

}  // namespace kd::cuda
