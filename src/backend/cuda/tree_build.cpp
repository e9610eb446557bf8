// DeviceDraftTree (tree_build.h): the buffers around the device tree build.
#include "backend/cuda/tree_build.h"

#include <cstring>

#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "sample/top_k.h"

namespace kd {

using cuda::check;

namespace {
constexpr int64_t kHead = 4;  // int32s before the arrays: size, then padding to 16 bytes
size_t out_bytes(int64_t cap) {
  const size_t i32 = size_t(kHead + 5 * (cap + 1)) * 4;
  return (i32 + 15) / 16 * 16 + size_t(cap + 1) * 8;
}
}  // namespace

DeviceDraftTree::~DeviceDraftTree() {
  if (out_) cudaFree(out_);
  if (vis_) cudaFree(vis_);
  if (clock_) cudaFree(clock_);
  if (in_) cudaFree(in_);
  if (in_host_) cudaFreeHost(in_host_);
}

const int32_t* DeviceDraftTree::out_i32(int which) const {
  const auto* p = static_cast<const int32_t*>(out_);
  return which == 0 ? p : p + kHead + (which - 1) * (cap_ + 1);
}

void DeviceDraftTree::reserve_out(int64_t budget) {
  if (budget <= cap_) return;
  if (out_) cudaFree(out_);
  if (vis_) cudaFree(vis_);
  out_ = nullptr, vis_ = nullptr, cap_ = 0;
  check(cudaMalloc(&out_, out_bytes(budget)), "allocate device draft tree");
  check(cudaMalloc(reinterpret_cast<void**>(&vis_), size_t((budget + 1) * (budget + 1))), "allocate device tree mask");
  cap_ = budget;
}

void DeviceDraftTree::reserve_in(int64_t positions, int64_t k) {
  const size_t need = size_t(positions * k) * 8 + size_t(positions) * 8;
  if (need <= in_bytes_) return;
  if (in_) cudaFree(in_);
  if (in_host_) cudaFreeHost(in_host_);
  in_ = in_host_ = nullptr, in_bytes_ = 0;
  check(cudaMalloc(&in_, need), "allocate device top-k");
  check(cudaMallocHost(&in_host_, need), "allocate pinned top-k");
  in_bytes_ = need;
}

void DeviceDraftTree::build(const int32_t* ids_dev, const float* logp_dev, const int64_t* valid_dev, int64_t positions,
                            int64_t k, int64_t budget, int32_t root_token, int64_t start, cudaStream_t s) {
  if (budget < 1 || budget > cuda::kDeviceTreeMaxBudget)
    fail("device draft tree: budget must be in [1, ", cuda::kDeviceTreeMaxBudget, "] (got ", budget, ")");
  if (k < 1 || k > budget) fail("device draft tree: k must be in [1, budget = ", budget, "] (got ", k, ")");
  reserve_out(budget);
  if (!clock_) check(cudaMalloc(reinterpret_cast<void**>(&clock_), 16), "allocate tree clock");
  auto* o = static_cast<int32_t*>(out_);
  cuda::DraftTreeArgs a;
  a.ids = ids_dev, a.logp = logp_dev, a.valid = valid_dev;
  a.positions = int32_t(positions), a.k = int32_t(k), a.budget = int32_t(budget);
  if (positions != a.positions) fail("device draft tree: ", positions, " positions");
  a.root_token = root_token, a.start = start;
  a.size = o;
  a.tokens = o + kHead;
  a.depths = a.tokens + (cap_ + 1);
  a.parents = a.depths + (cap_ + 1);
  a.ranks = a.parents + (cap_ + 1);
  a.rope_pos = a.ranks + (cap_ + 1);
  const size_t i32 = size_t(kHead + 5 * (cap_ + 1)) * 4;
  a.scores = reinterpret_cast<double*>(static_cast<char*>(out_) + (i32 + 15) / 16 * 16);
  a.visibility = vis_;
  a.pop_clock = clock_;
  cuda::build_draft_tree(a, s);
  last_budget_ = budget;
}

void DeviceDraftTree::build(const DraftTopK& top, int64_t budget, int32_t root_token, int64_t start, cudaStream_t s) {
  const int64_t P = top.positions, k = top.k;
  if (P < 1 || k < 1 || top.ids.size() != size_t(P * k) || top.logp.size() != top.ids.size() ||
      top.valid.size() != size_t(P))
    fail("device draft tree: malformed top-k (", P, " positions × ", k, ")");
  reserve_in(P, k);
  // [valid P int64 | ids P·k int32 | logp P·k fp32]: the int64s first keep their alignment.
  auto* h = static_cast<char*>(in_host_);
  std::memcpy(h, top.valid.data(), size_t(P) * 8);
  std::memcpy(h + P * 8, top.ids.data(), size_t(P * k) * 4);
  std::memcpy(h + P * 8 + P * k * 4, top.logp.data(), size_t(P * k) * 4);
  check(cudaMemcpyAsync(in_, in_host_, size_t(P * 8 + P * k * 8), cudaMemcpyHostToDevice, s), "upload top-k");
  auto* d = static_cast<char*>(in_);
  build(reinterpret_cast<const int32_t*>(d + P * 8), reinterpret_cast<const float*>(d + P * 8 + P * k * 4),
        reinterpret_cast<const int64_t*>(d), P, k, budget, root_token, start, s);
}

DeviceTreeHost DeviceDraftTree::download(cudaStream_t s) {
  if (!out_) fail("device draft tree: nothing built");
  std::vector<char> o(out_bytes(cap_));
  check(cudaMemcpyAsync(o.data(), out_, o.size(), cudaMemcpyDeviceToHost, s), "download device tree");
  check(cudaStreamSynchronize(s), "device draft tree");
  const auto* i = reinterpret_cast<const int32_t*>(o.data());
  const int32_t n = i[0];
  if (n < 1 || n > last_budget_ + 1) fail("device draft tree: size ", n, " outside [1, ", last_budget_ + 1, "]");
  DeviceTreeHost t;
  auto take = [&](int which, std::vector<int32_t>& v) {
    const int32_t* p = i + kHead + (which - 1) * (cap_ + 1);
    v.assign(p, p + n);
  };
  take(1, t.tokens), take(2, t.depths), take(3, t.parents), take(4, t.ranks), take(5, t.rope_pos);
  const size_t i32 = size_t(kHead + 5 * (cap_ + 1)) * 4;
  const auto* sc = reinterpret_cast<const double*>(o.data() + (i32 + 15) / 16 * 16);
  t.scores.assign(sc, sc + n);
  t.visibility.resize(size_t(n) * size_t(n));
  check(cudaMemcpy(t.visibility.data(), vis_, t.visibility.size(), cudaMemcpyDeviceToHost), "download tree mask");
  return t;
}

std::pair<int64_t, int64_t> DeviceDraftTree::last_pop_clock(cudaStream_t s) const {
  int64_t c[2] = {0, 0};
  if (!clock_) fail("device draft tree: nothing built");
  check(cudaMemcpyAsync(c, clock_, sizeof c, cudaMemcpyDeviceToHost, s), "download tree clock");
  check(cudaStreamSynchronize(s), "device draft tree");
  return {c[0], c[1]};
}

}  // namespace kd
