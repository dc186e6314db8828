// Tensor-parallel decoder graph (see tensor_parallel.h): the shard plan, loading each rank's shards, the step
// (DecoderBody's phases over T ranks: four all-gathers per layer), and the CPU / NCCL collectives.
#include "model/tensor_parallel.h"

#include "exl2/options.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <thread>

#include "cache/kv_quant.h"
#include "core/device_api.h"
#include "core/weight_arena.h"
#include "model/decode_layout.h"
#include "model/rope.h"
#include "model/workspace.h"
#include "ops/ops.h"

#ifdef EXL2_WITH_CUDA
#include "cuda/stream.h"
#include "cuda/graph_exec.h"
#include "cuda/multi_device.h"
#include "cuda/nccl.h"
#endif

namespace exl2 {

// ---- collectives ------------------------------------------------------------------------------------------------

namespace {

class CpuComm final : public TpComm {
 public:
  explicit CpuComm(int ranks) : ranks_(ranks), slots_(ranks, nullptr) {}

  void all_gather_rank(int rank, const Tensor& send, const Tensor& recv) override {
    const size_t bytes = send.nbytes();
    EXL2_CHECK_KIND(Internal, recv.nbytes() == bytes * ranks_, "all_gather: rank ", rank, " receives ", recv.nbytes(),
                    " bytes, expected ", bytes * ranks_);
    slots_[rank] = send.data();
    barrier();  // every rank's send buffer is posted
    for (int r = 0; r < ranks_; ++r) std::memcpy(static_cast<char*>(recv.data()) + r * bytes, slots_[r], bytes);
    barrier();  // every rank has read every send buffer: they may be overwritten again
  }
  void abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  bool reset_abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = false;
    arrived_ = 0;
    return false;
  }

  void all_gather(const std::vector<Tensor>& send, const std::vector<Tensor>& recv) override {
    const size_t bytes = send.at(0).nbytes();
    for (size_t j = 0; j < recv.size(); ++j) {
      EXL2_CHECK_KIND(Internal, recv[j].nbytes() == bytes * send.size(), "all_gather: rank ", j, " receives ",
                      recv[j].nbytes(), " bytes, expected ", bytes * send.size());
      for (size_t r = 0; r < send.size(); ++r)
        std::memcpy(static_cast<char*>(recv[j].data()) + r * bytes, send[r].data(), bytes);
    }
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    EXL2_CHECK_KIND(Internal, !aborted_, "tensor parallel: another rank failed during this step");
    const uint64_t gen = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
    EXL2_CHECK_KIND(Internal, generation_ != gen, "tensor parallel: another rank failed during this step");
  }

  int ranks_;
  std::vector<const void*> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
};

#ifdef EXL2_WITH_CUDA
class NcclComm final : public TpComm {
 public:
  explicit NcclComm(const std::vector<Device>& devices) : devices_(devices), group_(indices(devices)) {}
  void abort() override { group_.abort(); }
  bool reset_abort() override {
    if (!group_.aborted()) return false;
    group_.reinit();
    // NCCL connects a communicator's channels in its first collective: do that now, from this one thread.
    std::vector<Tensor> send, recv;
    for (const Device& d : devices_) {
      send.push_back(Tensor::zeros({int64_t{1} << 16}, DType::F16, d));
      recv.push_back(Tensor::zeros({static_cast<int64_t>(devices_.size()) << 16}, DType::F16, d));
    }
    all_gather(send, recv);
    for (const Device& d : devices_) device::cuda_synchronize(d.index);
    return true;
  }
  void all_gather(const std::vector<Tensor>& send, const std::vector<Tensor>& recv) override {
    std::vector<const void*> s;
    std::vector<void*> r;
    for (const Tensor& t : send) s.push_back(t.data());
    for (const Tensor& t : recv) r.push_back(t.data());
    group_.all_gather(s, r, static_cast<size_t>(send.at(0).numel()), send.at(0).dtype());
  }
  void all_gather_rank(int rank, const Tensor& send, const Tensor& recv) override {
    group_.all_gather_rank(rank, send.data(), recv.data(), static_cast<size_t>(send.numel()), send.dtype());
  }

 private:
  static std::vector<int> indices(const std::vector<Device>& devices) {
    std::vector<int> idx;
    for (const Device& d : devices) idx.push_back(d.index);
    return idx;
  }
  std::vector<Device> devices_;
  cuda::NcclGroup group_;
};
#endif

}  // namespace

