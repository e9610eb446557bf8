// CudaTarget's private state (shared by deepseek_v3_cuda.cpp, deepseek_v3_cuda_weights.cpp and the
// bench's timed paths, cli/bench_cuda_timing.cpp, only).
#pragma once
#include <cuda_runtime_api.h>

#include <vector>

#include "model/deepseek_v3_cuda.h"
#include "backend/cuda/kernels.h"

namespace kd {

class DeviceComm;

inline uint64_t matrix_bytes(const cuda::DevMatrix& m) {
  if (m.int4) return uint64_t(m.rows) * uint64_t(m.cols) / 2 + uint64_t(m.rows) * uint64_t(m.cols / 32) * 2;
  return uint64_t(m.rows) * uint64_t(m.cols) * 2;
}

struct DevLayer {
  cuda::DevMatrix q_a, q_b, kv_a, kv_b, o;              // as the checkpoint's (bf16 here: kv_b must be)
  float* attn_norm = nullptr, *ffn_norm = nullptr;     // fp32 [hidden]
  float* q_a_norm = nullptr, *kv_a_norm = nullptr;     // fp32 [q_lora_rank], [kv_lora_rank]
  bool moe = false, has_shared = false;
  cuda::DevMatrix dense_gu, dense_down;                // !moe: gate/up rows interleaved [2·inter, hidden]
  cuda::DevMatrix router;                              // moe: bf16 [E, hidden]
  float* router_bias = nullptr;                        // moe: fp32 [E]
  cuda::DevMatrix exp_gu, exp_down;                    // moe: expert 0 of [E] back-to-back matrices
  int64_t gu_stride_bytes = 0, gu_scale_stride = 0, down_stride_bytes = 0, down_scale_stride = 0;
  cuda::DevMatrix sh_gu, sh_down;                      // shared experts (interleaved gate/up)
  uint64_t attn_bytes = 0;    // attention matrices + norms, read once per forward
  uint64_t dense_bytes = 0;   // dense MLP, or router + shared experts
  uint64_t expert_bytes = 0;  // one routed expert (gate + up + down)
};

struct CudaTarget::Impl {
  ModelConfig cfg;
  std::vector<void*> allocs;
  uint64_t weight_bytes = 0;  // resident weights
  int64_t kv_cap_bytes = -1;  // CudaTarget::cap_kv_bytes (negative: no cap)
  uint16_t* embed = nullptr;  // bf16 [vocab, hidden]
  cuda::DevMatrix lm_head;
  // Every vocabulary row of lm_head for a GPU drafter beside a tensor-parallel rank, whose own
  // lm_head holds only its rows (CudaTarget::add_draft_lm_head; empty otherwise).
  cuda::DevMatrix full_lm_head;
  const cuda::DevMatrix& draft_lm_head() const { return full_lm_head.w ? full_lm_head : lm_head; }
  float* final_norm = nullptr;
  float* inv_freq = nullptr;
  std::vector<DevLayer> layers;
  // Latent cache, bf16 [layers][cap][D], cap = n_blocks × bt rows a layer, lent by the caller
  // through block tables (init_kv). CudaTarget(model, max_tokens) makes it one block (bt = cap) that
  // the single-sequence convenience (forward / compact) uses, committing `size` rows.
  uint16_t* cache = nullptr;
  int64_t cap = 0, size = 0, D = 0, bt = 0, n_blocks = 1;
  float rope_scaling = 1.0f, softmax_scale = 1.0f;
  cudaStream_t stream = nullptr;
  cudaStream_t side = nullptr;  // independent work of a layer (kv path, shared experts) runs here
  cudaEvent_t ev0 = nullptr, ev1 = nullptr, fork = nullptr, join = nullptr;

  // Tensor parallel (a rank of model/deepseek_v3_cuda_tp.h; cfg then holds the rank's heads and MLP
  // widths): the communicator of the forward in flight (null: unsharded), this rank's lm_head rows
  // [vocab_begin, vocab_begin + lm_rows) — the whole vocabulary unsharded — and the partial sums
  // [rows, hidden] reduced after o_proj and after the MLP.
  DeviceComm* comm = nullptr;
  int64_t lm_rows = 0, vocab_begin = 0;
  float* yp = nullptr;

  // Work buffers for up to rows_cap rows (logits for logits_cap rows; `in` holds in_cap ints).
  int64_t rows_cap = 0, taps_cap = 0, logits_cap = 0, in_cap = 0;
  float *x = nullptr, *xn = nullptr, *cq = nullptr, *q = nullptr, *kv = nullptr, *attn = nullptr, *h = nullptr, *h2 = nullptr;
  uint32_t* qfrag = nullptr;  // attention's q fragments (mla_qfrag_bytes)
  float *qlat = nullptr, *olat = nullptr, *part = nullptr, *ys = nullptr, *sh = nullptr, *rl = nullptr, *wts = nullptr, *logits = nullptr, *taps = nullptr;
  float* xg = nullptr;  // [rows, hidden]: the rows whose logits are asked for, gathered
  int8_t* xq = nullptr;  // the routed experts' x as digits (cuda::expert_digit_bytes), gate/up or down
  uint16_t* xunit = nullptr;  // bf16 units of the digits
  // A forward's inputs, one upload: ids | positions | KeyLists (cnt | start | tab | wrow | base |
  // voff) | logit rows, n each, then the visible lists in vcap slots (n² for a graphed shape, so
  // that the tables behind them sit at the same place every replay), then the block tables.
  int32_t* in = nullptr;
  int32_t *chosen = nullptr, *entry_token = nullptr, *entry_slot = nullptr, *n_active = nullptr;
  int32_t *act_expert = nullptr, *act_off = nullptr, *act_cnt = nullptr, *keep = nullptr, *active_log = nullptr;
  int64_t keep_cap = 0;
  int32_t* h_in = nullptr;  // pinned staging of `in`
  // Argmax outputs: device [ids am_cap | values am_cap], pinned mirror; the last forward's first
  // logit row per sequence (logits_row) and its number of logit rows.
  int32_t* am_dev = nullptr;
  int32_t* am_host = nullptr;
  int64_t am_cap = 0;
  std::vector<int64_t> last_lrow0;
  int64_t last_lrows = 0;
  int64_t staged_vis = 0;  // visible-list slots of the last upload_own (the vcap a run over it must be given)
  float* h_logits = nullptr;  // pinned [h_logits_cap, vocab]: forward_batch's logits come down in one copy
  int64_t h_logits_cap = 0;

