// The communicator between tensor-parallel ranks (issue 14): what a sharded forward needs and nothing
// more — a sum of fp32 partial rows, a gather of bytes, rank/size and a barrier. Implementations:
// backend/cpu/host_comm.h (R in-process ranks, one thread each: CI tests TP on every commit); NCCL on
// GPUs is not built yet.
//
// The contract every implementation keeps (DESIGN.md §2 exactness, §6): all_reduce_sum is
// DETERMINISTIC and ROW-INVARIANT. Each element's result is the ranks' partials added in rank order in
// fp32, starting from rank 0's value — ((p0 + p1) + p2) + … — and every rank receives the same bits. That
// order depends on nothing else: not on the number of rows in the call, nor on a row's place among them.
// So a verify pass that reduces N + 1 rows gives each row exactly the bits an AR step reducing that row
// alone gives, and DDTree == AR survives TP. NCCL's ring/tree all-reduce makes no such promise (its
// algorithm, chunking and hence summation order depend on the message size), which is why a production
// path must gather partials and sum them in rank order rather than call ncclAllReduce.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kd {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;

  // In place on `rows` [n_rows, row_len] fp32, row-major: every rank passes its partials and receives the
  // rank-order sum above. Every rank must pass the same n_rows and row_len; a mismatch is an Error on
  // every rank (naming each rank's sizes), never a hang or a silent misread.
  virtual void all_reduce_sum(float* rows, int64_t n_rows, int64_t row_len) = 0;

  // recv [size() × n_bytes]: rank r's `send` [n_bytes] lands at recv + r × n_bytes, on every rank
  // (e.g. each rank's (value, index) argmax of its lm_head slice). Sizes must match as above.
  virtual void all_gather(const void* send, size_t n_bytes, void* recv) = 0;

  // Returns once every rank has called it.
  virtual void barrier() = 0;
};

}  // namespace kd
