// NCCL loaded with dlopen and the few C API functions exl2cpp uses, declared here (see cuda/nccl.h).
#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <mutex>

#include "cuda/check.h"
#include "cuda/nccl.h"
#include "cuda/stream.h"

namespace exl2::cuda {

namespace {

// The slice of nccl.h we use (NCCL 2.x ABI, stable since 2.0): opaque communicators, int results and enums.
using ncclResult_t = int;
using ncclComm_t = void*;
constexpr int kNcclSuccess = 0;
constexpr int kNcclSum = 0;
constexpr int kNcclInt32 = 2, kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclBfloat16 = 9;

struct NcclApi {
  void* handle = nullptr;
  std::string path;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*CommInitAll)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;  // NCCL >= 2.4; may be missing
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;  // NCCL >= 2.13; may be missing
};

std::mutex g_mutex;
std::string g_preferred;
NcclApi g_api;

template <typename F>
void bind(void* h, const char* name, F& fn, const std::string& path, bool required = true) {
  fn = reinterpret_cast<F>(dlsym(h, name));
  EXL2_CHECK_KIND(Unsupported, fn || !required, "NCCL library ", path, " has no symbol ", name,
                  " (too old? exl2cpp needs NCCL 2.x, e.g. the nvidia-nccl-cu13 wheel)");
}

const NcclApi& api() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_api.handle) return g_api;
  std::vector<std::string> tried;
  std::vector<std::string> cands;
  if (!g_preferred.empty()) cands.push_back(g_preferred);
  if (const char* env = std::getenv("NCCL_LIBRARY"); env && *env) cands.push_back(env);
  cands.push_back("libnccl.so.2");
  std::string errors;
  for (const std::string& c : cands) {
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      g_api.handle = h;
      g_api.path = c;
      break;
    }
    const char* e = dlerror();
    errors += "\n  " + c + ": " + (e ? e : "not found");
  }
  EXL2_CHECK_KIND(Unsupported, g_api.handle != nullptr,
                  "tensor parallel needs NCCL (libnccl.so.2) but it could not be loaded; tried:", errors,
                  "\ninstall NVIDIA's wheel (pip install nvidia-nccl-cu13) or set NCCL_LIBRARY=/path/to/libnccl.so.2");
  void* h = g_api.handle;
  const std::string& p = g_api.path;
  bind(h, "ncclGetVersion", g_api.GetVersion, p);
  bind(h, "ncclCommInitAll", g_api.CommInitAll, p);
  bind(h, "ncclCommDestroy", g_api.CommDestroy, p);
  bind(h, "ncclCommAbort", g_api.CommAbort, p, /*required=*/false);
  bind(h, "ncclGroupStart", g_api.GroupStart, p);
  bind(h, "ncclGroupEnd", g_api.GroupEnd, p);
  bind(h, "ncclAllGather", g_api.AllGather, p);
  bind(h, "ncclAllReduce", g_api.AllReduce, p);
  bind(h, "ncclGetErrorString", g_api.GetErrorString, p);
  bind(h, "ncclGetLastError", g_api.GetLastError, p, /*required=*/false);
  return g_api;
}

void check_nccl(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  if (r == kNcclSuccess) return;
  const NcclApi& a = g_api;
  std::string detail = a.GetErrorString ? a.GetErrorString(r) : "";
  if (comm && a.GetLastError) {
    const char* last = a.GetLastError(comm);
    if (last && *last) detail += std::string("; ") + last;
  }
  EXL2_FAIL(Cuda, "NCCL ", what, " failed with error ", r, " (", detail,
            "); set NCCL_DEBUG=WARN for NCCL's own report");
}

int nccl_dtype(DType t) {
  switch (t) {
    case DType::F16:
      return kNcclFloat16;
    case DType::BF16:
      return kNcclBfloat16;
    case DType::F32:
      return kNcclFloat32;
    case DType::I32:
      return kNcclInt32;
    default:
      EXL2_FAIL(InvalidArgument, "NCCL collective: dtype ", dtype_name(t), " is not supported (f16, bf16, f32, i32)");
  }
}

}  // namespace

void set_nccl_library(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_preferred = path;
}

std::string nccl_describe() {
  const NcclApi& a = api();
  int v = 0;
  check_nccl(a.GetVersion(&v), "ncclGetVersion");
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100) + " (" +
         a.path + ")";
}

NcclGroup::NcclGroup(const std::vector<int>& devices) : devices_(devices) {
  EXL2_CHECK(!devices.empty(), "NCCL: no devices given");
  const NcclApi& a = api();
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NVLink multicast off unless the user decided otherwise
  comms_.assign(devices.size(), nullptr);
  check_nccl(a.CommInitAll(comms_.data(), static_cast<int>(devices.size()), devices.data()), "ncclCommInitAll");
}

NcclGroup::~NcclGroup() {
  if (!g_api.handle) return;
  std::unique_lock<std::shared_timed_mutex> lock(calls_);
  for (size_t r = 0; r < comms_.size(); ++r) {
    if (!comms_[r]) continue;
    DeviceGuard guard(devices_[r]);
    cudaStreamSynchronize(current_stream(devices_[r]));
    g_api.CommDestroy(comms_[r]);  // a destructor never throws
  }
}

