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
#include <string>

#include "backend/cuda/kernel_config.h"

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
// cfg: which kernel (kernel_config.h; the default is production's). bf16 matrices of ≥
// cfg.mma_min_rows rows take the tensor-core path (mma.cu): fp32 x split exactly into three bf16
// parts, three MMAs a k16 step, fp32 accumulation; rows stay bit-identical whatever M (it serves
// M = 1 too), the tile is a rule of the matrix's shape unless cfg.mma_tile forces one. Narrower
// matrices and INT4 run the CUDA-core GEMV (linear.cu). A bad cfg is an error before any launch.
void linear(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep,
            cudaStream_t s, const LinearConfig& cfg = {});
// A bad cfg (a tile that does not exist, a negative bound, a block count not 0–2) is an Error.
void check_linear_config(const LinearConfig& cfg);
// Whether linear(w, …, cfg) runs on the tensor cores; linear_mma runs it there (false: not eligible).
bool mma_eligible(const DevMatrix& w, const LinearConfig& cfg = {});
// How an MMA linear of M token rows runs: 0 the tile kernel, else the staged GEMM at that many blocks
// an SM (cfg.mma_gemm_min_m, cfg.mma_gemm_blocks; scheduling only, the same bits).
int mma_gemm_blocks_for(int64_t M, const LinearConfig& cfg);
bool linear_mma(const DevMatrix& w, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy, Epilogue ep,
                cudaStream_t s, const LinearConfig& cfg = {});

// Routed experts of one layer, their rows grouped by expert (see dispatch()). Expert e's matrix
// starts at w.w + e · w_stride_bytes (scales: + e · scale_stride_elems). Entry j of active expert a
// (entries act_off[a] … act_off[a] + act_cnt[a]) reads x row in_row[j], writes y row out_row[j].
struct ExpertBatch {
  DevMatrix w;  // expert 0
  int64_t w_stride_bytes = 0, scale_stride_elems = 0;
  const int32_t* n_active = nullptr;  // [1] distinct experts in use
  const int32_t* act_expert = nullptr, *act_off = nullptr, *act_cnt = nullptr;  // [max_active]
  const int32_t* in_row = nullptr, *out_row = nullptr;                          // [n × top-k]
  int64_t max_active = 0;           // grid bound: min(n_experts, rows × top_k)
  int64_t max_rows_per_expert = 1;  // the forward's row count: kernel choices by the batch (same bits)
  // The integer tensor-core path (expert_imma.cu) splits x rows [0, x_rows) into digits first:
  // scratch of expert_digit_bytes(x_rows, w.cols) bytes (16-byte aligned) and
  // expert_digit_units(x_rows, w.cols) bf16 units, owned by the caller (a forward keeps one for all layers).
  int64_t x_rows = 0;
  int8_t* xq = nullptr;
  uint16_t* xunit = nullptr;
  // Kernel choice (kernel_config.h; the defaults are production's): the INT4 experts' path, and the
  // IMMA tile (−1: the rule, by the matrix and max_rows_per_expert; else a kImmaTiles index).
  ExpertPath path = ExpertPath::imma;
  int imma_tile = -1;
};
void expert_linear(const ExpertBatch& b, const float* x, int64_t ldx, float* y, int64_t ldy, Epilogue ep, cudaStream_t s);

// INT4 experts on the integer tensor cores (expert_imma.cu: exact s8 × s8 MMAs of 16·(nibble − 8)
// and four base-256 digits of x, block floating point per group of 32; fp32 accumulation over
// groups): the path expert_linear takes for INT4 experts unless the batch asks for the CUDA-core
// register kernel (ExpertBatch::path = cores: other bits, tests and timings). Every token count takes
// the same path, so rows stay bit-identical whatever the batch. Its tiles (kImmaTiles) all write the
// same bits, so the rule may pick one by the matrix and the forward's row count (max_rows_per_expert);
// ExpertBatch::imma_tile forces one. A bad choice is an error before any launch.
int64_t expert_digit_bytes(int64_t rows, int64_t cols);
int64_t expert_digit_units(int64_t rows, int64_t cols);
std::string expert_imma_describe(int tile);  // tile, registers, occupancy
std::string expert_cores_describe();         // the CUDA-core register kernel: registers, occupancy
void expert_linear_imma(const ExpertBatch& b, const float* x, int64_t ldx, float* y, int64_t ldy, Epilogue ep, cudaStream_t s);

// out[i, d] = table[ids[i], d] as fp32 (bf16 table [vocab, dim]).
void embed(const uint16_t* table, int64_t dim, const int32_t* ids, int64_t n, float* out, cudaStream_t s);