std::unique_ptr<TpComm> make_cpu_comm(int ranks) {
  return std::make_unique<CpuComm>(ranks);
}

std::unique_ptr<TpComm> make_nccl_comm(const std::vector<Device>& devices) {
#ifdef EXL2_WITH_CUDA
  return std::make_unique<NcclComm>(devices);
#else
  (void)devices;
  EXL2_FAIL(Unsupported, "tensor parallel on CUDA devices needs a build with the CUDA backend");
#endif
}

// ---- plan -------------------------------------------------------------------------------------------------------

TpShardPlan plan_tensor_parallel(const ModelConfig& c, int64_t T) {
  EXL2_CHECK(T >= 1, "tensor parallel needs at least one rank, got ", T);
  EXL2_CHECK(c.num_key_value_heads % T == 0, "tensor parallel over ", T,
             " GPUs splits attention by KV heads, but num_key_value_heads = ", c.num_key_value_heads,
             " is not divisible by ", T,
             "; use a GPU count that divides it, or a layer split "
             "(gpu_split) instead");
  EXL2_CHECK(c.num_attention_heads % T == 0, "tensor parallel over ", T,
             ": num_attention_heads = ", c.num_attention_heads, " is not divisible by ", T);
  EXL2_CHECK(c.hidden_size % T == 0, "tensor parallel over ", T, ": hidden_size = ", c.hidden_size,
             " is not divisible by ", T);
  EXL2_CHECK(c.intermediate_size % T == 0, "tensor parallel over ", T, ": intermediate_size = ", c.intermediate_size,
             " is not divisible by ", T);
  TpShardPlan p;
  p.ranks = T;
  p.q_heads = c.num_attention_heads / T;
  p.kv_heads = c.num_key_value_heads / T;
  p.q_cols = p.q_heads * c.head_dim;
  p.kv_cols = p.kv_heads * c.head_dim;
  p.inter_cols = c.intermediate_size / T;
  p.hidden_cols = c.hidden_size / T;
  return p;
}

// ---- loading ----------------------------------------------------------------------------------------------------

struct TensorParallel::Rank {
  Device dev;
  Tensor embed;
  std::vector<Tensor> ropes;  // by spec ropes index
  std::vector<DecoderLayer> layers;
  std::unique_ptr<Workspace> ws;
  Tensor wide;     // act [rows * max(nq, I)]: the gathered attention output or GLU product
  Tensor out;      // act [rows, H / T]: o_proj / down_proj shard output
  Tensor scratch;  // act [rows * max(nq, I, H)]: rank-major all-gather target (n > 1)
  RankRun run;     // the step's buffers and metadata, as the body's phases read them
};

