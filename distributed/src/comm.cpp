// distributed/src/comm.cpp — a non-blocking NCCL communicator whose every wait has a timeout and
// whose failure is final (the life cycle is spelled out in deltacp/distributed/cp.h).
//
// NCCL's blocking calls can hang forever when a peer stalls or dies. Here the communicator is made
// with ncclCommInitRankConfig(blocking = 0) (and the all-gathers' blocking one split from it, whose
// calls return once enqueued: cp.h says why that is safe); every call is followed by polling
// ncclCommGetAsyncError (and, for completion, cudaEventQuery on an event recorded after the
// collective) until it succeeds, fails, or the timeout passes. On a failure or a timeout the
// communicator becomes dead: it is stopped once (ncclCommRevoke, or ncclCommAbort when the loaded
// NCCL has no revoke) under the lock that serialises all NCCL calls on it, and CommTimeout /
// std::runtime_error is thrown with the rank, the collective and the time waited. Every later call
// throws CommDead before touching NCCL or CUDA; the destructor of a dead communicator does nothing.
//
// Why (the GPU fault tests' healthy rank died with SIGSEGV at the timeout instead of raising; the
// causes below are from reading the code and NCCL's documented abort rules, not yet confirmed on
// GPUs): the previous version ran the collective on the caller's stream (torch's legacy default stream), called
// ncclCommAbort — which frees the communicator's device, host and IPC memory at once — while the
// all-gather kernel was still in flight on that stream and the peer was stalled or gone, left the
// communicator alive after a CUDA error in the wait (so the destructor later ran
// ncclCommFinalize/Destroy, a graceful teardown, on a broken communicator, possibly from the
// garbage collector), and let abort() race with a wait in another thread (the GIL is released while
// waiting). The GPU fault tests (distributed/tests/gpu_cp_check.py) reproduce both.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <optional>
#include <system_error>
#include <thread>

#include "deltacp/distributed/cp.h"
#include "deltacp/error.h"

namespace deltacp::dist {
namespace {

constexpr double kStopWaitS = 10.0;      // at most this long for a revoke to quiesce
constexpr double kTeardownWaitS = 30.0;  // at most this long for the destructor's finalize
constexpr double kSpinS = 5e-3;          // poll() spins this long before it sleeps between looks
void* const kNoCallerStream = reinterpret_cast<void*>(~uintptr_t{0});  // enqueue(): depend on no caller stream

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

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

// The same, for code that must not throw (errors are ignored: the device is best effort there).
struct QuietDeviceGuard {
  int previous = -1;
  explicit QuietDeviceGuard(int device) {
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    (void)cudaSetDevice(device);
  }
  ~QuietDeviceGuard() {
    if (previous >= 0) (void)cudaSetDevice(previous);
  }
};

// "12.5": error messages are built from std::string and snprintf, never iostreams. On the 2-GPU
// fault test the healthy rank crashed (SIGSEGV in std::ostream::_M_insert<long>, cuda-gdb backtrace
// from NcclComm::finish) formatting its timeout message through std::ostringstream inside the
// Python extension: the only iostream use in the module, reached only on that path.
std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ncclCommRevoke, looked up at run time in the libnccl this module is bound to (torch may have
// loaded an NCCL older than the headers this was compiled against; then there is no revoke and the
// stop falls back to ncclCommAbort). DELTACP_NCCL_STOP=abort disables it.
using RevokeFn = ncclResult_t (*)(ncclComm_t, int);
RevokeFn find_revoke() {
  static const RevokeFn fn = []() -> RevokeFn {
    const char* mode = std::getenv("DELTACP_NCCL_STOP");
    if (mode && std::strcmp(mode, "abort") == 0) return nullptr;
    Dl_info info{};
    if (!dladdr(reinterpret_cast<void*>(&ncclCommAbort), &info) || !info.dli_fname) return nullptr;
    void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) return nullptr;
    return reinterpret_cast<RevokeFn>(dlsym(lib, "ncclCommRevoke"));  // the handle stays open
  }();
  return fn;
}

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw std::runtime_error(std::string("deltacp: ncclGetUniqueId: ") + ncclGetErrorString(r));
  return std::string(id.internal, sizeof(id.internal));
}

std::string NcclComm::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void NcclComm::throw_dead(const std::string& what) const {
  std::string first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = failure_;
  }
  throw CommDead("deltacp: context parallelism: " + what + " on rank " + std::to_string(rank_) +
                 ": the NCCL communicator of this CP context was shut down after an earlier failure (" + first +
                 "); nothing more can run on it: build a new context with deltacp.cp.build_context");
}

