// cuda/tiled/chunk_table.cuh — the chunk index table of the tiled tier (forward and backward).
//
// The chunked WY algorithm (docs/design.md section 3) cuts every sequence into chunks of `chunk_size`
// tokens, restarting at each sequence start; the last chunk of a sequence may be shorter. Kernels
// that run one CTA per chunk need, for a flat chunk index c, where that chunk lives:
//
//   chunk c  ->  ChunkEntry { seq n, batch b, bos, t0, len, row0, index_in_seq }
//
//   * `batch` and `t0` address the chunk's first token through TensorRef::offset(batch, t0, h):
//     fixed-length batches use batch = n and t0 = local start; varlen (B == 1) uses batch = 0 and
//     t0 = cu_seqlens[n] + local start (the packed time axis).
//   * `row0` = batch * T + t0 is the chunk's first row in the flat token axis [B * T] that every
//     intermediate of the tiled tier uses (G, W, U, v_new: [B * T, HV, ...], row-major).
//   * chunks are numbered sequence after sequence, in order, so the chunks of sequence n are
//     c = first_chunk(n) .. first_chunk(n) + num_chunks(n) - 1. Per-chunk intermediates such as the
//     chunk-start states h are [num_chunks_total, HV, K, V] indexed by c.
//
// Kernels that run one CTA per sequence (the state scan) read SeqEntry { batch, bos, len,
// first_chunk, num_chunks }. A sequence of length 0 has num_chunks = 0 (its final state is its
// initial state).
//
// The table is built on the host from p.cu_seqlens_host (varlen) or from B and T (fixed batches),
// and uploaded with cudaMemcpyAsync on the given stream into stream-ordered workspace memory
// (../common/workspace_pool.h: torch's caching allocator or deltacp's pool); the ChunkTable object owns
// that memory and frees it on the same stream when it is destroyed, so kernels launched on that stream
// before the destructor runs may use it.
//
// Uploads and CUDA graphs (upload_table below; every host-to-device table of the tiled and fused tiers
// goes through it: ChunkTable here, the fold table of scan_split.cu's PieceTables). Outside a capture the
// copy reads the host vector directly: from pageable memory the runtime stages the bytes before
// cudaMemcpyAsync returns, so the vector may go at once. Inside a stream capture (torch.cuda.graph) the
// copy is not run but recorded as a memcpy node that every replay runs again, reading its source address
// then (the runtime records a copy from pageable memory without complaint), so a vector freed when the
// call returns would be read after its death. So under capture the bytes are first copied into a
// process-lifetime store of pinned host memory (pinned_table_copy), deduplicated by content, and the node
// reads them from there.
// The destination is workspace memory, which under capture is the graph's own (torch's graph pool, or a
// graph allocation node of deltacp's pool), so each replay rewrites the same table where the captured
// kernels read it. A table is fixed at capture: it depends on B, T, chunk_size and the host offsets
// (cu_seqlens_host), which fix the grids too, so a replay is the captured problem on new tensor contents.
// Why not build the tables on the device instead: the host needs them anyway (grid sizes, the pieces'
// plan, the fold's map pointers), so a device builder would be a second copy of the numbering, and
// varlen calls would still need the host offsets. Why not pass them as kernel parameters: a table grows
// with the tokens (56 bytes per chunk) past the 4 KB of a launch's parameters. The store's cost: each
// distinct table captured stays pinned for the process's life (56 bytes per chunk, 40 per sequence), once
// however often it is captured; only the pieces' fold table, which holds workspace addresses, may differ
// between two captures of one shape (24 bytes per sequence each time).
//
// Everything is int64 (docs/design.md section 6).
//
// Usage (host):
//   deltacp::cuda::tiled::ChunkTable table(p, p.chunk_size, stream);
//   kernel<<<table.num_chunks(), ...>>>(table.chunks(), ...);   // device pointers
//   kernel<<<table.num_seqs(), ...>>>(table.seqs(), ...);
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../common/check.h"
#include "../common/workspace_pool.h"
#include "deltacp/error.h"
#include "deltacp/params.h"