// ranks - 1 persistent worker threads; run(fn) calls fn(0) on the calling thread and fn(r) on worker r, waits for
// all, and rethrows the first exception.
class TensorParallel::RankThreads {
 public:
  explicit RankThreads(int ranks) : errors_(ranks) {
    for (int r = 1; r < ranks; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  void run(const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      pending_ = static_cast<int>(threads_.size());
      ++generation_;
      for (auto& e : errors_) e = nullptr;
    }
    cv_.notify_all();
    try {
      call(fn, 0);
    } catch (...) {
      errors_[0] = std::current_exception();
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, [&] { return pending_ == 0; });
      job_ = nullptr;
    }
#ifdef EXL2_WITH_CUDA
    cuda::release_deferred_frees();  // every rank thread is out of the step
#endif
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void loop(int r) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      try {
        call(*job, r);
      } catch (...) {
        errors_[r] = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  // A rank's part of a step. On CUDA no cudaFree runs meanwhile (deferred until every rank is done): cudaFree
  // synchronizes its device under the driver's allocation lock while that device may wait in an NCCL collective
  // for a rank whose thread needs the lock (cudaMalloc) before it can reach the collective.
  static void call(const std::function<void(int)>& fn, int r) {
#ifdef EXL2_WITH_CUDA
    cuda::DeferFrees defer;
#endif
    fn(r);
  }

  std::vector<std::thread> threads_;
  std::vector<std::exception_ptr> errors_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

namespace {

#ifdef EXL2_WITH_CUDA
using Scope = cuda::ScopedDevice;
#else
struct Scope {
  explicit Scope(int) {}
};
#endif

}  // namespace

template <typename F>
void TensorParallel::each_rank(F&& fn) {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    Rank& R = *ranks_[r];
    if (R.dev.is_cuda()) {
      Scope scope(R.dev.index);
      fn(static_cast<int>(r), R);
    } else {
      fn(static_cast<int>(r), R);
    }
  }
}

TensorParallel::TensorParallel(const ModelConfig& c, const TensorMap& tm, const std::vector<Device>& devices,
                               const DecoderSpec& spec, int64_t max_seq_len, DType act, const WeightSizes& sizes)
    : config_(c), spec_(spec), act_(act), devices_(devices) {
  const int64_t T = static_cast<int64_t>(devices.size());
  plan_ = plan_tensor_parallel(c, T);
  const MoeDims moe = moe_dims(spec_, c, T);
  EXL2_CHECK(moe.expert_full % T == 0 && moe.shared_full % T == 0, "tensor parallel over ", T,
             ": the experts' intermediate size ", moe.expert_full, " (shared expert ", moe.shared_full,
             ") is not divisible by ", T);
  const int64_t H = c.hidden_size;
  const bool cuda = devices[0].is_cuda();
  for (const Device& d : devices)
    EXL2_CHECK(d.is_cuda() == cuda, "tensor parallel: devices must be all CUDA or all CPU, got ", d.str(), " and ",
               devices[0].str());
  if (cuda) {
    for (size_t i = 0; i < devices.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        EXL2_CHECK(devices[i] != devices[j], "tensor parallel: ", devices[i].str(), " is listed twice");
  }
  // Communicators first: a missing NCCL fails before any weight is uploaded.
  comm_ = cuda ? make_nccl_comm(devices) : make_cpu_comm(static_cast<int>(T));

  const TensorNames& names = spec_.names;
  Tensor emb = tm.get_checked(names.embed, {c.vocab_size, H}, {DType::F16, DType::BF16, DType::F32});
  const std::vector<Tensor> ropes_host = rope_tables(spec_, c, max_seq_len);
  const TpShardPlan& p = plan_;
  WorkspaceDims dims;
  dims.hidden = H;
  dims.q_width = p.q_cols;
  dims.kv_width = p.kv_cols;
  dims.intermediate = p.inter_cols;
  dims.vocab = c.vocab_size;
  dims.moe = moe;
  // The arena reserves: Model::load's sizes (CPU: none, dense CPU weights stay mapped).
  const size_t head_bytes = cuda ? sizes.head : 0;
  auto rank_bytes = [&](int64_t r) {
    return cuda && r < static_cast<int64_t>(sizes.per_device.size()) ? sizes.per_device[static_cast<size_t>(r)] : 0;
  };
  for (int64_t r = 0; r < T; ++r) {
    auto R = std::make_unique<Rank>();
    const Device dev = devices[r];
    R->dev = dev;
    // This rank's weights from one arena on its device (core/weight_arena.h; this thread, this device only).
    auto arena = std::make_unique<WeightArenaScope>(dev, rank_bytes(r));
    R->embed = dev.is_cpu() ? emb : emb.to_dtype(DType::F16).to(dev);
    for (const Tensor& t : ropes_host) R->ropes.push_back(t.to(dev));
    R->layers.reserve(c.num_hidden_layers);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) R->layers.push_back(load_layer(spec_, c, tm, i, dev, r, T));
    arena.reset();
    R->ws = std::make_unique<Workspace>(dev, act_, dims);
    ranks_.push_back(std::move(R));
  }
  {
    WeightArenaScope head_arena(devices[0], head_bytes);  // ends before the NCCL warm-up
    final_norm_ = load_norm(spec_, tm, names.final_norm, H, devices[0]);
    if (tm.contains(names.head + ".weight") || tm.contains(names.head + ".q_weight")) {
      lm_head_ = load_linear(tm, names.head, H, c.vocab_size, false, devices[0]);
    } else {
      EXL2_CHECK_KIND(ModelFormat, c.tie_word_embeddings,
                      "missing tensor lm_head.weight (and tie_word_embeddings is false in config.json)");
      lm_head_ = make_dense_linear(emb, Tensor(), devices[0]);
    }
  }
  perm_.resize(T);
  perm_moe_.resize(T);
  if (cuda) {  // NCCL connects a communicator's channels in its first collective: do that now, from one thread
    std::vector<Tensor> send, recv;
    for (const Device& d : devices) {
      send.push_back(Tensor::zeros({int64_t{1} << 16}, act_, d));
      recv.push_back(Tensor::zeros({T << 16}, act_, d));
    }
    comm_->all_gather(send, recv);
    for (const Device& d : devices) device::cuda_synchronize(d.index);
  }
}

TensorParallel::~TensorParallel() = default;

std::vector<std::pair<std::string, const Linear*>> TensorParallel::linears() const {
  std::vector<std::pair<std::string, const Linear*>> out;
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i)
    for (size_t r = 0; r < ranks_.size(); ++r)
      layer_linears(spec_, config_, i, ranks_[r]->layers[i], str_cat("[", r, "]"), out);
  out.emplace_back(spec_.names.head, lm_head_.get());
  return out;
}

size_t TensorParallel::weight_bytes() const {
  size_t total = final_norm_.nbytes();
  for (const auto& kv : linears()) total += kv.second->nbytes();
  for (const auto& R : ranks_) {
    total += R->embed.nbytes();
    for (const DecoderLayer& L : R->layers) total += layer_norm_bytes(L);
  }
  return total;
}

// ---- the step ---------------------------------------------------------------------------------------------------

void TensorParallel::ensure_rows(int64_t n) {
  if (n <= rows_) return;
  const int64_t rows = (n + 63) / 64 * 64;
  const int64_t nq = plan_.q_cols * plan_.ranks, I = config_.intermediate_size, H = config_.hidden_size;
  const MoeDims moe = moe_dims(spec_, config_, plan_.ranks);  // the gathers of MoE layers: [n * top_k, expert_full]
  const int64_t wide = std::max(nq, I), all = std::max({wide, H, moe.top_k * moe.expert_full, moe.shared_full});
  each_rank([&](int, Rank& R) {
    R.ws->finish_step();  // the previous step may still use the old buffers
    R.wide = R.out = R.scratch = Tensor();
    R.wide = Tensor::empty({rows * wide}, act_, R.dev);
    R.out = Tensor::empty({rows, plan_.hidden_cols}, act_, R.dev);
    R.scratch = Tensor::empty({rows * all}, act_, R.dev);
  });
  rows_ = rows;
  ++buf_generation_;
}

void TensorParallel::gather_cols(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, int64_t n, int64_t w,
                                 const std::vector<Tensor>& perm) {
  const int64_t T = plan_.ranks;
  if (n == 1) {  // [T, 1, w] is [1, T * w]: straight into place
    comm_->all_gather(src, dst);
    return;
  }
  std::vector<Tensor> tmp;
  for (const auto& R : ranks_) tmp.push_back(R->scratch.slice(0, T * n * w));
  comm_->all_gather(src, tmp);
  each_rank([&](int r, Rank&) {
    Tensor out = dst[r].view({n * T, w});
    ops::gather_rows(tmp[r].view({T * n, w}), perm[r], out);
  });
}

void TensorParallel::gather_phase(const Phase& ph, int64_t n) {
  std::vector<Tensor> src, dst;
  for (const auto& R : ranks_) {
    src.push_back(R->run.b.*ph.src);
    dst.push_back(R->run.b.*ph.dst);
  }
  gather_cols(src, dst, n * ph.rows_per_token, ph.width, ph.rows_per_token == 1 ? perm_ : perm_moe_);
}

void TensorParallel::gather_cols_rank(int r, const Phase& ph, int64_t n_tokens) {
  const int64_t T = plan_.ranks, w = ph.width, n = n_tokens * ph.rows_per_token;
  const Tensor& perm = (ph.rows_per_token == 1 ? perm_ : perm_moe_)[r];
  const StepBufs& b = ranks_[r]->run.b;
  if (n == 1) {
    comm_->all_gather_rank(r, b.*ph.src, b.*ph.dst);
    return;
  }
  Tensor tmp = ranks_[r]->scratch.slice(0, T * n * w);
  comm_->all_gather_rank(r, b.*ph.src, tmp);
  Tensor out = (b.*ph.dst).view({n * T, w});
  ops::gather_rows(tmp.view({T * n, w}), perm, out);
}

bool TensorParallel::threaded() const { return ranks_.size() > 1 && runtime_options().tp_threads; }

namespace {

// Option tp_trace: one stderr line per executor decision and per rank and phase of threaded steps (where a hang
// stops, without a debugger).
bool trace_enabled() { return runtime_options().tp_trace; }
std::atomic<uint64_t> g_trace_step{0};

}  // namespace

void TensorParallel::run_sequential(const std::vector<Phase>& prog, int64_t n, const StepKey& key) {
  if (trace_enabled())
    std::fprintf(stderr, "[tp] step %llu: one thread (rows %lld, pages/seq %lld, page %lld, bits %lld)\n",
                 static_cast<unsigned long long>(++g_trace_step), static_cast<long long>(key[0]),
                 static_cast<long long>(key[1]), static_cast<long long>(key[2]), static_cast<long long>(key[3]));
  for (const Phase& ph : prog) {
    if (ph.fn) {
      each_rank([&](int, Rank& R) { ph.fn(R.run); });
    } else {
      gather_phase(ph, n);
    }
  }
  warm_.insert(key);
}

bool TensorParallel::warm(const StepKey& key, KVCache& cache) const {
  if (!warm_.count(key)) return false;
  if (cache.quantized())  // set_k_mean copies K to the host: never on a rank thread
    for (int64_t li = 0; li < cache.n_layers(); ++li)
      for (int r = 0; r < static_cast<int>(ranks_.size()); ++r)
        if (!cache.k_mean_set(cache.shard(li, r))) return false;
  return true;
}

void TensorParallel::on_rank_threads(const std::function<void(int, Rank&)>& fn) {
  if (!pool_) pool_ = std::make_unique<RankThreads>(static_cast<int>(ranks_.size()));
  std::mutex first_mutex;
  std::exception_ptr first;  // the error that stopped the step (not the "another rank failed" of the others)
  try {
    pool_->run([&](int r) {
      Rank& R = *ranks_[r];
      std::unique_ptr<Scope> scope;
      if (R.dev.is_cuda()) scope = std::make_unique<Scope>(R.dev.index);
      try {
        fn(r, R);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(first_mutex);
          if (!first) first = std::current_exception();
        }
        // The other ranks stop at their next collective (CPU: also those waiting in one); on CUDA, NCCL kernels
        // already waiting on the devices for this rank give up, so no stream and no host sync waits forever.
        comm_->abort();
        throw;
      }
    });
  } catch (...) {
    if (first) std::rethrow_exception(first);
    throw;
  }
}