// out[i] = x[i] · rsqrt(mean(x[i]²) + eps) · w, rows of dim (strides ldx, ldo); the mean in fp64
// as the CPU reference does. out may alias x.
// (w: weights no kernel writes — read before the launch-overlap wait, common.cuh.)
void rmsnorm(const float* x, int64_t ldx, const float* w, int64_t rows, int64_t dim, double eps, float* out,
             int64_t ldo, cudaStream_t s);


// Where the keys of a forward's rows live in a paged latent cache (a single sequence is one block
// as long as the cache). Row i belongs to one sequence; its key list is that sequence's committed
// rows 0 … start[i] − 1 — row t at cache row tables[tab[i] + t / bt] · bt + t % bt — followed by the
// new rows of its own sequence it may see, vis[voff[i] … voff[i] + cnt[i]) (indices among that
// sequence's new rows, ascending: its tree ancestors and itself), whose latents sit at cache rows
// wrow[base[i] + j]. voff[i] < 0 marks a causal row: its visible new rows are 0 … cnt[i] − 1 and no
// list is stored (a P-row prompt chunk would otherwise stage P(P + 1)/2 entries: 2.1 GB at 32K, past
// int32 offsets at 64K). All on the device, so a captured graph replays with new contents.
struct KeyLists {
  const int32_t* cnt = nullptr;     // [n] new rows visible to row i
  const int32_t* start = nullptr;   // [n] committed rows of row i's sequence
  const int32_t* tab = nullptr;     // [n] offset of its sequence's block table in `tables`
  const int32_t* wrow = nullptr;    // [n] cache row the new row's latent is written to
  const int32_t* base = nullptr;    // [n] batch index of its sequence's first new row
  const int32_t* voff = nullptr;    // [n] offset of its visible list in `vis`; < 0: causal (0 … cnt − 1)
  const int32_t* vis = nullptr;
  const int32_t* tables = nullptr;
  int64_t bt = 1;                   // rows per block
};

// Latent cache write for n new rows: cache[wrow[i]] = bf16([RMSNorm(kv[i, :Lr]) | RoPE(kv[i, Lr:])]).
void latent_write(const float* kv, int64_t n, int64_t Lr, int64_t dr, const float* norm_w, double eps,
                  const float* inv_freq, const int32_t* positions, float attn_scaling, uint16_t* cache_layer,
                  const int32_t* wrow, cudaStream_t s);

// Absorbed MLA attention for n new rows over a bf16 latent cache [rows, Lr + dr]; row i attends to
// its key list (KeyLists) in list order — the AR order of the same prefix.
struct MlaParams {
  const float* q = nullptr;           // [n, H, dn + dr]: rope applied, or not yet when rope_inv_freq is set
  // Set: the core rotates q's rope part itself as it loads it (rope_q's arithmetic, the same bits,
  // one launch less a layer); q_pe of row i at rope_positions[i], inv_freq [dr / 2], cos/sin × rope_scaling.
  const float* rope_inv_freq = nullptr;
  const int32_t* rope_positions = nullptr;
  float rope_scaling = 1.0f;
  const uint16_t* kv_b = nullptr;     // bf16 [H × (dn + dv), Lr]: per head W_UK rows then W_UV rows
  const uint16_t* cache = nullptr;    // bf16 [capacity, Lr + dr] of this layer
  KeyLists keys;
  float* out = nullptr;               // [n, H × dv]
  float* qlat = nullptr, *olat = nullptr;  // work: [n, H, Lr] each
  float* part = nullptr;              // work: mla_part_floats(n, H, Lr) (key lists longer than one chunk)
  uint32_t* qfrag = nullptr;          // work: mla_qfrag_bytes(n, H, Lr, dr) (q split for the tensor cores)
  int64_t max_keys = 0;               // bound on every row's key count (sizes the core's chunk grid), ≥ 1
  int64_t n = 0, H = 0, dn = 0, dr = 0, dv = 0, Lr = 0;
  float softmax_scale = 1.0f;
};
void mla_attention(const MlaParams& p, cudaStream_t s);
int64_t mla_max_keys(int64_t Lr, int64_t dr);  // longest key list the attention kernels take
int64_t mla_part_floats(int64_t n, int64_t H, int64_t Lr);  // MlaParams::part's size for n rows
int64_t mla_qfrag_bytes(int64_t n, int64_t H, int64_t Lr, int64_t dr);  // MlaParams::qfrag's size for n rows
// (kv_b must be bf16; qk_nope_head_dim ≤ 512, kv_lora_rank ≤ 512)

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