namespace deltacp::cuda::tiled {

// True while `stream` is being captured into a CUDA graph (also when its capture was invalidated). A
// query that fails (the legacy stream while another stream of the device captures) counts as capturing:
// the pinned path is correct everywhere, it only keeps the bytes.
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so a later check does not report it
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

namespace detail {
// The process-lifetime store of table bytes for captured copies (see the file comment): pinned blocks
// handed out in 256-byte pieces, and an index from the bytes to their piece.
struct PinnedTables {
  std::mutex mutex;
  std::unordered_map<std::string, const void*> by_bytes;
  char* block = nullptr;  // the free part of the newest pinned block
  size_t left = 0;
};
inline PinnedTables& pinned_tables() {
  static PinnedTables* t = new PinnedTables;  // leaked on purpose: graphs may replay until the process ends
  return *t;
}
}  // namespace detail

// A pinned, never freed, never rewritten copy of host[0, bytes), shared by equal byte strings. The pinned
// allocation runs in relaxed capture mode: torch captures in global mode, where a cudaHostAlloc on the
// capturing thread fails (cudaErrorStreamCaptureUnsupported) and invalidates the capture, although it
// records nothing on any stream.
inline const void* pinned_table_copy(const void* host, size_t bytes) {
  auto& store = detail::pinned_tables();
  std::string key(static_cast<const char*>(host), bytes);
  std::lock_guard<std::mutex> lock(store.mutex);
  const auto found = store.by_bytes.find(key);
  if (found != store.by_bytes.end()) return found->second;
  const size_t need = (bytes + 255) / 256 * 256;
  if (need > store.left) {
    const size_t block = std::max<size_t>(need, size_t{256} << 10);
    void* ptr = nullptr;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    DELTACP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    const cudaError_t err = cudaHostAlloc(&ptr, block, cudaHostAllocPortable);
    (void)cudaThreadExchangeStreamCaptureMode(&mode);  // the caller's mode again
    DELTACP_CUDA_CHECK(err);
    store.block = static_cast<char*>(ptr);
    store.left = block;
  }
  char* dst = store.block;
  store.block += need;
  store.left -= need;
  std::memcpy(dst, host, bytes);
  store.by_bytes.emplace(std::move(key), dst);
  return dst;
}

// host[0, bytes) into device memory, ordered on stream; under stream capture from the pinned store, so
// that every replay of the graph copies the same bytes (the file comment says why).
inline void upload_table(void* device, const void* host, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  const void* src = stream_capturing(stream) ? pinned_table_copy(host, bytes) : host;
  DELTACP_CUDA_CHECK(cudaMemcpyAsync(device, src, bytes, cudaMemcpyHostToDevice, stream));
}

// One chunk of one sequence (56 bytes, all int64).
struct ChunkEntry {
  int64_t seq;           // sequence n (0 .. num_seqs - 1)
  int64_t batch;         // batch index for TensorRef::offset (0 for varlen)
  int64_t bos;           // the sequence's first token on the time axis of row `batch`
  int64_t t0;            // first token of the chunk on the time axis of row `batch`
  int64_t len;           // tokens in the chunk, 1 .. chunk_size
  int64_t row0;          // batch * T + t0: first row of the chunk in the flat [B * T] token axis
  int64_t index_in_seq;  // 0 for the sequence's first chunk
};

// One sequence (40 bytes, all int64).
struct SeqEntry {
  int64_t batch;        // batch index for TensorRef::offset (0 for varlen)
  int64_t bos;          // first token on the time axis of row `batch` (cu_seqlens[n], or 0)
  int64_t len;          // tokens in the sequence (may be 0)
  int64_t first_chunk;  // flat index of its first chunk
  int64_t num_chunks;   // ceil(len / chunk_size)
};

// Host: fills the two tables for p (p.num_seqs must be set: deltacp::finalize). Pure host code.
inline void build_chunk_entries(const Params& p, int chunk_size, std::vector<ChunkEntry>& chunks,
                                std::vector<SeqEntry>& seqs) {
  DELTACP_CHECK(chunk_size > 0, "chunk_size", "expected > 0, got ", chunk_size);
  DELTACP_CHECK(p.num_seqs >= 0, "num_seqs", "expected >= 0, got ", p.num_seqs);
  DELTACP_CHECK(!p.varlen() || p.host_cu() != nullptr, "cu_seqlens_host", "expected a host copy for varlen");
  chunks.clear();
  seqs.clear();
  seqs.reserve(static_cast<size_t>(p.num_seqs));
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    SeqEntry s;
    s.batch = p.seq_batch(n);
    s.bos = p.seq_begin(n);
    s.len = p.seq_end(n) - s.bos;
    DELTACP_CHECK(s.len >= 0, "cu_seqlens", "expected non-decreasing offsets, got a negative length at ", n);
    s.first_chunk = static_cast<int64_t>(chunks.size());
    s.num_chunks = (s.len + chunk_size - 1) / chunk_size;
    for (int64_t i = 0; i < s.num_chunks; ++i) {
      ChunkEntry c;
      c.seq = n;
      c.batch = s.batch;
      c.bos = s.bos;
      c.t0 = s.bos + i * chunk_size;
      c.len = (i + 1 < s.num_chunks) ? chunk_size : s.len - i * chunk_size;
      c.row0 = c.batch * p.T + c.t0;
      c.index_in_seq = i;
      chunks.push_back(c);
    }
    seqs.push_back(s);
  }
}

