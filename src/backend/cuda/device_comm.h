// Communicators whose partial sums live in GPU memory (issue 14): the device twins of backend/comm.h,
// keeping its contract — all_reduce_sum is DETERMINISTIC and ROW-INVARIANT, each element the ranks'
// partials added in rank order in fp32, ((p0 + p1) + p2) + …, the same bits on every rank whatever the
// number of rows — but enqueued on the caller's stream instead of finishing before they return.
// A plain C++ header (streams travel as void*: a cudaStream_t of the rank's device).
//
// Two implementations:
// - SharedDeviceCommGroup: R ranks on ONE device, a host thread and a stream each — the single-GPU
//   emulation of a TP host (tests of the sharded math, the per-rank timings in docs/perf.md). Ranks
//   publish their buffers through a host communicator (backend/cpu/host_comm.h, which also makes
//   disagreeing sizes an Error on every rank); rank r then sums its slice of the elements from every
//   rank's buffer and writes the sum back to all of them, after waiting for every rank's partials.
// - NcclCommGroup: one rank per GPU of this host (ncclCommInitAll; NVLink multicast off, NVLS would
//   change nothing here but KINDS.md asks for it). all_reduce_sum is ncclAllGather of the partials and
//   the same rank-order sum on every rank — never ncclAllReduce, whose summation order depends on the
//   message size (ring vs tree, chunking), so a verify row would not equal its AR row.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kd {

class DeviceComm {
 public:
  virtual ~DeviceComm() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  // rows [n_rows, row_len] fp32 in this rank's device memory, in place: the rank-order sum above, on
  // every rank. Every rank passes the same n_rows and row_len (else an Error on every rank).
  virtual void all_reduce_sum(float* rows, int64_t n_rows, int64_t row_len, void* stream) = 0;
  // recv [size() × n_bytes] device memory: rank q's send [n_bytes] lands at recv + q × n_bytes.
  virtual void all_gather(const void* send, size_t n_bytes, void* recv, void* stream) = 0;
};

// R ranks on the current device, its events made once (a tensor-parallel target holds one for its
// life). run(fn) runs fn once on every rank — rank 0 on the caller's thread, the others on kept threads
// (HostRankThreads) — each with its communicator, and rethrows the first exception;
// a rank that fails leaves the group, so the others' pending calls fail rather than wait.
class SharedDeviceCommGroup {
 public:
  explicit SharedDeviceCommGroup(int32_t ranks);
  ~SharedDeviceCommGroup();
  SharedDeviceCommGroup(const SharedDeviceCommGroup&) = delete;
  SharedDeviceCommGroup& operator=(const SharedDeviceCommGroup&) = delete;
  int32_t size() const;
  void run(const std::function<void(DeviceComm&)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A group of `ranks` for one run, each rank's thread with a stream of its own (synchronised before fn
// returns): the tests' and the bench's form.
void run_device_ranks(int32_t ranks, const std::function<void(DeviceComm&, void* stream)>& fn);

// NCCL over the GPUs `devices` of this host, rank r on devices[r]. Use rank(r) from one thread per rank
// (each thread sets its device first: cudaSetDevice(devices[r])). Throws naming NCCL's error (or that
// this build has no NCCL).
class NcclCommGroup {
 public:
  explicit NcclCommGroup(const std::vector<int32_t>& devices);
  ~NcclCommGroup();
  NcclCommGroup(const NcclCommGroup&) = delete;
  NcclCommGroup& operator=(const NcclCommGroup&) = delete;
  int32_t size() const;
  DeviceComm& rank(int32_t r);
  static bool available();       // this build links NCCL
  static std::string version();  // "2.27.3", or why there is none

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kd