void TensorParallel::run_threaded(const std::vector<Phase>& prog, int64_t n, const StepKey& key, KVCache& cache) {
  if (!warm(key, cache)) {
    run_sequential(prog, n, key);
    return;
  }
  int fail_rank = -1;  // test hook: this rank throws after its first all-gather
  if (runtime_options().tp_test_fail_rank >= 0) fail_rank = runtime_options().tp_test_fail_rank;
  const bool trace = trace_enabled();
  const unsigned long long step = trace ? ++g_trace_step : 0;
  if (trace) std::fprintf(stderr, "[tp] step %llu: rank threads (rows %lld)\n", step, static_cast<long long>(n));
#ifdef EXL2_WITH_CUDA
  const int64_t mallocs = cuda::device_malloc_count();
#endif
  on_rank_threads([&](int r, Rank& R) {
    int gathers = 0;
    for (size_t p = 0; p < prog.size(); ++p) {
      const Phase& ph = prog[p];
      if (trace)
        std::fprintf(stderr, "[tp] step %llu rank %d phase %zu/%zu %s\n", step, r, p, prog.size(),
                     ph.fn ? "run" : "all-gather");
      if (ph.fn) {
        EXL2_CHECK_KIND(Internal, !(r == fail_rank && gathers == 1), "option tp_test_fail_rank: rank ", r,
                        " fails on purpose after its first all-gather (a test of the abort path)");
        ph.fn(R.run);
      } else {
        gather_cols_rank(r, ph, n);
        ++gathers;
      }
    }
    if (trace) std::fprintf(stderr, "[tp] step %llu rank %d done\n", step, r);
  });
#ifdef EXL2_WITH_CUDA
  // Something a warm step should not do (the key misses a size?): the next step of this shape warms up again.
  if (cuda::device_malloc_count() != mallocs) warm_.erase(key);
#endif
}

