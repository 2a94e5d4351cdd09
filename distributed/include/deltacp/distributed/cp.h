// deltacp/distributed/cp.h — context parallelism on GPUs: the pre-pass, merge and NCCL exchange.
//
// The host API of distributed/ (docs/design.md section 4; the math is in cp_body.h):
//
//   prepass_forward   [H | M] of one span (a rank's last local segment)     [HV, K, V + K] fp32
//   prepass_backward  [dH | M^T] of one span (a rank's first local segment) [HV, K, V + K] fp32
//   merge             S = 0; S <- A_j S + B_j over gathered buffers j         [HV, K, V] fp32
//   NcclComm          a non-blocking NCCL communicator whose every wait has a timeout: on a stall
//                     it stops the communicator for good and throws CommTimeout instead of hanging
//
// Device pointers everywhere; `stream` is a cudaStream_t (nullptr = the legacy default stream).
// Launches are asynchronous; workspace comes from cudaMallocAsync on the stream.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "deltacp/distributed/cp_body.h"

namespace deltacp::dist {

// start: [HV, K, V] fp32 initial state of the span (null = 0). out: [HV, K, V + K] = [H | M] with
// S_end = M S_start + H for S_start = 0, i.e. H includes `start`. Throws deltacp::Error on bad sizes.
void prepass_forward(const Span& span, const float* start, float* out, void* stream);

// dend: [HV, K, V] fp32 gradient arriving at the span end (null = 0). out: [HV, K, V + K] =
// [dH | M^T] with dS_start = M^T dS_end + dH (dH includes M^T dend and the span's own outputs).
void prepass_backward(const Span& span, const float* dend, float* out, void* stream);

// gathered: [world, HV, K, V + K] fp32, [B_j | A_j] per rank j. out: [HV, K, V] fp32, the fold
// S = 0; for j = first, first + step, ... (count terms): S <- A_j S + B_j. count may be 0 (out = 0).
void merge(const float* gathered, int64_t HV, int64_t K, int64_t V, int64_t first, int64_t count, int64_t step,
           float* out, void* stream);

// A collective did not finish within the communicator's timeout (the communicator is shut down).
class CommTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The communicator was shut down by an earlier failure (or abort()): nothing runs on it any more.
class CommDead : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A second thread called the communicator while another thread was inside a call on it (one thread at a
// time per communicator, NcclComm below). Nothing was enqueued; the communicator is unharmed.
class CommBusy : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// The guard of NcclComm's "one thread at a time": held by the thread inside a call (`caller` holds its id,
// a default id when none), released when that call returns. A call of another thread meanwhile throws
// CommBusy naming `what`; a nested call of the same thread (start_max_i64 -> finish_max_i64) passes.
// Without it two threads (the GIL is released inside every call) would race on the watchdog, the events
// and the check buffers. distributed/tests/cp_body_host_test.cpp checks it on the host.
class OneCaller {
 public:
  OneCaller(std::atomic<std::thread::id>& caller, const std::string& what) : caller_(caller) {
    const std::thread::id me = std::this_thread::get_id();
    std::thread::id none{};
    if (caller_.compare_exchange_strong(none, me)) {
      owner_ = true;
      return;
    }
    if (none == me) return;  // nested: the outer call releases it
    throw CommBusy("deltacp: " + what + ": another thread is inside a call on the same CP communicator; call "
                   "one CP context from one thread at a time (or build a context per thread)");
  }
  ~OneCaller() {
    if (owner_) caller_.store(std::thread::id{});
  }
  OneCaller(const OneCaller&) = delete;
  OneCaller& operator=(const OneCaller&) = delete;

 private:
  std::atomic<std::thread::id>& caller_;
  bool owner_ = false;
};

// The ncclUniqueId as raw bytes (rank 0 makes it; the others receive it, e.g. through torch.distributed).
std::string nccl_unique_id();

// A non-blocking NCCL communicator whose every wait has a timeout, and whose failure is final.
//
// Life cycle: alive -> (a failure: async NCCL error, timeout, CUDA error while waiting, or abort())
// -> dead. On the transition the communicator is STOPPED once, under the lock that serialises every
// NCCL call on it (NCCL requires that no other thread uses a communicator while it is aborted):
// ncclCommRevoke when the loaded NCCL has it (in-flight kernels quit on the abort flag, NCCL's
// streams and proxy quiesce; nothing is freed), else ncclCommAbort. A dead communicator is never
// used again and never freed by this class: every later call throws CommDead naming the first
// failure, and the destructor does nothing (freeing NCCL resources while a stalled or dead peer or
// an in-flight kernel may still touch them is what crashes processes; the OS reclaims them at exit).
// DELTACP_NCCL_STOP=abort forces ncclCommAbort (frees at once) instead of the revoke.
//
// With blocking_gather, the all-gathers run on a second, BLOCKING communicator split from the first at
// creation (ncclCommSplit; deltacp.cp.nccl_backend decides, DELTACP_CP_BLOCKING_GATHER). NCCL enqueues every collective of a
// non-blocking communicator from a thread it creates for that call (NCCL's group.cc): on 2 x H200 an
// all-gather of 1 MiB per rank took 0.139 ms that way and takes 0.047 ms on the blocking one (torch's:
// 0.034 ms; measured 2026-11-23, docs/context-parallel.md). A blocking communicator enqueues in the caller's thread. Blocking is safe here because nothing waits inside NCCL: the
// collective's completion is polled (cudaEventQuery) with the timeout as before, and a stall stops both
// communicators (revoke, else abort: in-flight kernels quit). The one NCCL call that could still block is
// an enqueue that must first connect to its peers (inside the lock, out of the timeout's reach); a warm-up
// all-gather at creation, while every rank is there, makes the ring's connections. That covers every
// all-gather only where ring is NCCL's one all-gather algorithm: one node, NVLS off (no PAT, no CollNet),
// which is where nccl_backend turns this on by default. The fingerprint all-reduce, which could pick
// another algorithm, stays on the non-blocking communicator. Stopping: the child is stopped first; its
// blocking stop synchronises NCCL's device stream, which follows the child's last kernel on the private
// stream, so no kernel of the parent may be stuck ahead of it there (none is: the fingerprint all-reduce
// is waited for before any all-gather is enqueued).
//
// Collectives run on a private non-blocking stream joined to the caller's stream by events, so a
// stuck NCCL kernel never sits in the caller's (often the legacy default) stream, which would block
// every later CUDA call of the process, including the error handling after the timeout.
class NcclComm {
 public:
  // Non-blocking init (ncclCommInitRankConfig, blocking = 0), polled up to timeout_s seconds; with
  // blocking_gather also the all-gathers' blocking communicator (below). Every rank must pass the same.
  NcclComm(const std::string& unique_id, int rank, int world, int device, double timeout_s,
           bool blocking_gather = false);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // recv[world * count] <- every rank's send[count], elements of type dtype (kF32 / kF64 / kBf16 /
  // kF16, cp_body.h), ordered after the work already enqueued on `stream`. With wait = true the host
  // waits (polling, with the timeout) until the collective has completed; with wait = false later
  // work on `stream` is ordered after it instead.
  void all_gather(const void* send, void* recv, size_t count, int dtype, void* stream, bool wait = true);
  // One thread at a time per communicator (the CP ops call it from the forward's and the autograd thread,
  // one after the other): the watchdog below belongs to the last all_gather(wait = false). A call from a
  // second thread while one is inside a call throws CommBusy (OneCaller), before anything is enqueued.
  // After all_gather(wait = false): waits until that collective has completed and rethrows its failure.
  // The CP ops enqueue the work that reads the gathered buffer first, so the GPU never idles between the
  // collective and that work, and confirm before returning. The wait itself runs in a watchdog thread
  // started by all_gather(wait = false), which polls with the timeout and stops the communicator on a
  // stall: so even a host call that blocks on the caller's stream in between (a blocking copy, say)
  // returns once the stalled collective is stopped, and confirm then raises CommTimeout.
  void confirm(const std::string& what);
  // The fingerprint check (deltacp.cp agree) in two halves, independent of the caller's streams: the
  // values travel host -> pinned -> device -> all-reduce MAX -> pinned on the private stream alone, so the
  // check overlaps whatever the caller has enqueued (the CP pre-pass). At most kMaxCheckValues values.
  // start returns without waiting for the non-blocking communicator to finish enqueuing the all-reduce
  // (it does so in a thread of its own, ~0.3 ms); finish waits for that, then enqueues the copy back.
  static constexpr size_t kMaxCheckValues = 256;
  void start_max_i64(const std::vector<int64_t>& values);
  std::vector<int64_t> finish_max_i64(const std::string& what);
  // Waits (with the timeout) until everything enqueued on `stream` has completed.
  void wait(void* stream, const std::string& what);
  // Stops the communicator (see above); later calls throw CommDead. Safe from any thread, any time.
  void abort(const std::string& reason = "abort() was called");

  int rank() const { return rank_; }
  int world() const { return world_; }
  double timeout() const { return timeout_s_; }
  bool aborted() const { return dead_.load(); }
  std::string failure() const;  // the first failure ("" while alive)

 private:
  enum class Stop { revoke_or_abort, abort, none };
  // Polls until ready() (and no asynchronous NCCL error) or `limit_s`; a failure makes the
  // communicator dead (stopped with `stop`) and throws.
  template <class Ready>
  void poll(const std::string& what, Ready ready, double limit_s, Stop stop = Stop::revoke_or_abort);
  // alive -> dead with `reason`, stopping the communicator; idempotent, never throws.
  void fail(const std::string& reason, Stop stop) noexcept;
  // fail() with "<what> on rank r failed: <cause>; the NCCL communicator was shut down", then throws that.
  [[noreturn]] void fail_and_throw(const std::string& what, const std::string& cause, Stop stop);
  void stop_locked(Stop stop) noexcept;
  // The blocking all-gather communicator, split from comm_, and its warm-up all-gather (constructor).
  void make_gather_comm();
  [[noreturn]] void throw_dead(const std::string& what) const;
  // Enqueues `launch(comm, private stream)` after the work on `user_stream` (kNoCallerStream in comm.cpp:
  // after nothing of the caller's); throws on failure.
  template <class Launch>
  void enqueue(const std::string& what, void* user_stream, Launch launch);
  void finish(const std::string& what, void* user_stream, bool wait_done);
  // Once the last enqueue has completed (polled, with the timeout): after(private stream), under the lock.
  template <class After>
  void when_enqueued(const std::string& what, After after);
  // Polls `event` (a cudaEvent_t) until it completed, with the timeout.
  void wait_event(void* event, const std::string& what);
  // Waits for the collective recorded in ev_done_.
  void wait_for_collective(const std::string& what);
  // Joins the watchdog of the last all_gather(wait = false) and returns its failure (null if none).
  std::exception_ptr join_watchdog();

  std::atomic<std::thread::id> caller_{};  // the thread inside a public call (OneCaller); default id: none
  mutable std::mutex mu_;          // serialises every NCCL call on comm_ and the alive -> dead step
  std::atomic<bool> dead_{false};
  std::string failure_;            // guarded by mu_
  void* comm_ = nullptr;           // ncclComm_t (kept, unused, after a revoke; null after an abort)
  void* gather_comm_ = nullptr;    // ncclComm_t, blocking, for the all-gathers (null: they use comm_)
  void* warm_buf_ = nullptr;       // device [world + 1] floats: the warm-up's buffers (during creation only)
  void* stream_ = nullptr;         // cudaStream_t: private, non-blocking
  void* ev_in_ = nullptr;          // cudaEvent_t: caller's stream -> stream_
  void* ev_done_ = nullptr;        // cudaEvent_t: the collective's completion on stream_
  void* ev_check_ = nullptr;       // cudaEvent_t: the fingerprint check's completion on stream_
  int64_t* check_host_ = nullptr;  // pinned [2 * kMaxCheckValues]: values in, maxima out (made on first use)
  int64_t* check_dev_ = nullptr;   // device [kMaxCheckValues]
  size_t check_count_ = 0;         // values of the check in flight (0: none)
  std::thread watchdog_;           // the wait of the last all_gather(wait = false), until confirm joins it
  std::exception_ptr watch_error_; // what it caught (set before it ends)
  int rank_ = 0, world_ = 1, device_ = 0;
  double timeout_s_ = 300.0;
};

}  // namespace deltacp::dist
