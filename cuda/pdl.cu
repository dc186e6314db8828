// The PDL switch of cuda/pdl.h: env EXL2CPP_PDL (read once), the test override, and the per-device support probe.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda/pdl.cuh"
#include "cuda/stream.h"

namespace exl2::cuda {

namespace {

constexpr int kMaxDevices = 64;  // as cuda/stream.cu

// The probe: its PTX virtual arch is the one every kernel of this build got for the device (one arch list).
__global__ void pdl_probe_kernel() {}

std::atomic<int> g_override{-1};
std::atomic<int> g_support[kMaxDevices];  // 0: not probed yet, 1: no PDL, 2: PDL

// EXL2CPP_PDL: 1 (on) when unset or empty. A bad value throws on every call (the static is not initialized then).
int env_mode() {
  static const int mode = [] {
    const char* v = std::getenv("EXL2CPP_PDL");
    if (!v || !*v || std::strcmp(v, "1") == 0) return 1;
    if (std::strcmp(v, "0") == 0) return 0;
    EXL2_FAIL(InvalidArgument, "environment variable EXL2CPP_PDL must be 0 (no programmatic dependent launch) or 1 ",
              "(the default: on for sm_90 and newer), got '", v, "'; unset it or use 0 or 1");
  }();
  return mode;
}

// Caller has made `device` current.
bool device_supports(int device) {
  if (device < 0 || device >= kMaxDevices) return false;
  int s = g_support[device].load(std::memory_order_relaxed);
  if (s == 0) {
    int major = 0;
    EXL2_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    bool ok = major >= 9;
    if (ok) {
      cudaFuncAttributes a{};
      if (cudaFuncGetAttributes(&a, pdl_probe_kernel) == cudaSuccess) {
        ok = a.ptxVersion >= 90;
      } else {
        cudaGetLastError();  // no image for this device: kernels cannot run anyway, PDL is off
        ok = false;
      }
    }
    s = ok ? 2 : 1;
    g_support[device].store(s, std::memory_order_relaxed);
  }
  return s == 2;
}

}  // namespace

bool pdl_enabled() {
  const int env = env_mode();
  const int o = g_override.load(std::memory_order_relaxed);
  if ((o >= 0 ? o : env) == 0) return false;
  int device = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&device));
  return device_supports(device);
}

bool pdl_enabled(int device) {
  env_mode();  // a bad value throws even where there is no GPU
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no GPU: nothing launches, nothing is a dependent
    return false;
  }
  if (device < 0 || device >= count) return false;
  DeviceGuard guard(device);
  return pdl_enabled();
}

void set_pdl_override(int mode) {
  EXL2_CHECK(mode >= -1 && mode <= 1, "set_pdl_override: -1 (env EXL2CPP_PDL), 0 (off) or 1 (on) expected, got ",
             mode);
  g_override.store(mode, std::memory_order_relaxed);
}

}  // namespace exl2::cuda