// ---- CUDA graphs of decode steps (option tp_graphs) -------------------------------------------------------------

struct TensorParallel::GraphCache {
#ifdef EXL2_WITH_CUDA
  struct Entry {
    bool warm = false, failed = false;
    std::vector<std::unique_ptr<cuda::Graph>> graphs;  // per rank, captured on that rank's thread
    std::vector<uint64_t> generations;                 // the buffers they point at: workspaces, ours, scratch
    std::vector<const void*> cache_ptrs;
    int page_size = 0;
  };
  std::map<std::pair<int64_t, int64_t>, Entry> entries;  // (rows bucket, pages_per_seq bucket)
#endif
};

int64_t TensorParallel::graph_bucket(const Batch& b, KVCache& cache) const {
  const std::string& v = runtime_options().tp_graphs;
  if (ranks_.size() < 2 || v == "off") return 0;
  // "cpu-pad" (tests): CPU ranks run the padded decode layout through the threaded executor, no graphs.
  if (devices_[0].is_cpu() != (v == "cpu-pad")) return 0;
#ifdef EXL2_WITH_CUDA
  if (devices_[0].is_cuda() && !cuda::graphs_enabled()) return 0;
#endif
  const int64_t bucket = decode_rows_bucket(b, 1);  // one row per sequence (model/decode_layout.h)
  if (bucket == 0) return 0;
  if (cache.quantized())  // K centring vectors are fixed in an eager step, never inside a graph
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r)
      if (!cache.k_mean_set(cache.shard(cache.n_layers() - 1, r))) return 0;
  return bucket;
}

