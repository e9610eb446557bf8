// The host communicator: R tensor-parallel ranks inside one process, one thread each (the CPU backend's
// emulation of a multi-GPU host, so CI tests TP 2/4/8 on every commit). It keeps comm.h's contract —
// rank-order, row-invariant fp32 sums, the same bits on every rank — by construction: each rank publishes
// a pointer to its partials, and element i of the result is computed once, as
// ((p0[i] + p1[i]) + p2[i]) + …, by whichever rank owns i's slice of the flat buffer; which rank computes
// it, how many rows travel, and where the row sits change nothing about that sequence of fp32 adds.
// Synchronisation is two std::barrier phases per call (publish; done) and one for barrier().
//
// A rank that stops — returns, or throws — leaves the group (run_host_ranks does it): every other rank's
// next or pending call then fails with an Error naming it, instead of waiting forever. Calls that disagree
// between ranks (sizes, or one rank reducing while another gathers) fail on every rank with each rank's
// numbers; all ranks fail the same call, so a caller that catches the Error may carry on in step.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "backend/comm.h"

namespace kd {

class HostCommGroup {
 public:
  explicit HostCommGroup(int32_t ranks);  // ranks ≥ 1
  ~HostCommGroup();
  HostCommGroup(const HostCommGroup&) = delete;
  HostCommGroup& operator=(const HostCommGroup&) = delete;

  int32_t size() const;
  // The communicator of rank r; it is used by one thread.
  Comm& rank(int32_t r);
  // Rank r will make no more calls (`why` appears in the others' errors). Called once per rank, by its thread.
  void leave(int32_t r, const std::string& why);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// R rank threads kept for the life of a tensor-parallel target, so that a forward costs two wake-ups,
// not R thread starts (≈ 0.1–4 ms at R = 2–8 on a 2-core machine). run(fn) runs fn once on every rank —
// rank 0 on the calling thread, ranks 1 … R−1 on the kept threads — each with its rank(r) communicator
// of a group made for this call, waits for all, and rethrows the first exception thrown (in time: the
// cause, not the others' "rank r left" errors). One run at a time.
class HostRankThreads {
 public:
  explicit HostRankThreads(int32_t ranks);
  ~HostRankThreads();
  HostRankThreads(const HostRankThreads&) = delete;
  HostRankThreads& operator=(const HostRankThreads&) = delete;
  int32_t size() const;
  void run(const std::function<void(Comm&)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One run over threads made for it (tests, one-off work).
void run_host_ranks(int32_t ranks, const std::function<void(Comm&)>& fn);

}  // namespace kd