// DELTACP_NCCL_STOP=none: a failed communicator is only marked dead (no revoke, no abort; its
// kernels and memory are left to the process's exit). A diagnostic switch for the fault tests.
bool stop_disabled() {
  const char* mode = std::getenv("DELTACP_NCCL_STOP");
  return mode && std::strcmp(mode, "none") == 0;
}
void NcclComm::stop_locked(Stop stop) noexcept {
  if (stop == Stop::none || stop_disabled()) return;
  QuietDeviceGuard guard(device_);
  // The all-gathers' communicator first: a stalled all-gather's kernel is most likely there.
  for (void** c : {&gather_comm_, &comm_}) {
    if (*c == nullptr) continue;
    if (stop == Stop::revoke_or_abort) {
      if (RevokeFn revoke = find_revoke()) {
        const ncclResult_t r = revoke(as_comm(*c), 0 /* NCCL_REVOKE_DEFAULT */);
        if (r == ncclSuccess || r == ncclInProgress) {
          // In-flight kernels quit on the abort flag; wait (bounded) until NCCL reports quiescence (a
          // blocking communicator's revoke returns quiesced). It is then kept, unused, until the process exits.
          const auto t0 = std::chrono::steady_clock::now();
          for (;;) {
            ncclResult_t async = ncclSuccess;
            if (ncclCommGetAsyncError(as_comm(*c), &async) != ncclSuccess || async != ncclInProgress) break;
            if (seconds_since(t0) > std::min(timeout_s_, kStopWaitS)) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          continue;
        }
        // Revoke refused (for instance an older NCCL that cannot revoke in this state): abort.
      }
    }
    ncclCommAbort(as_comm(*c));  // frees the communicator
    *c = nullptr;
  }
}

void NcclComm::fail(const std::string& reason, Stop stop) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_.load()) return;
    failure_ = reason;
    dead_.store(true);  // from here on no caller reaches NCCL or the private stream
    stop_locked(stop);
  } catch (...) {
    dead_.store(true);  // std::string / mutex failures: still never use the communicator again
  }
}

void NcclComm::abort(const std::string& reason) { fail(reason, Stop::revoke_or_abort); }

void NcclComm::fail_and_throw(const std::string& what, const std::string& cause, Stop stop) {
  const std::string msg = "deltacp: context parallelism: " + what + " on rank " + std::to_string(rank_) +
                          " failed: " + cause + "; the NCCL communicator was shut down";
  fail(msg, stop);
  throw std::runtime_error(msg);
}

template <class Ready>
void NcclComm::poll(const std::string& what, Ready ready, double limit_s, Stop stop) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    ncclResult_t async = ncclSuccess, q = ncclSuccess;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (dead_.load() || !comm_) {  // another thread stopped it (abort()) while this one waited
        if (!dead_.load()) {
          failure_ = "the communicator is gone";
          dead_.store(true);
        }
        lock.unlock();
        throw_dead(what);
      }
      q = ncclCommGetAsyncError(as_comm(comm_), &async);
      // The all-gathers' blocking communicator reports asynchronous (network, remote) errors here too.
      ncclResult_t gather_async = ncclSuccess;
      if (q == ncclSuccess && gather_comm_ != nullptr &&
          (q = ncclCommGetAsyncError(as_comm(gather_comm_), &gather_async)) == ncclSuccess &&
          gather_async != ncclSuccess && gather_async != ncclInProgress)
        async = gather_async;
    }
    if (q != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      const ncclResult_t bad = q != ncclSuccess ? q : async;
      const char* last = ncclGetLastError(nullptr);
      fail_and_throw(what, std::string(ncclGetErrorString(bad)) + " (" + (last ? last : "") + ")", stop);
    }
    if (async == ncclSuccess) {
      bool done = false;
      try {
        done = ready();
      } catch (const std::exception& e) {
        // A CUDA error while waiting (for instance a fault of the collective): the communicator
        // cannot be trusted any more either.
        fail_and_throw(what, e.what(), stop);
      }
      if (done) return;
    }
    const double waited = seconds_since(start);
    if (waited > limit_s) {
      const std::string msg = "deltacp: context parallelism: " + what + " on rank " + std::to_string(rank_) +
                              " of " + std::to_string(world_) + " did not complete within " + seconds_text(limit_s) +
                              " s (another rank stalled, exited or called a different collective); the NCCL "
                              "communicator was shut down";
      fail(msg, stop);
      throw CommTimeout(msg);
    }
    // Spin for the first milliseconds (a CP exchange waits about as long as the pre-pass it follows, and
    // every microsecond between its completion and the next launch leaves the GPU idle), then sleep in
    // short and later long steps so that a stalled peer does not cost a whole core until the timeout.
    if (waited > kSpinS) std::this_thread::sleep_for(std::chrono::microseconds(waited > 1.0 ? 1000 : 20));
  }
}