void TensorParallel::run_graphed(const std::vector<Phase>& prog, int64_t n, int64_t bucket, int64_t pps, KVCache& cache,
                                 const StepKey& key) {
  if (devices_[0].is_cpu()) {  // the "cpu-pad" test hook: the padded layout, no graphs
    run_threaded(prog, n, key, cache);
    return;
  }
#ifdef EXL2_WITH_CUDA
  if (!graphs_) graphs_ = std::make_unique<GraphCache>();
  if (!pool_) pool_ = std::make_unique<RankThreads>(static_cast<int>(ranks_.size()));
  std::vector<const void*> ptrs;
  for (int64_t s = 0; s < cache.n_layers() * cache.tp(); ++s) {
    ptrs.push_back(cache.k(s).data());
    ptrs.push_back(cache.v(s).data());
    if (cache.quantized()) {
      ptrs.push_back(cache.k_scales(s).data());
      ptrs.push_back(cache.v_scales(s).data());
      ptrs.push_back(cache.k_mean(s).data());
      ptrs.push_back(cache.sink() ? cache.k_sink(s).data() : nullptr);
      ptrs.push_back(cache.sink() ? cache.v_sink(s).data() : nullptr);
    }
  }
  ptrs.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(cache.bits())));
  // Each rank's graph is launched from that rank's own thread, its device current (NCCL: graphs of several GPUs
  // launched from one thread can deadlock).
  auto launch_graphs = [&](const std::vector<std::unique_ptr<cuda::Graph>>& gs) {
    on_rank_threads([&](int r, Rank& R) { gs[r]->launch(R.dev.index); });
  };
  std::vector<uint64_t> gens = {buf_generation_, cuda::scratch_generation()};
  for (const auto& R : ranks_) gens.push_back(R->ws->generation());
  GraphCache::Entry& e = graphs_->entries[{bucket, pps}];
  if (e.cache_ptrs != ptrs || e.page_size != cache.page_size()) {  // another cache: start over for this shape
    e = GraphCache::Entry();
    e.cache_ptrs = std::move(ptrs);
    e.page_size = cache.page_size();
  }
  if (!e.graphs.empty() && e.generations != gens) e.graphs.clear();  // a buffer they captured was reallocated
  if (!e.graphs.empty()) {
    launch_graphs(e.graphs);
    return;
  }
  if (!e.warm || e.failed || !warm(key, cache)) {  // eager first: buffers grow, kernels load
    run_threaded(prog, n, key, cache);
    e.warm = true;
    return;
  }
  const int T = static_cast<int>(ranks_.size());
  std::vector<std::unique_ptr<cuda::Graph>> graphs(T);
  std::vector<char> ok(T, 0);
  pool_->run([&](int r) {
    Rank& R = *ranks_[r];
    Scope scope(R.dev.index);
    auto g = std::make_unique<cuda::Graph>();
    try {
      g->capture(R.dev.index, [&] {
        for (const Phase& ph : prog) {
          if (ph.fn) {
            ph.fn(R.run);
          } else {
            gather_cols_rank(r, ph, n);
          }
        }
      });
      graphs[r] = std::move(g);
      ok[r] = 1;
    } catch (const std::exception&) {
      // this shape stays eager; the eager run below rethrows real errors
    }
  });
  const bool all = std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
  if (all && gens[1] == cuda::scratch_generation()) {
    e.graphs = std::move(graphs);
    e.generations = gens;
    launch_graphs(e.graphs);
    return;
  }
  if (!all) cuda::note_capture_failure();
  e.failed = !all;
  run_threaded(prog, n, key, cache);
