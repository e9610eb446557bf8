#include "backend/cuda/cuda_ops.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace kd::cuda_ops {

using cuda::check;

namespace {

// A device buffer freed on scope exit.
struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { check(cudaMalloc(&p, bytes ? bytes : 16), "cudaMalloc"); }
  Buf(const void* host, size_t bytes) : Buf(bytes) { check(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "upload"); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

}  // namespace

void linear(const Weight& w, const float* x, int64_t m, float* y) {
  if (!w.int4 && w.dtype != DType::BF16) fail(w.name, ": the CUDA linear takes BF16 or INT4 weights");
  const size_t wb = w.int4 ? size_t(w.rows * (w.cols / 8)) * 4 : size_t(w.rows * w.cols) * 2;
  Buf dw(w.data, wb);
  std::unique_ptr<Buf> ds;
  cuda::DevMatrix d;
  d.rows = w.rows;
  d.cols = w.cols;
  d.int4 = w.int4;
  d.w = dw.p;
  if (w.int4) {
    if (w.group != 32) fail(w.name, ": INT4 group ", w.group, "; the CUDA kernels take 32");
    ds = std::make_unique<Buf>(w.scales, size_t(w.rows * (w.cols / 32)) * 2);
    d.scales = ds->as<uint16_t>();
  }
  Buf dx(x, size_t(m * w.cols) * 4), dy(size_t(m * w.rows) * 4);
  cuda::linear(d, dx.as<float>(), w.cols, m, dy.as<float>(), w.rows, cuda::Epilogue::store, nullptr);
  check(cudaMemcpy(y, dy.p, size_t(m * w.rows) * 4, cudaMemcpyDeviceToHost), "download");
}

void mla_attention(const MlaShape& s, const float* q, const std::vector<uint16_t>& cache, const std::vector<uint16_t>& kv_b,
                   const std::vector<int32_t>& vis_rows, const std::vector<int32_t>& vis_cnt, float* out) {
  Buf dq(q, size_t(s.n * s.H * (s.dn + s.dr)) * 4), dc(cache.data(), cache.size() * 2), dk(kv_b.data(), kv_b.size() * 2);
  // One contiguous sequence: a single block as long as the cache; key offset j past `start` is
  // cache row start + j (the lists may name offsets beyond n: rows of a larger tree in the cache).
  const int64_t n = s.n;
  int64_t nw = n;
  for (int32_t v : vis_rows) nw = std::max<int64_t>(nw, int64_t(v) + 1);
  std::vector<int32_t> lists;  // cnt | start | tab | base | voff | tables (1) | wrow (nw) | vis
  for (int64_t i = 0; i < n; ++i) lists.push_back(vis_cnt[size_t(i)]);
  for (int64_t i = 0; i < n; ++i) lists.push_back(int32_t(s.start));
  for (int64_t i = 0; i < n; ++i) lists.push_back(0);
  for (int64_t i = 0; i < n; ++i) lists.push_back(0);
  for (int64_t i = 0; i < n; ++i) lists.push_back(int32_t(i * n));
  lists.push_back(0);
  for (int64_t j = 0; j < nw; ++j) lists.push_back(int32_t(s.start + j));
  lists.insert(lists.end(), vis_rows.begin(), vis_rows.end());
  Buf dl(lists.data(), lists.size() * 4), dout(size_t(s.n * s.H * s.dv) * 4);
  Buf dql(size_t(s.n * s.H * s.Lr) * 4), dol(size_t(s.n * s.H * s.Lr) * 4);
  Buf dpart(size_t(cuda::mla_part_floats(s.n, s.H, s.Lr)) * 4);
  Buf dqf(size_t(cuda::mla_qfrag_bytes(s.n, s.H, s.Lr, s.dr)));
  const int32_t* L = dl.as<int32_t>();
  cuda::MlaParams p;
  p.q = dq.as<float>();
  p.kv_b = dk.as<uint16_t>();
  p.cache = dc.as<uint16_t>();
  p.keys = cuda::KeyLists{L,         L + n,          L + 2 * n, L + 5 * n + 1, L + 3 * n, L + 4 * n, L + 5 * n + 1 + nw,
                          L + 5 * n, std::max<int64_t>(1, int64_t(cache.size()) / (s.Lr + s.dr))};
  p.out = dout.as<float>();
  p.qlat = dql.as<float>();
  p.olat = dol.as<float>();
  p.part = dpart.as<float>();
  p.qfrag = dqf.as<uint32_t>();
  p.n = s.n;
  p.max_keys = s.start + (vis_cnt.empty() ? 1 : *std::max_element(vis_cnt.begin(), vis_cnt.end()));
  p.H = s.H;
  p.dn = s.dn;
  p.dr = s.dr;
  p.dv = s.dv;
  p.Lr = s.Lr;
  p.softmax_scale = s.softmax_scale;
  cuda::mla_attention(p, nullptr);
  check(cudaMemcpy(out, dout.p, size_t(s.n * s.H * s.dv) * 4, cudaMemcpyDeviceToHost), "download");
}

void route(const float* logits, const float* bias, int64_t n, int64_t E, int64_t K, int64_t G, int64_t topk_group,
           bool norm_topk_prob, float routed_scaling, int32_t* chosen, float* weights) {
  Buf dl(logits, size_t(n * E) * 4), db(bias, size_t(E) * 4), dc(size_t(n * K) * 4), dw(size_t(n * K) * 4);
  cuda::RouteParams p;
  p.E = E;
  p.K = K;
  p.G = G;
  p.topk_group = topk_group;
  p.norm_topk_prob = norm_topk_prob;
  p.routed_scaling = routed_scaling;
  cuda::route(dl.as<float>(), db.as<float>(), n, p, dc.as<int32_t>(), dw.as<float>(), nullptr);
  check(cudaMemcpy(chosen, dc.p, size_t(n * K) * 4, cudaMemcpyDeviceToHost), "download");
  check(cudaMemcpy(weights, dw.p, size_t(n * K) * 4, cudaMemcpyDeviceToHost), "download");
}

}  // namespace kd::cuda_ops