  // Host side of a forward's inputs, one sequence after another (stage_seq), then packed into `in`.
  struct Staged {
    int64_t n = 0, max_keys = 0;
    std::vector<int32_t> ids, pos, cnt, start, tab, wrow, base, voff, lrows, tables, vis;
    void clear() {  // (keeps the capacity: a decode step stages without allocating)
      n = max_keys = 0;
      for (std::vector<int32_t>* v : {&ids, &pos, &cnt, &start, &tab, &wrow, &base, &voff, &lrows, &tables, &vis}) v->clear();
    }
  };
  Staged staged;  // forward_seqs' inputs, reused

  // Forwards of a repeating shape — the one-row AR decode step, the DDTree verify of each tree
  // size — as captured CUDA graphs, replayed (the launch gaps of ≈ 20 kernels a layer go). All
  // that changes between replays — tokens, positions, key lists, cache start — already reaches the
  // kernels through device memory (`in`, uploaded before the launch), so one capture per shape
  // serves every step and no node's parameters need an update. Attention's smem bound is
  // captured at graph_keys (the cache's length, within the kernel's limit): it sizes the score
  // buffer only, the kernels read the real key counts from `in`, so a replay computes the launch
  // path's bits. Captured against the work buffers of the time: when ensure_rows reallocates them
  // (graph_gen != buf_gen) or the taps buffer moves, the graphs are recaptured.
  struct Graph {
    int64_t n = 0, n_logits = 0;
    std::vector<int32_t> tap_layers;
    float* taps_dev = nullptr;
    cudaGraphExec_t exec = nullptr;
    uint64_t last_use = 0;  // graph_clock at the shape's last forward
  };
  uint64_t graph_clock = 0;
  bool graphs = true;
  bool device_outputs = true;  // device_argmax() / device_taps()
  uint64_t host_tap_rows = 0;  // taps rows downloaded to the host (CudaTarget::host_tap_rows)
  static constexpr int64_t kGraphRows = 64;  // batches of at most this many rows replay graphs
  std::vector<Graph> graph_cache;
  uint64_t buf_gen = 0, graph_gen = 0;  // bumped when a work buffer moves / the one graphs were captured at
  int64_t graph_keys = 0;

  ~Impl();
  void* alloc(size_t bytes, const char* what);
  void release(void* p);  // frees one alloc() (the stream must be idle)
  void init_common(int64_t max_tokens);
  void ensure_rows(int64_t n);
  void ensure_logits(int64_t rows);
  void ensure_in(int64_t ints);
  // Appends one sequence's rows: its committed rows `start`, its block table (cache rows
  // table[b]·bt …), ids/positions/visibility as ForwardArgs, which rows' logits to return.
  void stage_seq(Staged& st, const int32_t* ids, int64_t n, const int32_t* positions, const uint8_t* visibility,
                 int64_t start, const int32_t* table, int64_t n_table, bool all_logits, bool want_logits) const;
  void upload(const Staged& st, int64_t vcap);  // packs st into `in` (one async copy on the stream)
  // The single sequence of the one-block cache as a batch entry (its start: size).
  SeqForward own_sequence(const ForwardArgs& a) const;
  // Stages and uploads the own sequence's rows (the bench paths); returns its start.
  int64_t upload_own(const int32_t* ids, int64_t n, const int32_t* positions, const uint8_t* visibility, bool all_logits,
                     bool want_logits, bool graphed);
  // The forward of model/target.h (CudaTarget::forward_batch and the single-sequence forwards).
  void forward_seqs(const std::vector<SeqForward>& seqs, ForwardStats* stats);
  // One forward over the n rows staged in `in` (visible lists in vcap slots); max_keys bounds every
  // row's key count (attention's smem); n_logits rows (the staged logit rows) get logits.
  void run(int64_t n, int64_t vcap, int64_t max_keys, int64_t n_logits, const std::vector<int32_t>* tap_layers,
           float* taps_dev);
  // run(n, n², keys, …) by replaying the graph of this shape (captured on its second use); keys
  // beyond graph_keys fall back to launching. The inputs must have been uploaded with vcap = n².
  void run_graphed(int64_t n, int64_t keys, int64_t n_logits, const std::vector<int32_t>* tap_layers, float* taps_dev);
  void drop_graphs();
  // Whether run_graphed(n, …, n_logits) without taps would replay a captured graph now.
  bool graph_captured(int64_t n, int64_t n_logits) const;
  // Cache rows src[k] → dst[k] of every layer, in k order (DDTree compaction; queued, no sync).
  void copy_rows(const std::vector<int32_t>& src, const std::vector<int32_t>& dst);
  uint64_t weight_bytes_of(int64_t n, const std::vector<int32_t>* distinct, int64_t logit_rows) const;
  void finish_layer_bytes();
};

}  // namespace kd
