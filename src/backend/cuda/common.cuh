// Device helpers shared by the CUDA backend's .cu files: bf16 and INT4 unpacking, warp and block
// reductions in a fixed order (so a value never depends on how many rows a launch holds).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

namespace kd::cuda {

// Programmatic dependent launch (sm_90; docs/architecture.md "Launch overlap"). A kernel started with
// launch() below may be scheduled while the kernel before it on the stream is still running; it must
// call pdl_wait() before its first access to memory another kernel writes or reads (weights, which no
// kernel writes, may be read before it), and before any early return — a grid whose blocks all
// returned without waiting would count as complete while its predecessor still runs, and the kernel
// after it would start too soon. pdl_wait() returns once the predecessor has completed and its writes
// are visible, so the chain stays transitive: every kernel waits for all kernels before it.
// pdl_trigger() lets the next kernel be scheduled early (it then sits in its own pdl_wait()); every
// kernel calls it right after its wait. The next grid starts only once every block of this one has
// triggered or exited — once this grid's last wave is resident — so waiting blocks take only the
// slots that last wave leaves, and at most one grid waits at a time (a kernel triggers only after its
// own wait returned). Neither call changes any arithmetic: a kernel's bits are the same with the
// overlap on or off.
// Off by default (KDTREE_CUDA_PDL=0): measured on the H200 (docs/perf.md), a kernel boundary inside a
// captured graph costs ≈ 1 µs either way and the overlap made small verify trees ≈ 3 % slower; on
// launches outside capture (KDTREE_CUDA_PDL=1) it hides most of the host's launch latency for a
// one-row step (3.90 → 3.55 ms) but made a 65-row verify ≈ 3 % slower; 2 uses it inside graphs too.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

void check(cudaError_t e, const char* what);
// KDTREE_CUDA_PDL read once (0, 1 or 2 as above; 0 on a device before compute capability 9.0).
int pdl_mode();
bool pdl_supported();          // compute capability ≥ 9.0
bool pdl_for(cudaStream_t s);  // whether launch() on s asks for the overlap now

// kernel<<<grid, block, smem, s>>>(args…), with the programmatic-serialization attribute when `pdl`;
// a launch error is fatal, naming `what`. Every kernel launched here calls pdl_wait().
template <class... P, class... A>
void launch_as(bool pdl, const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
               A&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...), what);
}
// The forward's launches: the overlap as pdl_for(s) says.
template <class... P, class... A>
void launch(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A&&... args) {
  launch_as(pdl_for(s), what, kernel, grid, block, smem, s, std::forward<A>(args)...);
}

// Opts `kernel` into `bytes` of dynamic shared memory (above the default 48 KB) on the current
// device, once a device: the attribute belongs to the device's context, so one process driving several
// GPUs (tensor parallel) must set it on each. `devices` is the call site's own mask of devices done.
template <class... P>
void opt_in_smem(void (*kernel)(P...), int bytes, std::atomic<uint64_t>& devices, const char* what) {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (devices.load(std::memory_order_acquire) & bit) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  devices.fetch_or(bit, std::memory_order_release);
}

// bf16 → fp32 is exact: the bf16 bits are the top half of the fp32 bits.
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf16_f(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

// fp32 → bf16, round to nearest even (NaN stays NaN).
__device__ __forceinline__ uint16_t f_bf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// (a, b) rotated by angle = inv_freq · position (fp32), cos/sin scaled (YaRN), as cpu::rope_gptj.
// One function for every caller (rope_q, the latent write, the MLA core's q_pe), so the bits agree.
__device__ __forceinline__ void rope_pair(float& a, float& b, float inv_freq, int32_t position, float scaling) {
  const float angle = __fmul_rn(inv_freq, float(position));
  const float c = __fmul_rn(cosf(angle), scaling), s = __fmul_rn(sinf(angle), scaling);
  const float a0 = a, b0 = b;
  a = __fsub_rn(__fmul_rn(a0, c), __fmul_rn(b0, s));
  b = __fadd_rn(__fmul_rn(b0, c), __fmul_rn(a0, s));
}

// Two fp32 → their exact three-part bf16 split (hi + mid + lo; mma.cu's header explains the
// precision), each part packed as bf16x2 (a in the low half).
struct Split3 {
  uint32_t hi, mid, lo;
};
__device__ __forceinline__ Split3 split3(float a, float b) {
  const uint32_t ua = __float_as_uint(a), ub = __float_as_uint(b);
  const float ra = __fsub_rn(a, __uint_as_float(ua & 0xffff0000u));  // exact: the low 16 bits of a
  const float rb = __fsub_rn(b, __uint_as_float(ub & 0xffff0000u));
  const uint32_t va = __float_as_uint(ra), vb = __float_as_uint(rb);
  const float la = __fsub_rn(ra, __uint_as_float(va & 0xffff0000u));  // exact, ≤ 8 significant bits
  const float lb = __fsub_rn(rb, __uint_as_float(vb & 0xffff0000u));
  Split3 s;
  // __byte_perm(x, y, 0x7632): low half = x's top 16 bits, high half = y's top 16 bits.
  s.hi = __byte_perm(ua, ub, 0x7632);
  s.mid = __byte_perm(va, vb, 0x7632);
  s.lo = __byte_perm(__float_as_uint(la), __float_as_uint(lb), 0x7632);
  return s;
}

// 16 bytes global → shared, asynchronous (cp.async.cg: through L2 only, not L1). cp16_zfill: `in`
// false writes 16 zero bytes and reads nothing (src must still be a valid address).
__device__ __forceinline__ void cp16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp16_zfill(void* dst, const void* src, bool in) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(in ? 16 : 0) : "memory");
}

// d += A · B for one m16n8k16 tile (bf16 inputs, fp32 accumulator), PTX fragment layouts.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Butterfly sum: every lane ends with the same bits (a + b == b + a in IEEE arithmetic).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum / max; blockDim.x a multiple of 32; `sh` holds ≥ 32 values. Order fixed by blockDim.
template <class T>
__device__ T block_sum(T v, T* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T t = lane < nw ? sh[lane] : T(0);
    t = warp_sum(t);
    if (lane == 0) sh[0] = t;
  }
  __syncthreads();
  const T r = sh[0];
  __syncthreads();
  return r;
}
__device__ inline float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nw ? sh[lane] : -__int_as_float(0x7f800000);
    t = warp_max(t);
    if (lane == 0) sh[0] = t;
  }
  __syncthreads();
  const float r = sh[0];
  __syncthreads();
  return r;
}

}  // namespace kd::cuda
