// Kernel choices of the CUDA backend, one place for every family: the tile tables the kernels are
// instantiated from (the H200 sweeps' survivors — the retired configurations and their last measured
// numbers are in docs/perf.md, "Retired kernels (issue 13)") and the per-call choice structs that
// travel in the launchers' parameters (LinearConfig; ExpertBatch::path / imma_tile in kernels.h). Nothing here is mutable: a sweep or a test picks a
// configuration per call, production leaves the defaults, which are the measured choice (three defaults may be
// fed from the environment for end-to-end sweeps, read once: KDTREE_CUDA_MMA_MIN_ROWS, KDTREE_CUDA_MMA_GEMM_MIN_M,
// KDTREE_CUDA_MLA_LAUNCH_ROWS).
//
// Every configuration of one family writes the same bits for the shapes it is chosen by (the bf16
// MMA tiles: the same bits for a given matrix, as the choice is a rule of the matrix's shape alone;
// the IMMA tiles: the same bits everywhere, exact integer products) — so the choice never breaks
// the row invariance DDTree needs (DESIGN.md §2).
#pragma once
#include <cstdint>
#include <limits>

namespace kd::cuda {

// ---- bf16 tensor-core linear (mma.cu) ------------------------------------------------------------
// A tile configuration of mma_linear_kernel. The K split is a rule of the shape alone: KST warps a
// block for "tall" matrices (≥ 4096 rows), KSS below; it fixes every row's reduction order, so the
// rest may change with M without changing a bit: M ≤ 8 runs one 8-token tile with RT1 16-row tiles a
// warp (tall; short matrices keep 1), U1 k32 blocks a load batch and OCC1 warps an SM asked of ptxas
// (tall only); M > 8 runs 16 / 24 / 32-token tiles with RTW 16-row tiles a warp (tall; short: 1) and
// UW. LD: weight load flavour (1: ld.global.nc L1::no_allocate; 2: the same plus the L2::256B
// prefetch hint). KC: runs of U consecutive k32 blocks a warp (U1 == UW then: U is part of the order).
// Every load batch is software-pipelined (the next batch's loads in flight during this one's MMAs;
// deeper rings of 3 or 4 batches were no faster at M = 1 and slower for rt2-kcl2: docs/perf.md).
struct MmaTile {
  const char* name;
  int KST, KSS, RT1, U1, OCC1, RTW, UW, LD;
  bool KC;
};
// The sweep's winners (CudaMma.ConfigSweep on the H200, docs/perf.md): "rt2-kcl2" for matrices of
// ≥ kMmaTallRows rows (lm_head, o_proj, dense, shared expert down, q_b: within 3–25 % of the CUDA-core
// GEMV at M = 1, 1.2–2.9× faster at M = 17), "ks8" below (q_a, the shared expert's 4096-row gate+up:
// rt2-kcl2's 32-row blocks are only 128 there, fewer than the SMs; 26 vs 37 µs at M = 1).
inline constexpr MmaTile kMmaTiles[] = {
    // name        KST KSS RT1 U1 OCC1 RTW UW LD KC
    {"ks8",          8, 16,  1, 2,  16,  2, 1, 1, false},  // 0: 16 rows a warp, K over 8/16 warps
    {"rt2-kcl2",     4,  8,  2, 2,  16,  2, 2, 2, true},   // 1: 32 rows a warp, k32 runs of 2, L2::256B
};
inline constexpr int kMmaTileCount = int(sizeof(kMmaTiles) / sizeof(kMmaTiles[0]));
inline constexpr int kMmaShortTile = 0, kMmaTallTile = 1;
inline constexpr int64_t kMmaTallRows = 6144;
// bf16 matrices narrower than this stay on the CUDA-core GEMV (linear.cu): as 16-row tiles they leave
// most SMs idle (kv_a's 576 rows, the router's 384).
inline constexpr int64_t kMmaMinRows = 1024;
inline constexpr int64_t kNoMma = std::numeric_limits<int64_t>::max();  // LinearConfig::mma_min_rows: never
// Token rows from which an MMA linear runs as the staged prefill GEMM (LinearConfig::mma_gemm_min_m;
// scheduling only), and its blocks an SM (LinearConfig::mma_gemm_blocks).
// 128 (session 25, H100, docs/perf.md "The bf16 projections as a staged GEMM"): a 4096-token prefill
// of the 6-layer k2-slice 753.6 → 674.5 ms; KDTREE_CUDA_MMA_GEMM_MIN_M=1000000000 keeps the tile kernel.
inline constexpr int64_t kMmaGemmMinM = 128;
inline constexpr int kMmaGemmBlocks = 2;
// kMmaGemmMinM, or KDTREE_CUDA_MMA_GEMM_MIN_M when set (read once; a huge value keeps every call on the
// tile kernel, for end-to-end comparisons).
int64_t default_mma_gemm_min_m();

// LinearConfig::mma_min_rows's default: kMmaMinRows, or KDTREE_CUDA_MMA_MIN_ROWS (read once, the one
// environment override of a kernel choice: 0 sends every bf16 matrix of a whole forward through the
// MMA path, so end-to-end tests on small models exercise it; a huge value keeps them all on CUDA cores).
int64_t default_mma_min_rows();

// How cuda::linear runs one call. The defaults are production's.
struct LinearConfig {
  int64_t mma_min_rows = default_mma_min_rows();  // bf16 matrices of ≥ this many rows take the MMA path
  int mma_tile = -1;  // −1: by the matrix's shape (kMmaTallRows); else a kMmaTiles index for every shape
  // Calls of ≥ this many token rows run the tile's order as a shared-memory GEMM (mma.cu, "Prefill
  // GEMM"; scheduling only: the same bits), fewer the tile kernel itself.
  int64_t mma_gemm_min_m = default_mma_gemm_min_m();
  int mma_gemm_blocks = 0;  // the GEMM's blocks an SM asked of ptxas: 0 the default (kMmaGemmBlocks), 1 or 2
};

// ---- MLA attention's tensor-core core (attention.cu) --------------------------------------------------
// Rows one core launch covers (scheduling only: a row's bits never depend on it; it sizes the chunk
// partials buffer, H × 16 chunks × (Lr + 4) floats a row — 2.1 MB for K2's 64 heads — and the q-fragment
// buffer, ⌈H / 16⌉ × 55 KB a row for K2).
inline constexpr int64_t kMlaCoreLaunchRows = 128;
// kMlaCoreLaunchRows, or KDTREE_CUDA_MLA_LAUNCH_ROWS when set (> 0; read once — a sweep's override, like
// KDTREE_CUDA_MMA_MIN_ROWS).
int64_t mla_core_launch_rows();
// (Retired, session 25: two 16-head groups a core block of 512 threads, sharing each key tile through
// L1 — slower than one group a block on the H100, pp4096 +3.4–4.6 %, docs/perf.md.)

// ---- INT4 routed experts on the integer tensor cores (expert_imma.cu) ------------------------------
// Tile shapes of expert_imma_kernel: WR × WT warps a block, each owning RT 16-row tiles (row warp) and
// MP token pairs (token warp) of a pass; ST cp.async stages of SG groups of columns (32: 1024-column
// steps, 8: 256). Shared memory a block = ST × (WR·RT·16 rows × (18·SG + pad) B + 2·MP·WT tokens ×
// 130·SG B). All write the same bits (the per-group chain of each output is the same; exact integer
// products).
struct ImmaTile {
  const char* name;  // the sweep's label, as docs/perf.md names it
  int WR, WT, RT, ST, MP, SG;
};
// The rule (H200 sweep at f577f02, docs/perf.md): i2 (4 blocks × 2 warps an SM: faster than 2 × 4 and
// 1 × 8 at every batch), i7 (4 tokens a pass) once the forward has ≥ kImmaWideGateUpRows rows (gate/up,
// rows ≤ cols) or ≥ kImmaWideDownRows (down) — prefill and large trees, where a pass is compute-bound;
// from kImmaPrefillRows rows a prefill tile (128 weight rows × 16 tokens a block: each staged weight
// fragment serves 8 token pairs and each staged token row 4 row warps; H100 sweep, docs/perf.md).
// 64 tokens a block (2 × 4 warps of 64 rows × 16 tokens) spilled at 255 registers. Retired after the H100
// sweep (docs/perf.md "Prefill tiles for the INT4 experts"): p32 (128 × 32 tokens) and the one-pass-a-block
// tiles p16i / p32i / p16wi / p16ri lost to p16 at every n (latency-bound at 8 warps an SM, not
// bandwidth-bound, so sharing a weight tile through L2 bought nothing); so did p16w (4 row × 2 token warps)
// and p16r (8 row warps of 16 rows), the same block over 8 warps with half the accumulators each (175 / 215
// registers: still one block of 8 warps an SM; 33.2 / 31.8 vs 27.7 ms gate/up at 4096 rows, session 23).
inline constexpr ImmaTile kImmaTiles[] = {
    // name   WR WT RT ST MP SG
    {"i2",     2, 1, 1, 2, 1, 32},  // 0: 32 rows, 55 KB → 4 blocks an SM
    {"i7",     4, 1, 1, 2, 2, 32},  // 1: 4 tokens a pass, 64 rows, 109 KB → 2 blocks
    {"p16",    4, 1, 2, 3, 8, 8},   // 2: 128 rows × 16 tokens, 4 warps, 103 KB → 2 blocks
};
inline constexpr int kImmaTileCount = int(sizeof(kImmaTiles) / sizeof(kImmaTiles[0]));
inline constexpr int kImmaNarrowTile = 0, kImmaWideTile = 1, kImmaPrefillTile = 2;
inline constexpr int64_t kImmaWideGateUpRows = 128, kImmaWideDownRows = 256, kImmaPrefillRows = 1024;
// The rule's choice for a [rows, cols] expert matrix in a forward of n rows.
constexpr int imma_tile_for(int64_t rows, int64_t cols, int64_t n) {
  if (n >= kImmaPrefillRows) return kImmaPrefillTile;
  return n >= (rows > cols ? kImmaWideDownRows : kImmaWideGateUpRows) ? kImmaWideTile : kImmaNarrowTile;
}

// Which kernel family cuda::expert_linear runs for INT4 experts (ExpertBatch::path).
enum class ExpertPath : int {
  imma = 0,   // the integer tensor cores (expert_imma.cu): production
  cores = 1,  // the CUDA-core register kernel (linear.cu): kept as the independent second implementation
              // — it is the bf16 experts' kernel instantiated for INT4 (shared code with the dense INT4
              // GEMV), needs no digit scratch, and is what the IMMA tests compare bits and time against
};

// ---- MLA attention (attention.cu) ------------------------------------------------------------------
// The core's arithmetic (16 heads × 256-key tiles a group, on the tensor cores) is fixed; its choices
// above (rows a launch, groups a block) are scheduling only, so nothing here could change a bit.

}  // namespace kd::cuda