NcclComm::NcclComm(const std::string& unique_id, int rank, int world, int device, double timeout_s,
                   bool blocking_gather)
    : rank_(rank), world_(world), device_(device), timeout_s_(timeout_s) {
  DELTACP_CHECK(unique_id.size() == sizeof(ncclUniqueId::internal), "unique_id", "expected ",
                sizeof(ncclUniqueId::internal), " bytes (from nccl_unique_id on rank 0), got ", unique_id.size());
  DELTACP_CHECK(world >= 1 && rank >= 0 && rank < world, "rank", "expected 0 <= rank < world = ", world, ", got ",
                rank);
  DELTACP_CHECK(timeout_s > 0, "timeout", "expected a positive number of seconds, got ", timeout_s);
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  cudaEvent_t ev_in = nullptr, ev_done = nullptr;
  // The highest priority the device offers: the fingerprint all-reduce and the exchange's all-gather are a few
  // blocks each, enqueued while the local forward's prepare fills every SM; at the default priority the block
  // scheduler dispatched them only behind that grid's last wave, and the host waited for the check as long.
  int least_priority = 0, greatest_priority = 0;
  cuda_check(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority), "cudaDeviceGetStreamPriorityRange");
  cuda_check(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest_priority),
             "cudaStreamCreateWithPriority");
  stream_ = stream;
  auto release_cuda = [&] {
    if (ev_in) cudaEventDestroy(ev_in);
    if (ev_done) cudaEventDestroy(ev_done);
    cudaStreamDestroy(stream);
  };
  try {
    cuda_check(cudaEventCreateWithFlags(&ev_in, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventCreateWithFlags(&ev_done, cudaEventDisableTiming), "cudaEventCreate");
  } catch (...) {
    release_cuda();
    throw;
  }
  ev_in_ = ev_in;
  ev_done_ = ev_done;

  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm) ncclCommAbort(comm);
    release_cuda();
    throw std::runtime_error(std::string("deltacp: ncclCommInitRankConfig on rank ") + std::to_string(rank) + ": " +
                             ncclGetErrorString(r));
  }
  comm_ = comm;
  try {
    // An init that fails or times out is aborted (and freed): no collective ever ran on it.
    poll("creating the NCCL communicator", [] { return true; }, timeout_s_, Stop::abort);
  } catch (...) {
    // The destructor does not run after a throwing constructor; nothing was enqueued on the stream.
    if (!comm_) release_cuda();
    throw;
  }
  if (!blocking_gather) return;
  try {
    make_gather_comm();
  } catch (...) {
    fail("creating the all-gather communicator failed", Stop::abort);  // a no-op when it failed already
    if (!comm_ && !gather_comm_) {  // both aborted (freed): the warm-up's kernel, if any, has quit
      if (warm_buf_) cudaFree(warm_buf_);
      release_cuda();
    }
    throw;
  }
}

