#include "backend/cuda/device_comm.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>

#include "backend/cpu/host_comm.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

#ifdef KDTREE_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>
#endif

namespace kd {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA: ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// What every rank publishes for one call; equal sizes on every rank are checked on every rank.
struct Published {
  void* ptr;
  int64_t a, b;
};

// Rank r of R ranks sharing one device: publication and ordering through the host communicator, the
// sums and copies through streams and events (DeviceComm's contract, device_comm.h).
class SharedDeviceComm final : public DeviceComm {
 public:
  SharedDeviceComm(Comm& host, std::vector<cudaEvent_t>& pub, std::vector<cudaEvent_t>& done)
      : host_(host), pub_(pub), done_(done) {}
  int32_t rank() const override { return host_.rank(); }
  int32_t size() const override { return host_.size(); }

  void all_reduce_sum(float* rows, int64_t n_rows, int64_t row_len, void* stream) override {
    const std::vector<Published> all = publish({rows, n_rows, row_len}, stream, "all_reduce_sum");
    const int32_t R = size(), r = rank();
    cuda::RankBuffers b;
    b.ranks = R;
    for (int32_t q = 0; q < R; ++q) b.p[q] = static_cast<float*>(all[size_t(q)].ptr);
    const int64_t n = n_rows * row_len;
    // Rank r owns elements [r·n/R, (r+1)·n/R): it reads them from every rank and writes the sum to all,
    // so no two ranks touch one element and each element's chain of adds is the same one.
    cuda::rank_order_sum(b, n * r / R, n * (r + 1) / R, static_cast<cudaStream_t>(stream));
    finish(stream);
  }

  void all_gather(const void* send, size_t n_bytes, void* recv, void* stream) override {
    const std::vector<Published> all = publish({const_cast<void*>(send), int64_t(n_bytes), 0}, stream, "all_gather");
    for (int32_t q = 0; q < size(); ++q)
      check(cudaMemcpyAsync(static_cast<uint8_t*>(recv) + size_t(q) * n_bytes, all[size_t(q)].ptr, n_bytes,
                            cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)),
            "all_gather copy");
    finish(stream);
  }

 private:
  // Records this rank's "partials ready", exchanges the buffers (checking the sizes agree) and makes the
  // stream wait for every rank's partials. The event of rank q is re-recorded only after the barrier in
  // finish(), by which time every rank has enqueued its wait on it.
  std::vector<Published> publish(Published mine, void* stream, const char* op) {
    const int32_t R = size(), r = rank();
    check(cudaEventRecord(pub_[size_t(r)], static_cast<cudaStream_t>(stream)), "publish");
    std::vector<Published> all(static_cast<size_t>(R));
    host_.all_gather(&mine, sizeof(mine), all.data());
    for (int32_t q = 0; q < R; ++q)
      if (all[size_t(q)].a != mine.a || all[size_t(q)].b != mine.b)
        fail("device comm: ", op, " sizes disagree: rank ", r, " has (", mine.a, ", ", mine.b, "), rank ", q, " (",
             all[size_t(q)].a, ", ", all[size_t(q)].b, ")");
    for (int32_t q = 0; q < R; ++q) check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), pub_[size_t(q)]), "wait partials");
    return all;
  }
  // Every rank's part is enqueued → the stream waits for all of them (no rank reads a buffer another
  // still writes, none overwrites its buffer before the others have read it).
  void finish(void* stream) {
    check(cudaEventRecord(done_[size_t(rank())], static_cast<cudaStream_t>(stream)), "done");
    host_.barrier();
    for (int32_t q = 0; q < size(); ++q) check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), done_[size_t(q)]), "wait sums");
  }

  Comm& host_;
  std::vector<cudaEvent_t>& pub_;
  std::vector<cudaEvent_t>& done_;
};

}  // namespace

struct SharedDeviceCommGroup::Impl {
  int device = 0;
  std::unique_ptr<HostRankThreads> threads;  // rank 0 runs on the caller's thread
  std::vector<cudaEvent_t> pub, done;  // [ranks]: rank r's "partials ready" and "sums enqueued"
};

SharedDeviceCommGroup::SharedDeviceCommGroup(int32_t ranks) : impl_(std::make_unique<Impl>()) {
  if (ranks < 1 || ranks > cuda::kMaxRanks) fail("device ranks: ", ranks, " (1 … ", cuda::kMaxRanks, ")");
  check(cudaGetDevice(&impl_->device), "cudaGetDevice");
  impl_->pub.resize(size_t(ranks));
  impl_->done.resize(size_t(ranks));
  for (int32_t r = 0; r < ranks; ++r) {
    check(cudaEventCreateWithFlags(&impl_->pub[size_t(r)], cudaEventDisableTiming), "event");
    check(cudaEventCreateWithFlags(&impl_->done[size_t(r)], cudaEventDisableTiming), "event");
  }
  impl_->threads = std::make_unique<HostRankThreads>(ranks);
}

SharedDeviceCommGroup::~SharedDeviceCommGroup() {
  impl_->threads.reset();
  for (size_t r = 0; r < impl_->pub.size(); ++r) cudaEventDestroy(impl_->pub[r]), cudaEventDestroy(impl_->done[r]);
}

int32_t SharedDeviceCommGroup::size() const { return int32_t(impl_->pub.size()); }

void SharedDeviceCommGroup::run(const std::function<void(DeviceComm&)>& fn) {
  impl_->threads->run([&](Comm& host) {
    check(cudaSetDevice(impl_->device), "cudaSetDevice");
    SharedDeviceComm comm(host, impl_->pub, impl_->done);
    fn(comm);
  });
}

