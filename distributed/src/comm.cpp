// distributed/src/comm.cpp — a non-blocking NCCL communicator whose every wait has a timeout.
//
// NCCL's blocking calls can hang forever when a peer stalls or dies. Here the communicator is made
// with ncclCommInitRankConfig(blocking = 0); every call is followed by polling
// ncclCommGetAsyncError (and, for completion, cudaEventQuery on an event recorded after the
// collective) until it succeeds, fails, or the timeout passes. On a failure or a timeout the
// communicator is aborted (ncclCommAbort) and CommTimeout / std::runtime_error is thrown with the
// rank, the collective and the time waited — every healthy rank does the same within the timeout.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "deltacp/distributed/cp.h"
#include "deltacp/error.h"

namespace deltacp::dist {
namespace {

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }

ncclDataType_t nccl_type(int dtype) {
  switch (dtype) {
    case kF32: return ncclFloat32;
    case kF64: return ncclFloat64;
    case kBf16: return ncclBfloat16;
    case kF16: return ncclFloat16;
    default: throw_error("dtype", "expected kF32, kF64, kBf16 or kF16 (0..3), got ", dtype);
  }
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("deltacp: CUDA error in ") + what + ": " +
                                                 cudaGetErrorString(e));
}

// RAII: make `device` current for a scope.
struct DeviceGuard {
  int previous = 0;
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous), "cudaGetDevice");
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous); }
};

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw std::runtime_error(std::string("deltacp: ncclGetUniqueId: ") + ncclGetErrorString(r));
  return std::string(id.internal, sizeof(id.internal));
}

template <class Ready>
void NcclComm::poll(const std::string& what, Ready ready) {
  DELTACP_CHECK(comm_ != nullptr, "communicator", "the NCCL communicator was aborted by an earlier failure; "
                                                   "create a new CP context");
  const auto start = std::chrono::steady_clock::now();
  for (int spin = 0;; ++spin) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(as_comm(comm_), &async);
    if (q != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      const ncclResult_t bad = q != ncclSuccess ? q : async;
      std::ostringstream os;
      os << "deltacp: context parallelism: " << what << " on rank " << rank_ << " failed: " << ncclGetErrorString(bad)
         << " (" << ncclGetLastError(as_comm(comm_)) << "); the communicator was aborted";
      abort();
      throw std::runtime_error(os.str());
    }
    if (async == ncclSuccess && ready()) return;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s_) {
      std::ostringstream os;
      os << "deltacp: context parallelism: " << what << " on rank " << rank_ << " of " << world_
         << " did not complete within " << timeout_s_
         << " s (another rank stalled, exited or called a different collective); the NCCL communicator was "
            "aborted";
      abort();
      throw CommTimeout(os.str());
    }
    if (spin > 100) std::this_thread::sleep_for(std::chrono::microseconds(spin > 10000 ? 1000 : 50));
  }
}

NcclComm::NcclComm(const std::string& unique_id, int rank, int world, int device, double timeout_s)
    : rank_(rank), world_(world), device_(device), timeout_s_(timeout_s) {
  DELTACP_CHECK(unique_id.size() == sizeof(ncclUniqueId::internal), "unique_id", "expected ",
                sizeof(ncclUniqueId::internal), " bytes (from nccl_unique_id on rank 0), got ", unique_id.size());
  DELTACP_CHECK(world >= 1 && rank >= 0 && rank < world, "rank", "expected 0 <= rank < world = ", world, ", got ",
                rank);
  DELTACP_CHECK(timeout_s > 0, "timeout", "expected a positive number of seconds, got ", timeout_s);
  DeviceGuard guard(device);
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    throw std::runtime_error(std::string("deltacp: ncclCommInitRankConfig on rank ") + std::to_string(rank) + ": " +
                             ncclGetErrorString(r));
  }
  comm_ = comm;
  poll("creating the NCCL communicator", [] { return true; });
}

NcclComm::~NcclComm() {
  if (!comm_) return;
  try {
    DeviceGuard guard(device_);
    ncclCommFinalize(as_comm(comm_));  // non-blocking: completes asynchronously
    poll("finalizing the communicator", [] { return true; });
    if (comm_) ncclCommDestroy(as_comm(comm_));
  } catch (...) {
    // poll() aborted the communicator already; a destructor must not throw.
  }
  comm_ = nullptr;
}

void NcclComm::abort() {
  if (!comm_) return;
  ncclCommAbort(as_comm(comm_));
  comm_ = nullptr;
}

void NcclComm::wait(void* stream, const std::string& what) {
  DeviceGuard guard(device_);
  cudaEvent_t done = nullptr;
  cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventRecord(done, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
  try {
    poll(what, [&] {
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaErrorNotReady) return false;
      cuda_check(e, "cudaEventQuery");
      return true;
    });
  } catch (...) {
    cudaEventDestroy(done);
    throw;
  }
  cudaEventDestroy(done);
}

void NcclComm::all_gather(const void* send, void* recv, size_t count, int dtype, void* stream, bool wait_done) {
  DeviceGuard guard(device_);
  DELTACP_CHECK(comm_ != nullptr, "communicator", "the NCCL communicator was aborted by an earlier failure");
  const ncclResult_t r =
      ncclAllGather(send, recv, count, nccl_type(dtype), as_comm(comm_), static_cast<cudaStream_t>(stream));
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string text = ncclGetErrorString(r);
    abort();
    throw std::runtime_error("deltacp: ncclAllGather on rank " + std::to_string(rank_) + ": " + text);
  }
  poll("enqueuing the all-gather", [] { return true; });
  if (wait_done) wait(stream, "the all-gather of the CP states");
}

void NcclComm::all_reduce_max_i64(int64_t* buf, size_t count, void* stream) {
  DeviceGuard guard(device_);
  DELTACP_CHECK(comm_ != nullptr, "communicator", "the NCCL communicator was aborted by an earlier failure");
  const ncclResult_t r = ncclAllReduce(buf, buf, count, ncclInt64, ncclMax, as_comm(comm_),
                                       static_cast<cudaStream_t>(stream));
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string text = ncclGetErrorString(r);
    abort();
    throw std::runtime_error("deltacp: ncclAllReduce on rank " + std::to_string(rank_) + ": " + text);
  }
  poll("enqueuing the fingerprint all-reduce", [] { return true; });
  wait(stream, "the fingerprint all-reduce");
}

}  // namespace deltacp::dist
