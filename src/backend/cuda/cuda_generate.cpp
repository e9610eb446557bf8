#include "backend/cuda/cuda_generate.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "core/log.h"
#include "sample/rng.h"
#include "sample/sampler.h"
#include "model/dflash_cuda.h"
#include "model/deepseek_v3_cuda_impl.h"
#include "backend/cuda/kernels.h"
#include "decode/round.h"
#include "decode/tree.h"

namespace kd {

using cuda::check;

namespace {

// forward_impl with the logits left on the device (m.logits, [n or 1, vocab]) and no wait.
const float* forward_logits_on_device(CudaTarget::Impl& m, const ForwardArgs& a, bool device_taps,
                                      std::vector<int32_t>* distinct) {
  return forward_impl(m, a, device_taps, true, distinct);
}

// Device scratch of the greedy verify: argmax ids and their values, [rows] each.
struct ArgmaxScratch {
  int64_t rows = 0;
  int32_t* ids = nullptr;
  float* vals = nullptr;
  ~ArgmaxScratch() {
    if (ids) cudaFree(ids);
    if (vals) cudaFree(vals);
  }
  void reserve(int64_t n) {
    if (n <= rows) return;
    if (ids) cudaFree(ids);
    if (vals) cudaFree(vals);
    ids = nullptr;
    vals = nullptr;
    rows = 0;
    check(cudaMalloc(reinterpret_cast<void**>(&ids), size_t(n) * 4), "allocate verify argmax");
    check(cudaMalloc(reinterpret_cast<void**>(&vals), size_t(n) * 4), "allocate verify argmax");
    rows = n;
  }
};

// argmax_rows over the forward's logits [n, V] on the device (lowest index on ties, −1 on NaN:
// sample()'s greedy choice) and the values it picked (−inf: the row has nothing selectable);
// downloads both (n × 8 bytes) and waits, then counts the forward's weight bytes.
void pick_on_device(CudaTarget::Impl& m, ArgmaxScratch& am, int64_t n, const std::vector<int32_t>& distinct,
                   ForwardStats* stats, std::vector<int32_t>& ids, std::vector<float>& vals) {
  const int64_t V = m.cfg.vocab_size;
  am.reserve(n);
  cuda::argmax_rows(m.logits, n, V, am.ids, m.stream);
  cuda::gather_row_values(m.logits, V, am.ids, n, am.vals, m.stream);
  ids.resize(size_t(n));
  vals.resize(size_t(n));
  check(cudaMemcpyAsync(ids.data(), am.ids, size_t(n) * 4, cudaMemcpyDeviceToHost, m.stream), "download argmax");
  check(cudaMemcpyAsync(vals.data(), am.vals, size_t(n) * 4, cudaMemcpyDeviceToHost, m.stream), "download argmax");
  check(cudaStreamSynchronize(m.stream), "forward");
  if (stats) stats->weight_bytes += m.weight_bytes_of(n, &distinct, n);
}

bool plain_pick(int32_t id, float val) { return id >= 0 && val != -std::numeric_limits<float>::infinity(); }

// Row `row` of the forward's logits [·, V], downloaded (a row the device pick cannot settle).
void download_row(CudaTarget::Impl& m, int64_t row, std::vector<float>& out) {
  out.resize(static_cast<size_t>(m.cfg.vocab_size));
  check(cudaMemcpy(out.data(), m.logits + row * m.cfg.vocab_size, out.size() * 4, cudaMemcpyDeviceToHost), "download logits row");
}

}  // namespace

GenerateResult generate_ar_cuda(CudaTarget& target, const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                                const std::function<void(int32_t)>& on_token, const CudaRoundOptions& round) {
  const ModelConfig& c = target.config();
  const GenerationLimits lim = check_generation(c, prompt, opt);
  const int64_t n_prompt = lim.n_prompt, n_max = lim.n_max, V = c.vocab_size;
  if (n_prompt + n_max > target.max_tokens())
    fail("the CUDA cache holds ", target.max_tokens(), " tokens; this request needs ", n_prompt + n_max);
  target.reset();
  GenerateResult r;
  r.n_prompt = n_prompt;
  if (n_max == 0) {
    r.finish_reason = "length";
    return r;
  }
  std::vector<float> logits(static_cast<size_t>(opt.keep_prompt_logits ? n_prompt * V : V));
  ForwardStats st;
  double t0 = now_s();
  ForwardArgs a;
  a.ids = prompt.data();
  a.n = n_prompt;
  a.all_logits = opt.keep_prompt_logits;
  a.logits = logits.data();
  a.stats = &st;
  target.forward(a);
  r.prefill_ms = (now_s() - t0) * 1e3;
  r.n_target_forwards = 1;
  r.prefill_weight_bytes = st.weight_bytes;
  if (opt.keep_prompt_logits) r.prompt_logits = logits;
  const float* last = logits.data() + (opt.keep_prompt_logits ? (n_prompt - 1) * V : 0);
  std::vector<float> step(last, last + V);
  st = {};
  t0 = now_s();
  // Greedy decode without kept logits: each step's argmax on the device, 8 bytes down, not V × 4.
  const bool device_pick = opt.sampling.temperature == 0.0f && !opt.keep_logits && round.device_argmax;
  CudaTarget::Impl& m = target.impl();
  ArgmaxScratch am;
  std::vector<int32_t> pick_ids, distinct;
  std::vector<float> pick_vals;
  bool step_on_host = true;  // `step` holds this position's logits (the prefill's; host decode steps)
  for (int64_t i = 0;; ++i) {
    const int64_t pos = n_prompt + i;
    int32_t tok;
    if (!step_on_host && plain_pick(pick_ids[0], pick_vals[0])) {
      tok = pick_ids[0];
    } else {
      if (!step_on_host) download_row(m, 0, step);  // NaN or all −inf: sample() throws the CPU's error
      tok = sample(step.data(), int32_t(V), opt.sampling, position_uniform(opt.sampling.seed, opt.seq_id, uint64_t(pos)));
    }
    r.output_ids.push_back(tok);
    if (opt.keep_logits) r.logits.insert(r.logits.end(), step.begin(), step.end());
    if (on_token) on_token(tok);
    if (!opt.ignore_eos && std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) {
      r.finish_reason = "stop";
      break;
    }
    if (int64_t(r.output_ids.size()) >= n_max) {
      r.finish_reason = "length";
      break;
    }
    ForwardArgs d;
    d.ids = &tok;
    d.n = 1;
    d.stats = &st;
    if (device_pick) {
      forward_logits_on_device(m, d, false, &distinct);
      pick_on_device(m, am, 1, distinct, &st, pick_ids, pick_vals);
      step_on_host = false;
    } else {
      d.logits = step.data();
      target.forward(d);
    }
    ++r.n_target_forwards;
  }
  r.decode_ms = (now_s() - t0) * 1e3;
  r.decode_weight_bytes = st.weight_bytes;
  return r;
}

SpecResult generate_ddtree_cuda(CudaTarget& target, Drafter& drafter, const std::vector<int32_t>& prompt,
                                const GenerateOptions& opt, const SpecOptions& spec,
                                const std::function<void(int32_t)>& on_token, const CudaRoundOptions& round) {
  const ModelConfig& c = target.config();
  if (!spec.chain && spec.budget < 1) fail("--budget must be at least 1 (got ", spec.budget, ")");
  const GenerationLimits lim = check_generation(c, prompt, opt);
  const int64_t ctx = lim.ctx, n_prompt = lim.n_prompt, n_max = lim.n_max;
  const int64_t B = drafter.block_size(), V = c.vocab_size, hid = c.hidden_size;
  if (drafter.context_len() != 0) fail("the drafter already holds context: use a fresh drafter per generation");
  const int64_t max_nodes = spec.chain ? B - 1 : spec.budget;
  if (n_prompt + n_max + max_nodes + 1 > target.max_tokens())
    fail("the CUDA cache holds ", target.max_tokens(), " tokens; this request needs ", n_prompt + n_max + max_nodes + 1);
  target.reset();
  SpecResult res;
  GenerateResult& r = res.gen;
  SpecStats& st = res.stats;
  st.tau_histogram.assign(size_t(B + 1), 0);
  r.n_prompt = n_prompt;
  if (n_max == 0) {
    r.finish_reason = "length";
    return res;
  }
  const std::vector<int32_t>& taps_of = drafter.tap_layers();
  const int64_t n_taps = int64_t(taps_of.size());
  ForwardStats fst;
  bool done = false;
  auto emit = [&](int32_t tok, const float* logits) {
    r.output_ids.push_back(tok);
    if (opt.keep_logits) r.logits.insert(r.logits.end(), logits, logits + V);
    if (on_token) on_token(tok);
    if (!opt.ignore_eos && std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) {
      r.finish_reason = "stop";
      done = true;
    } else if (int64_t(r.output_ids.size()) >= n_max) {
      r.finish_reason = "length";
      done = true;
    }
    return !done;
  };
  auto choose = [&](const float* logits, int64_t pos) {
    return sample(logits, int32_t(V), opt.sampling, position_uniform(opt.sampling.seed, opt.seq_id, uint64_t(pos)));
  };

  // A drafter on the GPU reads the target's taps where the forward left them (no download of taps,
  // no upload of kept rows); any other drafter gets them on the host.
  CudaDFlash* gpu_drafter = dynamic_cast<CudaDFlash*>(&drafter);
  const bool host_taps = n_taps && !gpu_drafter;
  auto run_forward = [&](ForwardArgs& a, std::vector<float>& host) -> const float* {
    a.tap_layers = &taps_of;
    a.stats = &fst;
    if (gpu_drafter && n_taps) return target.forward_device_taps(a);
    host.resize(static_cast<size_t>(a.n * n_taps * hid));
    a.taps = host_taps ? host.data() : nullptr;
    target.forward(a);
    return nullptr;
  };

  std::vector<float> logits(static_cast<size_t>(V)), taps;
  double t0 = now_s();
  {
    ForwardArgs a;
    a.ids = prompt.data();
    a.n = n_prompt;
    a.logits = logits.data();
    const float* taps_dev = run_forward(a, taps);
    if (taps_dev)
      gpu_drafter->append_context_device(taps_dev, n_prompt, nullptr);
    else
      drafter.append_context(host_taps ? taps.data() : nullptr, n_prompt);
  }
  r.prefill_ms = st.prefill_ms = (now_s() - t0) * 1e3;
  r.prefill_weight_bytes = fst.weight_bytes;
  st.target_forwards = 1;
  fst = {};

  t0 = now_s();
  int32_t bonus = choose(logits.data(), n_prompt);
  emit(bonus, logits.data());
  // Round paths (cuda_generate.h): the tree builder's top-k from a GPU drafter's device logits
  // (draft_round asks the drafter); at temperature 0, the verify rows' argmax on the device
  // (sample() is argmax there).
  const bool device_argmax = opt.sampling.temperature == 0.0f && round.device_argmax;
  CudaTarget::Impl& m = target.impl();
  ArgmaxScratch am;
  std::vector<int32_t> am_ids, distinct;
  std::vector<float> am_vals, rows_h, bad_row;
  std::vector<float> draft_logits, vlogits, vtaps, acc_taps;
  while (!done) {
    const int64_t start = target.size();
    const int64_t L = std::min({B - 1, ctx - 1 - start, n_max - int64_t(r.output_ids.size())});
    if (L < 1) fail("internal: no draft position left at ", start);
    double td = now_s();
    const DraftRound dr = draft_round(drafter, bonus, start, L, spec, V, draft_logits, round.device_top_k);
    st.draft_ms += (now_s() - td) * 1e3;

    const int64_t n = dr.tree.size();
    double tv = now_s();
    ForwardArgs a;
    a.ids = dr.tree.tokens.data();
    a.n = n;
    a.positions = dr.positions.data();
    a.visibility = dr.visibility.data();
    a.commit = false;
    a.all_logits = true;
    const float* vtaps_dev = nullptr;
    if (device_argmax) {
      // Logits stay on the device: their argmax per row (lowest index on ties, −1 on NaN, as
      // sample() at temperature 0) and the value it picked (−inf: the row has no selectable token).
      a.tap_layers = &taps_of;
      a.stats = &fst;
      if (host_taps) {
        vtaps.resize(static_cast<size_t>(n * n_taps * hid));
        a.taps = vtaps.data();
      }
      vtaps_dev = forward_logits_on_device(m, a, gpu_drafter && n_taps, &distinct);
      pick_on_device(m, am, n, distinct, &fst, am_ids, am_vals);
    } else {
      vlogits.resize(static_cast<size_t>(n * V));
      a.logits = vlogits.data();
      vtaps_dev = run_forward(a, vtaps);
    }
    if (!(gpu_drafter && n_taps)) vtaps_dev = nullptr;
    st.verify_ms += (now_s() - tv) * 1e3;
    ++st.target_forwards;
    ++st.rounds;
    st.drafted += n - 1;

    std::vector<int32_t> path;
    if (device_argmax) {
      // A row whose argmax is not a plain pick (NaN, or all −inf) goes to the host sampler, which
      // throws the CPU path's error.
      auto plain = [&](int32_t node) { return plain_pick(am_ids[size_t(node)], am_vals[size_t(node)]); };
      auto row_of = [&](int32_t node, std::vector<float>& buf) {
        download_row(m, node, buf);
        return buf.data();
      };
      // The path the walk will take (no side effects), so the logits of its rows alone come down
      // when the caller keeps logits: one copy per row, one sync.
      std::vector<int32_t> walk = {0};
      while (plain(walk.back())) {
        const int32_t child = dr.tree.child_with_token(walk.back(), am_ids[size_t(walk.back())]);
        if (child < 0) break;
        walk.push_back(child);
      }
      if (opt.keep_logits) {
        rows_h.resize(walk.size() * size_t(V));
        for (size_t k = 0; k < walk.size(); ++k)
          check(cudaMemcpyAsync(&rows_h[k * size_t(V)], m.logits + int64_t(walk[k]) * V, size_t(V) * 4, cudaMemcpyDeviceToHost,
                                m.stream),
                "download accepted logits");
        check(cudaStreamSynchronize(m.stream), "accepted logits");
      }
      // accept_walk over the downloaded choices: the same emits in the same order.
      path = {0};
      int32_t cur = 0;
      for (size_t k = 0;; ++k) {
        const int64_t pos = start + dr.tree.depths[size_t(cur)] + 1;
        const float* lg = opt.keep_logits && k < walk.size() ? &rows_h[k * size_t(V)] : nullptr;
        const int32_t tok = plain(cur) ? am_ids[size_t(cur)] : choose(lg ? lg : row_of(cur, bad_row), pos);
        if (opt.keep_logits && !lg) lg = row_of(cur, bad_row);
        if (!emit(tok, lg)) break;
        const int32_t child = dr.tree.child_with_token(cur, tok);
        if (child < 0) {
          bonus = tok;
          break;
        }
        cur = child;
        path.push_back(child);
      }
    } else {
      path = accept_walk(dr.tree, vlogits.data(), V, start, choose, emit, &bonus);
    }
    const int64_t tau = int64_t(path.size());
    st.accepted += tau - 1;
    ++st.tau_histogram[size_t(std::min(tau, B))];
    if (done) break;
    target.compact(start, path);
    if (vtaps_dev) {
      gpu_drafter->append_context_device(vtaps_dev, tau, path.data());
      continue;
    }
    acc_taps.resize(static_cast<size_t>(tau * n_taps * hid));
    for (int64_t k = 0; k < tau && host_taps; ++k)
      std::copy_n(&vtaps[size_t(path[size_t(k)]) * size_t(n_taps * hid)], n_taps * hid, &acc_taps[size_t(k * n_taps * hid)]);
    drafter.append_context(host_taps ? acc_taps.data() : nullptr, tau);
  }
  r.decode_ms = (now_s() - t0) * 1e3;
  r.decode_weight_bytes = fst.weight_bytes;
  r.n_target_forwards = st.target_forwards;
  return res;
}

}  // namespace kd