void NcclGroup::all_gather(const std::vector<const void*>& send, const std::vector<void*>& recv, size_t count,
                           DType dtype) {
  EXL2_CHECK_KIND(Internal, send.size() == devices_.size() && recv.size() == devices_.size(),
                  "NCCL all_gather: one buffer per rank expected");
  if (count == 0) return;
  const NcclApi& a = g_api;
  const int dt = nccl_dtype(dtype);
  std::shared_lock<std::shared_timed_mutex> lock(calls_);
  check_not_aborted();
  check_nccl(a.GroupStart(), "ncclGroupStart");
  for (size_t r = 0; r < devices_.size(); ++r) {
    const ncclResult_t res = a.AllGather(send[r], recv[r], count, dt, comms_[r], current_stream(devices_[r]));
    if (res != kNcclSuccess) {
      a.GroupEnd();
      check_nccl(res, "ncclAllGather", comms_[r]);
    }
  }
  check_nccl(a.GroupEnd(), "ncclGroupEnd (all-gather)", comms_[0]);
}

void NcclGroup::all_gather_rank(int rank, const void* send, void* recv, size_t count, DType dtype) {
  EXL2_CHECK_KIND(Internal, rank >= 0 && rank < size(), "NCCL all_gather_rank: rank ", rank, " of ", size());
  if (count == 0) return;
  const int dt = nccl_dtype(dtype);
  std::shared_lock<std::shared_timed_mutex> lock(calls_);
  check_not_aborted();
  check_nccl(g_api.AllGather(send, recv, count, dt, comms_[rank], current_stream(devices_[rank])), "ncclAllGather",
             comms_[rank]);
}

void NcclGroup::all_reduce_sum(const std::vector<const void*>& send, const std::vector<void*>& recv, size_t count,
                               DType dtype) {
  EXL2_CHECK_KIND(Internal, send.size() == devices_.size() && recv.size() == devices_.size(),
                  "NCCL all_reduce: one buffer per rank expected");
  if (count == 0) return;
  const NcclApi& a = g_api;
  const int dt = nccl_dtype(dtype);
  std::shared_lock<std::shared_timed_mutex> lock(calls_);
  check_not_aborted();
  check_nccl(a.GroupStart(), "ncclGroupStart");
  for (size_t r = 0; r < devices_.size(); ++r) {
    const ncclResult_t res = a.AllReduce(send[r], recv[r], count, dt, kNcclSum, comms_[r], current_stream(devices_[r]));
    if (res != kNcclSuccess) {
      a.GroupEnd();
      check_nccl(res, "ncclAllReduce", comms_[r]);
    }
  }
  check_nccl(a.GroupEnd(), "ncclGroupEnd (all-reduce)", comms_[0]);
}

void NcclGroup::check_not_aborted() const {
  EXL2_CHECK_KIND(Internal, !aborted_.load(),
                  "tensor parallel: another rank failed during this step (its NCCL communicators were aborted; the "
                  "next step makes new ones)");
}

void NcclGroup::abort() noexcept {
  if (aborted_.exchange(true) || !g_api.handle) return;
  // Calls already inside NCCL on other threads return first (enqueueing is asynchronous); should one not return,
  // abort anyway: ncclCommAbort is what unblocks a hung communicator.
  std::unique_lock<std::shared_timed_mutex> lock(calls_, std::defer_lock);
  const bool locked = lock.try_lock_for(std::chrono::seconds(5));
  (void)locked;
  int prev = -1;
  cudaGetDevice(&prev);
  for (size_t r = 0; r < comms_.size(); ++r) {
    if (!comms_[r]) continue;
    cudaSetDevice(devices_[r]);
    if (g_api.CommAbort) g_api.CommAbort(comms_[r]);  // the device's pending NCCL kernels exit; frees the comm
    comms_[r] = nullptr;
  }
  cudaGetLastError();
  if (prev >= 0) cudaSetDevice(prev);
}

void NcclGroup::reinit() {
  if (!aborted_.load()) return;
  EXL2_CHECK_KIND(Unsupported, g_api.CommAbort != nullptr, "tensor parallel: a rank failed and NCCL ", g_api.path,
                  " has no ncclCommAbort to recover; reload the model (or install NCCL >= 2.4)");
  std::unique_lock<std::shared_timed_mutex> lock(calls_);
  for (int d : devices_) {  // the aborted kernels and everything queued behind them
    DeviceGuard guard(d);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) fail_cuda(err, __FILE__, __LINE__, "cudaDeviceSynchronize after an NCCL abort");
  }
  comms_.assign(devices_.size(), nullptr);
  check_nccl(g_api.CommInitAll(comms_.data(), static_cast<int>(devices_.size()), devices_.data()),
             "ncclCommInitAll (after an abort)");
  aborted_.store(false);
}

}  // namespace exl2::cuda