void run_device_ranks(int32_t ranks, const std::function<void(DeviceComm&, void* stream)>& fn) {
  SharedDeviceCommGroup group(ranks);
  group.run([&](DeviceComm& comm) {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    std::exception_ptr e;
    try {
      fn(comm, s);
    } catch (...) {
      e = std::current_exception();
    }
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    if (e) std::rethrow_exception(e);
  });
}

#ifdef KDTREE_HAVE_NCCL
namespace {

// libnccl is opened at run time (KDTREE_NCCL_LIB, else libnccl.so.2 on the library path), so the binary
// starts — and runs on the CPU or one GPU — where NCCL is not installed; only NCCL's use needs it.
struct NcclApi {
  ncclResult_t (*comm_init_all)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;
  ncclResult_t (*get_version)(int*) = nullptr;
  std::string why;  // empty when loaded
};
const NcclApi& nccl() {
  static const NcclApi api = [] {
    NcclApi a;
    const char* env = std::getenv("KDTREE_NCCL_LIB");
    const std::string lib = env && *env ? env : "libnccl.so.2";
    void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      a.why = cat("cannot open ", lib, " (", e ? e : "?", "): install NCCL or point KDTREE_NCCL_LIB at libnccl.so.2");
      return a;
    }
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      if (!f && a.why.empty()) a.why = cat(lib, " has no ", name);
    };
    sym(a.comm_init_all, "ncclCommInitAll");
    sym(a.all_gather, "ncclAllGather");
    sym(a.comm_destroy, "ncclCommDestroy");
    sym(a.error_string, "ncclGetErrorString");
    sym(a.get_version, "ncclGetVersion");
    return a;
  }();
  return api;
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail("NCCL: ", what, ": ", nccl().error_string(r));
}

class NcclRank final : public DeviceComm {
 public:
  NcclRank(ncclComm_t c, int32_t rank, int32_t size) : comm_(c), rank_(rank), size_(size) {}
  ~NcclRank() override {
    if (scratch_) cudaFree(scratch_);
  }
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  void all_reduce_sum(float* rows, int64_t n_rows, int64_t row_len, void* stream) override {
    const int64_t n = n_rows * row_len;
    if (n <= 0) return;
    // The sizes are not exchanged here (NCCL would hang, not fail, on a mismatch): the sharded forward
    // derives them from the batch every rank holds.
    if (scratch_elems_ < n * size_) {
      if (scratch_) check(cudaFree(scratch_), "cudaFree");
      scratch_ = nullptr;
      void* mem = nullptr;
      check(cudaMalloc(&mem, size_t(n * size_) * 4), "NCCL scratch");
      scratch_ = static_cast<float*>(mem);
      scratch_elems_ = n * size_;
    }
    auto s = static_cast<cudaStream_t>(stream);
    nccl_check(nccl().all_gather(rows, scratch_, size_t(n), ncclFloat, comm_, s), "ncclAllGather");
    cuda::rank_order_sum_gathered(scratch_, size_, n, rows, s);
  }
  void all_gather(const void* send, size_t n_bytes, void* recv, void* stream) override {
    nccl_check(nccl().all_gather(send, recv, n_bytes, ncclUint8, comm_, static_cast<cudaStream_t>(stream)), "ncclAllGather");
  }

 private:
  ncclComm_t comm_;
  int32_t rank_, size_;
  float* scratch_ = nullptr;
  int64_t scratch_elems_ = 0;
};

}  // namespace

struct NcclCommGroup::Impl {
  std::vector<ncclComm_t> comms;
  std::vector<std::unique_ptr<NcclRank>> ranks;
};

NcclCommGroup::NcclCommGroup(const std::vector<int32_t>& devices) : impl_(std::make_unique<Impl>()) {
  if (devices.empty()) fail("NCCL: no devices");
  if (!nccl().why.empty()) fail("NCCL: ", nccl().why);
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast off (device/KINDS.md), unless the user says otherwise
  const int n = int(devices.size());
  impl_->comms.resize(size_t(n));
  std::vector<int> devs(devices.begin(), devices.end());
  nccl_check(nccl().comm_init_all(impl_->comms.data(), n, devs.data()), "ncclCommInitAll");
  for (int r = 0; r < n; ++r) impl_->ranks.push_back(std::make_unique<NcclRank>(impl_->comms[size_t(r)], r, n));
}

NcclCommGroup::~NcclCommGroup() {
  impl_->ranks.clear();
  for (ncclComm_t c : impl_->comms) nccl().comm_destroy(c);
}

int32_t NcclCommGroup::size() const { return int32_t(impl_->ranks.size()); }
DeviceComm& NcclCommGroup::rank(int32_t r) { return *impl_->ranks.at(size_t(r)); }
bool NcclCommGroup::available() { return nccl().why.empty(); }
std::string NcclCommGroup::version() {
  if (!nccl().why.empty()) return nccl().why;
  int v = 0;
  if (nccl().get_version(&v) != ncclSuccess) return "unknown";
  return cat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}
#else
struct NcclCommGroup::Impl {};
NcclCommGroup::NcclCommGroup(const std::vector<int32_t>&) {
  fail("NCCL: this build has no NCCL (configure where nccl.h and libnccl are installed)");
}
NcclCommGroup::~NcclCommGroup() = default;
int32_t NcclCommGroup::size() const { return 0; }
DeviceComm& NcclCommGroup::rank(int32_t) { fail("NCCL: this build has no NCCL"); }
bool NcclCommGroup::available() { return false; }
std::string NcclCommGroup::version() { return "this build has no NCCL"; }
#endif

}  // namespace kd