void NcclComm::make_gather_comm() {
  const std::string what = "creating the blocking all-gather communicator";
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  // The split runs in NCCL's thread (the parent is non-blocking), which stores the child last: into a slot
  // that outlives this call, in case it is still running when the wait below gives up (then the slot and
  // the half-made child leak; the parent is aborted).
  auto* slot = new void*(nullptr);
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard guard(device_);
    r = ncclCommSplit(as_comm(comm_), 0, rank_, reinterpret_cast<ncclComm_t*>(slot), &config);
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    delete slot;
    fail_and_throw(what, ncclGetErrorString(r), Stop::abort);
  }
  poll(what, [&] { return __atomic_load_n(slot, __ATOMIC_ACQUIRE) != nullptr; }, timeout_s_, Stop::abort);
  {
    std::lock_guard<std::mutex> lock(mu_);
    gather_comm_ = *slot;
  }
  delete slot;
  // Warm-up: the first all-gather connects the ring to the peers. Here every rank is creating the context;
  // later, a blocking enqueue that had to connect to a dead peer would wait inside NCCL, out of our timeout.
  DeviceGuard guard(device_);
  cuda_check(cudaMalloc(&warm_buf_, static_cast<size_t>(world_ + 1) * sizeof(float)), "cudaMalloc");
  float* warm = static_cast<float*>(warm_buf_);
  cuda_check(cudaMemsetAsync(warm, 0, sizeof(float), as_stream(stream_)), "cudaMemsetAsync");
  {
    std::lock_guard<std::mutex> lock(mu_);
    r = ncclAllGather(warm, warm + 1, 1, ncclFloat32, as_comm(gather_comm_), as_stream(stream_));
  }
  if (r == ncclInProgress)  // NCCL_COMM_BLOCKING=0 in the environment overrides config.blocking
    fail_and_throw(what, "NCCL made it non-blocking (NCCL_COMM_BLOCKING=0 in the environment?); set "
                   "DELTACP_CP_BLOCKING_GATHER=0 to keep the all-gathers on the non-blocking communicator",
                   Stop::abort);
  if (r != ncclSuccess) fail_and_throw(what + " (its warm-up all-gather)", ncclGetErrorString(r), Stop::abort);
  cuda_check(cudaEventRecord(as_event(ev_done_), as_stream(stream_)), "cudaEventRecord");
  wait_event(ev_done_, what + " (its warm-up all-gather)");
  cudaFree(warm_buf_);  // done with it (a failure above leaves it to the constructor's cleanup)
  warm_buf_ = nullptr;
}

NcclComm::~NcclComm() {
  (void)join_watchdog();     // it ends within the timeout (stopping the communicator on a stall)
  if (dead_.load()) return;  // stopped after a failure: deliberately kept (cp.h)
  try {
    DeviceGuard guard(device_);
    if (gather_comm_ != nullptr) {
      // Every all-gather on it was confirmed complete. Aborting an idle communicator needs no peer (what
      // torch does with its blocking communicators), where a blocking finalize could wait on one forever.
      std::lock_guard<std::mutex> lock(mu_);
      ncclCommAbort(as_comm(gather_comm_));
      gather_comm_ = nullptr;
    }
    // Everything enqueued was waited for (or ordered before later work on the caller's stream):
    // finalize flushes NCCL's side, destroy frees it. A finalize that fails or hangs (a peer died
    // meanwhile) leaves the communicator dead and kept instead of tearing it down under the peer.
    const ncclResult_t r = ncclCommFinalize(as_comm(comm_));
    if (r != ncclSuccess && r != ncclInProgress) {
      fail(std::string("ncclCommFinalize: ") + ncclGetErrorString(r), Stop::none);
      return;
    }
    poll("finalizing the communicator", [] { return true; }, std::min(timeout_s_, kTeardownWaitS), Stop::none);
    std::lock_guard<std::mutex> lock(mu_);
    ncclCommDestroy(as_comm(comm_));
    comm_ = nullptr;
    dead_.store(true);
    failure_ = "the communicator was destroyed";
    cudaStreamSynchronize(as_stream(stream_));
    cudaEventDestroy(as_event(ev_in_));
    cudaEventDestroy(as_event(ev_done_));
    if (ev_check_) cudaEventDestroy(as_event(ev_check_));
    if (check_host_) cudaFreeHost(check_host_);
    if (check_dev_) cudaFree(check_dev_);
    cudaStreamDestroy(as_stream(stream_));
  } catch (...) {
    // poll() marked it dead already (Stop::none: nothing freed); a destructor must not throw.
  }
}

