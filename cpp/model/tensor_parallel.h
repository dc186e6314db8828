// Tensor parallelism for the decoder graph: every layer's attention heads (by KV-head groups) and MLP columns split
// evenly over T ranks (GPUs through NCCL, or virtual ranks on the CPU), driven by one host thread or one per rank.
// The layers are model/decoder.h's DecoderBody with T ranks: each linear a column-parallel shard, the all-gathers
// where the body's o / down inputs and outputs need the full width.
//
// Shard plan (the same arithmetic as exl2cpp/tensor_parallel.py's plan_tensor_parallel), rank r of T:
//   q_proj  columns [r, r+1) * nq / T          (q heads [r, r+1) * n_heads / T; needs n_kv_heads % T == 0)
//   k/v_proj columns [r, r+1) * nkv / T        (KV heads [r, r+1) * n_kv_heads / T; its KV cache shard)
//   gate/up columns [r, r+1) * I / T
//   o_proj, down_proj: columns [r, r+1) * H / T of the OUTPUT, over the FULL input
//   (fused qkv / gate_up tensors: the same columns of each part)
//   MoE layers: each expert's gate/up columns [r, r+1) * Ie / T and down output columns [r, r+1) * H / T (the shared
//   expert likewise), router and shared-expert gate whole on every rank; the experts' GLU products [n * top_k, Ie / T]
//   are gathered in the grouping's position order (every rank routes the same h: the same grouping), docs/multigpu.md
// Every linear is split by output columns only, for every weight kind: exact (a shard's weight is a block of rows
// of the full [out, in] weight, EXL2 included: q_weight/q_scale column slices, linear.h load_linear_cols), and
// EXL2's act-order row permutation never has to be cut (a row-parallel o / down with an all-reduce would cut it,
// and sum the partial products in another order on each rank count). Per layer, four all-gathers make the full
// activations again on every rank: the attention output [n, nq] (o_proj's input), o_proj's output [n, H], the GLU
// product [n, I] (down_proj's input) and down_proj's output [n, H]. The residual stream h [n, H] is replicated:
// every rank embeds the tokens itself (replicated embedding) and adds the same gathered rows, so h stays the same
// on every rank. The final norm and lm_head (full) run on rank 0 only; the logits come back from rank 0.
// An all-gather concatenates rank-major ([T, n, w]); for n > 1 a gather_rows with the step's index
// perm[i * T + r] = r * n + i turns it into row-major [n, T * w]; for n == 1 the gather lands in place.
// Widths: H, I divisible by T; EXL2 shards start and span multiples of 32 columns (else InvalidArgument).
// The host waits once per step, for the logits. Executors: by default one host thread runs each phase over all ranks
// (the gathers as one NCCL group); option tp_threads runs each rank's whole step on its own host thread (NCCL's
// thread-per-GPU model: the ranks' launches overlap), same results. A rank thread must not allocate or free device
// memory, synchronize, or load a kernel module once its step has enqueued a collective: the other GPU may already spin
// in the next collective, waiting for this rank, and with peer access on (NCCL turns it on) cudaMalloc / cudaFree /
// lazy module loading / pageable copies may wait for that GPU too: a deadlock (most likely issue 8's EXL2 hang: the
// GEMV accumulator grew again at gate_proj, after two all-gathers, on rank 1's thread). So the threaded executor runs a
// step on the rank threads only when the step is warm: one step of the same shape key (rows, pages_per_seq, page size,
// cache bits) already ran through the one-thread executor, which grew every lazily sized buffer (GEMV accumulator,
// cuda::workspace, cuBLAS handle) and loaded every kernel the shape uses, and (quantized caches) every K centring
// vector is fixed (set_k_mean copies to the host). Other steps run through the one-thread executor (CPU ranks too, so
// the rule is tested there). A threaded step that still made a device allocation un-warms its key. An error on one rank
// thread aborts the collectives (CPU: the waiting ranks throw; NCCL: ncclCommAbort on every communicator, so no GPU
// keeps waiting for the failed rank) and is rethrown; the next step makes new communicators. Option
// tp_test_fail_rank=r (tests): rank r throws after its first all-gather of every threaded step; option tp_trace: a
// stderr line per step and per rank and phase. Option tp_graphs "on" (CUDA, 2+ ranks;
// experimental) also runs decode-only batches as CUDA graphs, padded to buckets as graph.cpp does: per (rows,
// pages_per_seq) bucket the first step runs eagerly on the rank threads, the second captures one graph per rank on that
// rank's thread (thread-local capture, the NCCL calls inside), later steps replay them, each launched from its own rank
// thread (NCCL: graphs of several GPUs launched from one thread can deadlock). The final norm and lm_head run eagerly
// after the graphs. A capture that fails on any rank leaves that shape eager on every rank.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model/graph.h"