// DDTree compaction: cache rows src[k] → dst[k] of every layer, in k order (no row is
// overwritten before it is read when, as for a kept path, dst[k] ≤ src[k] and both ascend).
void compact_rows(uint16_t* cache, int64_t layers, int64_t layer_stride_elems, int64_t dim, const int32_t* src,
                  const int32_t* dst, int64_t n_keep, cudaStream_t s);

// Tensor-parallel reductions (backend/cuda/device_comm.h): each element is the ranks' partials added
// in rank order in fp32, ((p0 + p1) + p2) + … with __fadd_rn — one fixed chain whatever the number of rows.
inline constexpr int kMaxRanks = 64;
struct RankBuffers {
  float* p[kMaxRanks];  // every rank's buffer [n] fp32 (one device)
  int32_t ranks = 0;
};
// Elements [begin, end) of every buffer become their rank-order sum (read all, then write all).
void rank_order_sum(const RankBuffers& b, int64_t begin, int64_t end, cudaStream_t s);
// gathered [ranks, n] rank-major (as ncclAllGather leaves it) → out [n].
void rank_order_sum_gathered(const float* gathered, int32_t ranks, int64_t n, float* out, cudaStream_t s);

// x[i] += y[i] for i < n (a reduced partial sum into the residual stream).
void add_rows(float* x, const float* y, int64_t n, cudaStream_t s);

// x rows rows[0 … n) → out [n, dim] (the rows whose logits a forward returns).
void gather_rows(const float* x, int64_t dim, const int32_t* rows, int64_t n, float* out, cudaStream_t s);

// A one-row causal step of a single contiguous sequence, set up on the device from its committed
// length *start (so a decode loop needs no host upload per step): position, write row and key
// count; advance() then moves *start on.
void single_step_setup(int32_t* positions, int32_t* cnt, int32_t* wrow, const int32_t* start, cudaStream_t s);
// *counter += by (a captured decode step advances its own start).
void advance(int32_t* counter, int32_t by, cudaStream_t s);
// Seeded uniform random fill (benchmarks): bf16 values in [−a, a); words with random bits.
void fill_bf16(uint16_t* p, int64_t n, float a, uint64_t seed, cudaStream_t s);
void fill_f32(float* p, int64_t n, float lo, float hi, uint64_t seed, cudaStream_t s);
void fill_words(uint32_t* p, int64_t n, uint64_t seed, cudaStream_t s);

// Read-only streaming bandwidth of the device over `bytes` (≥ 1 GiB), GB/s, median of `reps`.
double measure_read_gbps(int64_t bytes, int reps);
// A chain of `kernels` dependent launches of `blocks` blocks, each of which checks every slot the
// launch before wrote and writes its own, captured as one CUDA graph and replayed `reps` times: the
// cost a kernel boundary adds to a step (the forward is ≈ 20 such boundaries a layer), with the
// launch overlap (common.cuh) off and on. `stale`: slots a kernel found unwritten by the one before
// — 0 unless a kernel ran before its predecessor finished (the overlap's ordering test).
struct ChainTiming {
  double us_per_kernel_serial = 0, us_per_kernel_overlap = 0;
  int64_t stale = 0;
  bool overlap_available = false;  // pdl_supported(); without it both figures are the serial launch
};
ChainTiming measure_kernel_chain(int kernels, int blocks, int reps);
// Dense rate of mma.sync m16n8k16 bf16 → fp32 (the instruction of mma.cu) with register operands,
// TFLOP/s (2·16·8·16 per MMA), median of `reps`: the tensor-pipe ceiling of the bf16 MMA path.
double measure_mma_tflops(int reps);

// DFlash drafter (dflash_kernels.cu). x [rows, heads, hd] in place: per-head RMSNorm (weight w [hd],
// sum of squares in fp64), then neox RoPE (pairs j, j + hd/2) at positions first + row,
// angle = fp32(inv_freq[j]) × fp32(position), cos/sin × scaling.
void head_norm_rope(float* x, int64_t rows, int64_t heads, int64_t hd, const float* w, double eps, const float* inv_freq,
                    int64_t first, float scaling, cudaStream_t s);
// x [n] in place: x ← x · mul, then, when softcap > 0, softcap · tanh(x / softcap) (the drafter's
// input_embedding_scale, and its output_multiplier / final_logit_softcapping on the logits).
void scale_softcap(float* x, int64_t n, float mul, float softcap, cudaStream_t s);
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
int pdl_mode();  // the launch overlap the forward uses (KDTREE_CUDA_PDL; common.cuh)


}  // namespace kd::cuda