template <class Launch>
void NcclComm::enqueue(const std::string& what, void* user_stream, Launch launch) {
  // A non-blocking communicator takes no call while an earlier enqueue is still in progress (the
  // fingerprint all-reduce is left to finish enqueuing on its own): one look when there is none.
  poll("enqueuing " + what, [] { return true; }, timeout_s_);
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!dead_.load() && comm_) {
      DeviceGuard guard(device_);
      // The collective reads what the caller enqueued before it: private stream after the caller's
      // (no caller stream: a collective independent of the caller's work, the fingerprint check).
      if (user_stream != kNoCallerStream) {
        cuda_check(cudaEventRecord(as_event(ev_in_), as_stream(user_stream)), "cudaEventRecord");
        cuda_check(cudaStreamWaitEvent(as_stream(stream_), as_event(ev_in_), 0), "cudaStreamWaitEvent");
      }
      r = launch(as_comm(comm_), as_stream(stream_));
      if (r == ncclSuccess || r == ncclInProgress) return;
    }
  }
  if (r == ncclSuccess) throw_dead(what);  // it was dead before anything was enqueued
  fail_and_throw("enqueuing " + what, ncclGetErrorString(r), Stop::revoke_or_abort);
}

template <class After>
void NcclComm::when_enqueued(const std::string& what, After after) {
  // Non-blocking communicator: the enqueue may still be running (ncclInProgress). Nothing else may go on
  // the private stream before it has: that work would run ahead of the collective's kernel (seen on
  // 2 x H200 with the fingerprint check's copy back, whose kernel launched only at a later poll).
  poll("enqueuing " + what, [] { return true; }, timeout_s_);
  std::unique_lock<std::mutex> lock(mu_);
  if (dead_.load()) {
    lock.unlock();
    throw_dead(what);
  }
  DeviceGuard guard(device_);
  after(as_stream(stream_));
}

void NcclComm::finish(const std::string& what, void* user_stream, bool wait_done) {
  when_enqueued(what, [&](cudaStream_t st) {
    cuda_check(cudaEventRecord(as_event(ev_done_), st), "cudaEventRecord");
    // Asynchronous use: later work on the caller's stream waits for the collective on the GPU.
    // (With wait_done the host confirms completion first, so a stuck collective never blocks the
    // caller's stream.)
    if (!wait_done)
      cuda_check(cudaStreamWaitEvent(as_stream(user_stream), as_event(ev_done_), 0), "cudaStreamWaitEvent");
  });
  if (wait_done) wait_for_collective(what);
}

void NcclComm::wait_event(void* event, const std::string& what) {
  // The device cannot be selected (a sticky CUDA error, say): like a failed look inside poll(), the
  // communicator cannot be trusted any more, and every later call must say so.
  std::optional<DeviceGuard> guard;
  try {
    guard.emplace(device_);
  } catch (const std::exception& e) {
    fail_and_throw(what, e.what(), Stop::revoke_or_abort);
  }
  poll(what, [&] {
    const cudaError_t e = cudaEventQuery(as_event(event));
    if (e == cudaErrorNotReady) return false;
    cuda_check(e, "cudaEventQuery");
    return true;
  }, timeout_s_);
}

void NcclComm::wait_for_collective(const std::string& what) { wait_event(ev_done_, what); }

std::exception_ptr NcclComm::join_watchdog() {
  if (watchdog_.joinable()) watchdog_.join();
  std::exception_ptr e = watch_error_;
  watch_error_ = nullptr;
  return e;
}