namespace exl2 {

class Workspace;

// The collective the graph needs: rank r's send[r] (all the same numel and dtype) lands at element offset
// r * numel of recv[j] on every rank j (recv[j] holds T * numel elements). CPU ranks copy; CUDA ranks use NCCL.
// all_gather: every rank from one thread (one NCCL group). all_gather_rank: rank `rank`'s part only, called by that
// rank's own thread (threaded executor); every rank must call it, in the same order. abort() (any thread, after a
// rank failed): ranks waiting in all_gather_rank throw instead of waiting for the failed rank (CPU), every NCCL
// communicator is aborted so no GPU keeps waiting on the device (CUDA), and later calls throw until reset_abort().
// reset_abort(): before each step, on the calling thread with no rank thread running; true when it had to make
// new communicators (CUDA graphs that captured the old ones are stale).
class TpComm {
 public:
  virtual ~TpComm() = default;
  virtual void all_gather(const std::vector<Tensor>& send, const std::vector<Tensor>& recv) = 0;
  virtual void all_gather_rank(int rank, const Tensor& send, const Tensor& recv) = 0;
  virtual void abort() {}
  virtual bool reset_abort() { return false; }
};
std::unique_ptr<TpComm> make_cpu_comm(int ranks);
std::unique_ptr<TpComm> make_nccl_comm(const std::vector<Device>& devices);  // Unsupported without CUDA/NCCL

struct TpShardPlan {
  int64_t ranks = 1;
  int64_t q_cols = 0, kv_cols = 0, inter_cols = 0, hidden_cols = 0;  // per rank
  int64_t q_heads = 0, kv_heads = 0;                                 // per rank
};
// InvalidArgument naming the numbers when the config does not split over `ranks`.
TpShardPlan plan_tensor_parallel(const ModelConfig& config, int64_t ranks);

class TensorParallel {
 public:
  // sizes: each rank's weight-arena reserve (per_device by rank, head: rank 0's head scope; WeightSizes in graph.h).
  TensorParallel(const ModelConfig& config, const TensorMap& tensors, const std::vector<Device>& devices,
                 const DecoderSpec& spec, int64_t max_seq_len, DType act, const WeightSizes& sizes);
  ~TensorParallel();
  Tensor forward(const Batch& batch, KVCache& cache, DeviceArgmax* argmax);  // the caller validated the batch
  std::vector<std::pair<std::string, const Linear*>> linears() const;  // every rank's shards, "name[r]"
  size_t weight_bytes() const;
  const std::vector<Device>& devices() const { return devices_; }
  const TpShardPlan& plan() const { return plan_; }

 private:
  struct Rank;
  class RankThreads;   // the threaded executor's worker threads
  using StepKey = std::array<int64_t, 4>;  // rows, pages_per_seq, page size, cache bits: what sizes a step's buffers
  void ensure_rows(int64_t n);
  void gather_cols_rank(int r, const Phase& ph, int64_t n);  // rank r's part of a gather phase
  bool threaded() const;  // option tp_threads
  // The one-thread executor; marks `key` warm when the step completes.
  void run_sequential(const std::vector<Phase>& prog, int64_t n, const StepKey& key);
  // The threaded executor when the step is warm (see above), else run_sequential.
  void run_threaded(const std::vector<Phase>& prog, int64_t n, const StepKey& key, KVCache& cache);
  bool warm(const StepKey& key, KVCache& cache) const;
  // fn(r, rank) on every rank's thread (rank 0: the caller) with its device current; the first error aborts the
  // collectives (TpComm::abort) and is rethrown once every rank is back.
  void on_rank_threads(const std::function<void(int, Rank&)>& fn);
  struct GraphCache;  // per (rows, pages_per_seq) bucket: one CUDA graph per rank
  // Rows bucket of a decode-only batch to run as CUDA graphs (option tp_graphs, CUDA), else 0.
  int64_t graph_bucket(const Batch& batch, KVCache& cache) const;
  void run_graphed(const std::vector<Phase>& prog, int64_t n, int64_t bucket, int64_t pps, KVCache& cache,
                   const StepKey& key);
  // src[r] [n, w] on rank r -> dst[r] [n, T * w] on every rank (columns of rank r at r * w).
  void gather_cols(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, int64_t n, int64_t w,
                   const std::vector<Tensor>& perm);
  void gather_phase(const Phase& ph, int64_t n);  // gather_cols over every rank's run.b.*src / .*dst
  template <typename F>
  void each_rank(F&& fn);

  ModelConfig config_;
  DecoderSpec spec_;
  DType act_;
  TpShardPlan plan_;
  std::vector<Device> devices_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<TpComm> comm_;
  Tensor final_norm_;                // rank 0
  std::unique_ptr<Linear> lm_head_;  // rank 0, full
  int64_t rows_ = 0;
  std::vector<Tensor> perm_;      // per rank: the step's reorder index (n > 1)
  std::vector<Tensor> perm_moe_;  // per rank: the same for the n * top_k rows of MoE layers' expert gathers
  std::unique_ptr<RankThreads> pool_;
  std::unique_ptr<GraphCache> graphs_;
  uint64_t buf_generation_ = 0;  // bumped when ensure_rows reallocates (graphs point at those buffers)
  std::mutex cache_mutex_;       // the KV cache's host-side state (quantized caches' K-mean flags) under threads
  std::set<StepKey> warm_;       // shapes a one-thread step has run (threaded executor)
};

}  // namespace exl2