#else
  (void)bucket;
  (void)pps;
  run_threaded(prog, n, key, cache);
#endif
}

Tensor TensorParallel::forward(const Batch& batch, KVCache& cache, DeviceArgmax* argmax) {
  const ModelConfig& c = config_;
  const int64_t T = plan_.ranks;
  EXL2_CHECK(cache.tp() == T, "forward: the cache is split over ", cache.tp(),
             " tensor-parallel ranks, the model over ", T, "; make the cache with this model's make_cache");
  for (int64_t r = 0; r < T; ++r)
    EXL2_CHECK(cache.k(cache.shard(0, static_cast<int>(r))).device() == devices_[r], "forward: the cache's rank ", r,
               " shard is on ", cache.k(cache.shard(0, static_cast<int>(r))).device().str(), ", the model's on ",
               devices_[r].str(), "; make the cache with this model's make_cache");
  // The step's rows: the batch as it is, or (graphed decode) padded to a bucket of B rows with graph.cpp's layout:
  // row i < n_real is batch row i as sequence i, padding rows are token 0 at position 0 of sequence B, whose pages
  // (like every page past a sequence's own) are the cache's scratch page; pages_per_seq bucketed to a power of 2.
  const int64_t n_real = static_cast<int64_t>(batch.tokens.size());
  const int64_t m_real = batch.logit_rows.empty() ? n_real : static_cast<int64_t>(batch.logit_rows.size());
  const int64_t bucket = graph_bucket(batch, cache);
  int64_t n = n_real, m = m_real, pps = batch.pages_per_seq;
  bool pick = !batch.logit_rows.empty();
  // ids[n] pos[n] seq[n] pages[n_seqs * pps] (n_seqs: every group's rows) (logit_idx[m]) (perm[n * T] when n > 1)
  std::vector<int32_t> host;
  if (bucket > 0) {
    n = m = bucket;
    pick = true;
    pps = decode_pages_bucket(batch, cache.page_size());
    const int64_t groups = cache.n_groups();  // one [n + 1, pps] table per layer group
    host.assign(3 * n + groups * (n + 1) * pps + m, 0);
    decode_page_tables(batch, groups, n, pps, cache.scratch_page(), host.data() + 3 * n);
    decode_row_meta(batch, n, host.data(), host.data() + 3 * n + groups * (n + 1) * pps);
  } else {
    host.insert(host.end(), batch.tokens.begin(), batch.tokens.end());
    host.insert(host.end(), batch.positions.begin(), batch.positions.end());
    host.insert(host.end(), batch.seq_of_token.begin(), batch.seq_of_token.end());
    host.insert(host.end(), batch.page_table.begin(), batch.page_table.end());
    if (pick) host.insert(host.end(), batch.logit_rows.begin(), batch.logit_rows.end());
  }
  const int64_t n_seqs = (static_cast<int64_t>(host.size()) - 3 * n - (pick ? m : 0)) / pps;
  const int64_t o_pages = 3 * n, o_idx = o_pages + n_seqs * pps, o_perm = o_idx + (pick ? m : 0);
  const bool reorder = n > 1;
  if (reorder)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < T; ++k) host.push_back(static_cast<int32_t>(k * n + i));
  // MoE layers gather [n * top_k, w] expert rows: their own reorder index.
  const int64_t n_moe = n * moe_dims(spec_, c, T).top_k, o_perm_moe = static_cast<int64_t>(host.size());
  if (n_moe > 1)
    for (int64_t i = 0; i < n_moe; ++i)
      for (int64_t k = 0; k < T; ++k) host.push_back(static_cast<int32_t>(k * n_moe + i));
  const int64_t total = static_cast<int64_t>(host.size());
  // An earlier threaded step failed and aborted the collectives: new communicators (and graphs, which captured the
  // old ones) before anything is enqueued.
  if (comm_->reset_abort()) graphs_.reset();
  ensure_rows(n);

  // Metadata: one async upload per rank into its workspace.
  Workspace& ws0 = *ranks_[0]->ws;
  struct Meta {
    Tensor ids, pos, seq, pages, logit_idx;
  };
  std::vector<Meta> meta(T);
  for (int64_t r = 0; r < T; ++r) {
    Workspace& w = *ranks_[r]->ws;
    w.begin_step();
    w.reserve(std::max(n, m), total);
    std::memcpy(w.staging(), host.data(), total * sizeof(int32_t));
    w.upload(total);
    Meta& md = meta[r];
    md.ids = w.meta(0, n);
    md.pos = w.meta(n, n);
    md.seq = w.meta(2 * n, n);
    md.pages = w.meta(o_pages, n_seqs * pps).view({n_seqs, pps});
    if (pick) md.logit_idx = w.meta(o_idx, m);
    perm_[r] = reorder ? w.meta(o_perm, n * T) : Tensor();
    perm_moe_[r] = n_moe > 1 ? w.meta(o_perm_moe, n_moe * T) : Tensor();
  }

  const int64_t nq_full = c.num_attention_heads * c.head_dim, I = c.intermediate_size;
  for (int64_t r = 0; r < T; ++r) {
    Rank& R = *ranks_[r];
    Workspace& w = *R.ws;
    RankRun& run = R.run;
    run.rank = static_cast<int>(r);
    run.layers = &R.layers;
    run.ropes = &R.ropes;
    run.b = StepBufs{w.h(n), w.x(n), w.q(n), w.k(n), w.v(n), w.attn(n), w.gate(n), w.up(n),
                     R.wide.slice(0, n * nq_full).view({n, nq_full}), R.wide.slice(0, n * I).view({n, I}),
                     R.out.slice(0, n)};
    attach_moe(run.b, w.moe(n));
    run.pos = meta[r].pos;
    run.seq = meta[r].seq;
    run.pages = meta[r].pages;
  }
  // The step as a program of phases (DecoderBody over T ranks): per-rank computations and all-gathers. Sequential
  // executor (default): each phase over all ranks from this thread, the gathers as one NCCL group. Threaded
  // (option tp_threads): one host thread per rank runs the whole program, each gather a plain per-rank NCCL call
  // (NCCL's thread-per-GPU model), so the ranks' launches overlap.
  StepShared sh;
  sh.cache = &cache;
  sh.cache_mutex = &cache_mutex_;
  DecoderBody body(spec_, c, T, sh);
  std::vector<Phase> prog;
  prog.reserve(1 + 9 * c.num_hidden_layers);
  {
    Phase embed;
    embed.fn = [&](RankRun& run) { embed_tokens(spec_, meta[run.rank].ids, ranks_[run.rank]->embed, run.b.h); };
    prog.push_back(std::move(embed));
  }
  for (int64_t li = 0; li < c.num_hidden_layers; ++li) body.layer(prog, li, li + 1 == c.num_hidden_layers);
  const StepKey key = {n, pps, cache.page_size(), cache.bits()};
  // MoE steps past the grouped kernels' rows read the expert grouping on the host (MoeExperts' per-expert path): a
  // sync, never on a rank thread.
  const bool moe_host_read = devices_[0].is_cuda() && n_moe > 0 && n > MoeExperts::kGroupedMaxRows;
  if (bucket > 0) {
    run_graphed(prog, n, bucket, pps, cache, key);
  } else if (threaded() && !moe_host_read) {
    run_threaded(prog, n, key, cache);
  } else {
    run_sequential(prog, n, key);
  }

  // Head on rank 0.
  Rank& R0 = *ranks_[0];
  std::unique_ptr<Scope> scope;
  if (R0.dev.is_cuda()) scope = std::make_unique<Scope>(R0.dev.index);
  auto head = [&](Tensor& logits, Tensor& logits32) {
    Tensor rows = R0.ws->h(n);
    if (pick) {
      rows = ws0.picked(m);
      ops::gather_rows(R0.ws->h(n), meta[0].logit_idx, rows);
    }
    Tensor normed = ws0.normed(m);
    head_forward(spec_, rows, final_norm_, *lm_head_, normed, logits, logits32);
  };
  if (R0.dev.is_cpu()) {
    Tensor logits32 = Tensor::empty({m, c.vocab_size}, DType::F32, R0.dev);
    Tensor unused;
    head(unused, logits32);
    return logits_to_host(logits32, m_real, argmax);
  }
  if (m <= Workspace::kKeptLogitRows) {
    Tensor logits = ws0.logits(m), logits32 = ws0.logits32(m);
    head(logits, logits32);
    return ws0.download_logits(m_real, argmax);  // padded decode: the first m_real of the bucket's rows
  }
  Tensor logits = Tensor::empty({m, c.vocab_size}, act_, R0.dev);
  Tensor logits32 = Tensor::empty({m, c.vocab_size}, DType::F32, R0.dev);
  head(logits, logits32);
  Tensor result = logits_to_host(logits32, m_real, argmax);
  ws0.finish_step();
  return result;
}

}  // namespace exl2