void NcclComm::wait(void* stream, const std::string& what) {
  const OneCaller one(caller_, what);
  if (dead_.load()) throw_dead(what);
  DeviceGuard guard(device_);
  cudaEvent_t done = nullptr;
  cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  try {
    cuda_check(cudaEventRecord(done, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
    wait_event(done, what);
  } catch (...) {
    cudaEventDestroy(done);
    throw;
  }
  cudaEventDestroy(done);
}

void NcclComm::all_gather(const void* send, void* recv, size_t count, int dtype, void* stream, bool wait_done) {
  const ncclDataType_t type = nccl_type(dtype);  // bad arguments: deltacp::Error, nothing enqueued
  const std::string what = "the all-gather of the CP states";
  const OneCaller one(caller_, what);
  // A previous unconfirmed all-gather (its caller raised before confirm) is waited for first.
  (void)join_watchdog();
  if (dead_.load()) throw_dead(what);
  enqueue(what, stream, [&](ncclComm_t comm, cudaStream_t s) {  // under the lock, comm_ alive
    return ncclAllGather(send, recv, count, type, gather_comm_ != nullptr ? as_comm(gather_comm_) : comm, s);
  });
  finish(what, stream, wait_done);
  if (!wait_done) {
    try {
      watchdog_ = std::thread([this, what] {
        try {
          wait_for_collective(what);  // a stall: the communicator is stopped here, so its kernel quits
        } catch (...) {
          watch_error_ = std::current_exception();
        }
      });
    } catch (const std::system_error&) {
      wait_for_collective(what);  // no thread to be had: wait here, as with wait = true
    }
  }
}

void NcclComm::confirm(const std::string& what) {
  const OneCaller one(caller_, what);
  if (!watchdog_.joinable() && !watch_error_) {  // nothing in flight (wait = true, or already confirmed)
    if (dead_.load()) throw_dead(what);
    return;
  }
  if (std::exception_ptr e = join_watchdog()) std::rethrow_exception(e);
}

void NcclComm::start_max_i64(const std::vector<int64_t>& values) {
  const std::string what = "the fingerprint all-reduce";
  const OneCaller one(caller_, what);
  DELTACP_CHECK(!values.empty() && values.size() <= kMaxCheckValues, "values", "expected 1 to ", kMaxCheckValues,
                " values, got ", values.size());
  if (dead_.load()) throw_dead(what);
  // A check that was started but never finished (its caller raised in between) is waited for first:
  // its pinned buffer is about to be reused.
  if (check_count_ > 0) finish_max_i64(what);
  const size_t n = values.size(), bytes = n * sizeof(int64_t);
  enqueue(what, kNoCallerStream, [&](ncclComm_t comm, cudaStream_t st) {
    if (!check_host_) {  // first use: pinned host and device buffers, one event (kept until destruction)
      void* host = nullptr;
      void* dev = nullptr;
      cudaEvent_t ev = nullptr;
      cuda_check(cudaMallocHost(&host, 2 * kMaxCheckValues * sizeof(int64_t)), "cudaMallocHost");
      check_host_ = static_cast<int64_t*>(host);
      cuda_check(cudaMalloc(&dev, kMaxCheckValues * sizeof(int64_t)), "cudaMalloc");
      check_dev_ = static_cast<int64_t*>(dev);
      cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
      ev_check_ = ev;
    }
    std::copy(values.begin(), values.end(), check_host_);
    cuda_check(cudaMemcpyAsync(check_dev_, check_host_, bytes, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
    return ncclAllReduce(check_dev_, check_dev_, n, ncclInt64, ncclMax, comm, st);
  });
  // The copy back is enqueued by finish_max_i64, once the all-reduce is: a non-blocking communicator
  // enqueues a collective in a thread of its own (ncclInProgress until then), which took ~0.3 ms per
  // call on 2 x H200; waiting for it here held back the caller's first launches by as much.
  check_count_ = n;
}

std::vector<int64_t> NcclComm::finish_max_i64(const std::string& what) {
  const OneCaller one(caller_, what);
  DELTACP_CHECK(check_count_ > 0, "values", "expected a started fingerprint check (start_max_i64)");
  const size_t n = check_count_;
  check_count_ = 0;
  if (dead_.load()) throw_dead(what);
  // Only after the all-reduce is enqueued may the copy back go on the private stream: it would run ahead
  // of the all-reduce's kernel otherwise (seen on 2 x H200 before this order was enforced).
  when_enqueued(what, [&](cudaStream_t st) {
    cuda_check(cudaMemcpyAsync(check_host_ + kMaxCheckValues, check_dev_, n * sizeof(int64_t),
                               cudaMemcpyDeviceToHost, st),
               "cudaMemcpyAsync");
    cuda_check(cudaEventRecord(as_event(ev_check_), st), "cudaEventRecord");
  });
  wait_event(ev_check_, what);
  return std::vector<int64_t>(check_host_ + kMaxCheckValues, check_host_ + kMaxCheckValues + n);
}

}  // namespace deltacp::dist