// True when a and b cut their tokens into the same sequences (p.num_seqs set; host offsets compared):
// a staged forward or backward finishes on the chunk table it prepared, so it checks this first.
inline bool same_sequences(const Params& a, const Params& b) {
  if (a.B != b.B || a.T != b.T || a.num_seqs != b.num_seqs || a.varlen() != b.varlen()) return false;
  for (int64_t n = 0; a.varlen() && n <= a.num_seqs; ++n)
    if (a.host_cu()[n] != b.host_cu()[n]) return false;
  return true;
}

// Owns the device copies of the two tables (see the file comment).
class ChunkTable {
 public:
  ChunkTable(const Params& p, int chunk_size, cudaStream_t stream) : stream_(stream), chunk_size_(chunk_size) {
    build_chunk_entries(p, chunk_size, host_chunks_, host_seqs_);
    for (const SeqEntry& s : host_seqs_) max_chunks_per_seq_ = s.num_chunks > max_chunks_per_seq_ ? s.num_chunks : max_chunks_per_seq_;
    try {
      upload(host_chunks_, &chunks_);
      upload(host_seqs_, &seqs_);
    } catch (...) {
      release();
      throw;
    }
  }
  // A table of given sequences only (no chunk entries): the pieces the state scan cuts sequences into
  // (scan_split.cu), each a SeqEntry whose first_chunk keeps the cut table's chunk numbering. Only the
  // state scan, which reads seqs(), runs on such a table.
  ChunkTable(std::vector<SeqEntry> seqs, int chunk_size, cudaStream_t stream)
      : stream_(stream), chunk_size_(chunk_size), host_seqs_(std::move(seqs)) {
    for (const SeqEntry& s : host_seqs_) max_chunks_per_seq_ = s.num_chunks > max_chunks_per_seq_ ? s.num_chunks : max_chunks_per_seq_;
    try {
      upload(host_seqs_, &seqs_);
    } catch (...) {
      release();
      throw;
    }
  }
  ~ChunkTable() { release(); }
  ChunkTable(const ChunkTable&) = delete;
  ChunkTable& operator=(const ChunkTable&) = delete;

  int64_t num_chunks() const { return static_cast<int64_t>(host_chunks_.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(host_seqs_.size()); }
  int64_t max_chunks_per_seq() const { return max_chunks_per_seq_; }
  int chunk_size() const { return chunk_size_; }
  // Device arrays (nullptr when empty).
  const ChunkEntry* chunks() const { return chunks_; }
  const SeqEntry* seqs() const { return seqs_; }
  // Host copies.
  const std::vector<ChunkEntry>& host_chunks() const { return host_chunks_; }
  const std::vector<SeqEntry>& host_seqs() const { return host_seqs_; }

 private:
  // Stream-ordered free: kernels already launched on stream_ finish reading first. Errors are
  // ignored here (a destructor must not throw); a failing stream reports at the next check.
  void release() {
    workspace_free(chunks_, stream_);
    workspace_free(seqs_, stream_);
    chunks_ = nullptr;
    seqs_ = nullptr;
  }

  template <class E>
  void upload(const std::vector<E>& host, E** device) {
    if (host.empty()) return;
    const size_t bytes = host.size() * sizeof(E);
    *device = static_cast<E*>(workspace_alloc(bytes, stream_));
    upload_table(*device, host.data(), bytes, stream_);
  }

  cudaStream_t stream_ = nullptr;
  int chunk_size_ = 0;
  int64_t max_chunks_per_seq_ = 0;
  std::vector<ChunkEntry> host_chunks_;
  std::vector<SeqEntry> host_seqs_;
  ChunkEntry* chunks_ = nullptr;
  SeqEntry* seqs_ = nullptr;
};

// Staged steps over pieces of a prepared problem (api.h): every chunk of `pieces` (a table over rows
// [row0, row0 + pieces' T) of the prepared problem) must be one of `prepared`'s own chunks, so that the
// step reads the prepared per-row intermediates of exactly those chunks. deltacp::Error naming
// cu_seqlens otherwise.
inline void check_pieces_on_prepared_chunks(const ChunkTable& prepared, const ChunkTable& pieces, int64_t row0, const char* what) {
  std::vector<std::pair<int64_t, int64_t>> own;
  own.reserve(prepared.host_chunks().size());
  for (const ChunkEntry& c : prepared.host_chunks()) own.emplace_back(c.row0, c.len);
  std::sort(own.begin(), own.end());
  for (const ChunkEntry& c : pieces.host_chunks())
    DELTACP_CHECK(std::binary_search(own.begin(), own.end(), std::make_pair(row0 + c.row0, c.len)), "cu_seqlens",
                  "expected pieces made of whole chunks of the prepared ", what, "; a piece has a chunk of ", c.len,
                  " tokens at row ", row0 + c.row0, " that the prepared problem does not");
}

}  // namespace deltacp::cuda::tiled
