// Bindings for the CUDA backend's own helpers: the submodule _C.cuda_bench (timings for bench/), present only
// in builds with the CUDA backend, and _C.cuda_graph_stats() (all zeros without it).
#include "bindings/bindings.h"

#include "core/device_api.h"

#ifdef EXL2_WITH_CUDA
#include "cuda/bench.h"
#include "cuda/exl2_gemm.h"
#include "cuda/graph_exec.h"
#include "cuda/multi_device.h"
#include "cuda/nccl.h"
#include "cuda/pdl.h"
#endif

namespace py = pybind11;

namespace exl2 {
void bind_cuda(pybind11::module_& m) {
  m.def(
      "cuda_device_name", [](int index) { return device::cuda_device_name(index); }, py::arg("index") = 0,
      "Name of CUDA device `index` (InvalidArgument when it is not visible).");
  m.def(
      "cuda_can_access_peer",
      [](int device, int peer) {
#ifdef EXL2_WITH_CUDA
        return cuda::can_access_peer(device, peer);
#else
        return false;
#endif
      },
      py::arg("device"), py::arg("peer"),
      "Whether GPU `device` can access GPU `peer`'s memory directly (peer copies; else staged through the host).");
  m.def(
      "nccl_set_library",
      [](const std::string& path) {
#ifdef EXL2_WITH_CUDA
        cuda::set_nccl_library(path);
#else
        (void)path;
#endif
      },
      py::arg("path"), "Where to look first for libnccl.so.2 (tensor parallel); before the first NCCL use.");
  m.def(
      "nccl_describe",
      []() -> std::string {
#ifdef EXL2_WITH_CUDA
        py::gil_scoped_release release;
        return cuda::nccl_describe();
#else
        EXL2_FAIL(Unsupported, "NCCL needs a build with the CUDA backend");
#endif
      },
      "Loads NCCL if needed; its version and path, e.g. \"2.32.3 (/.../libnccl.so.2)\" (Unsupported without it).");
  m.def(
      "cuda_graph_stats",
      []() {
        py::dict d;
#ifdef EXL2_WITH_CUDA
        const cuda::GraphStats s = cuda::graph_stats();
        d["captures"] = s.captures;
        d["launches"] = s.launches;
        d["capture_failures"] = s.capture_failures;
        d["device_mallocs"] = cuda::device_malloc_count();
#else
        for (const char* key : {"captures", "launches", "capture_failures", "device_mallocs"}) d[key] = 0;
#endif
        return d;
      },
      "Process-wide CUDA counters: graphs captured, graph launches, failed captures (those steps ran eagerly) and "
      "cudaMalloc calls made by exl2cpp (a warmed-up decode loop adds none).");
  m.def(
      "exl2_gemv_m32_launches",
      []() -> int64_t {
#ifdef EXL2_WITH_CUDA
        return cuda::exl2_gemv_m32_launches();
#else
        return 0;
#endif
      },
      "EXL2 v4 GEMV launches so far of the 32-row kernel (option gemv_m32, 17..32 rows of x in one launch).");
  m.def(
      "cuda_pdl_enabled",
      [](int index) {
#ifdef EXL2_WITH_CUDA
        return cuda::pdl_enabled(index);
#else
        (void)index;
        return false;
#endif
      },
      py::arg("index") = 0,
      "Whether the kernels of a step on CUDA device `index` launch as programmatic dependents (PDL, cuda/pdl.cuh): "
      "sm_90+ and option pdl / cuda_set_pdl allow it.");
  m.def(
      "cuda_set_pdl",
      [](py::object enabled) {
#ifdef EXL2_WITH_CUDA
        cuda::set_pdl_override(enabled.is_none() ? -1 : (enabled.cast<bool>() ? 1 : 0));
#else
        (void)enabled;
#endif
      },
      py::arg("enabled"),
      "Tests: turn programmatic dependent launch on (True, where supported) or off (False) for later launches, or "
      "None to follow option pdl again. CUDA graphs already captured keep their edges: use a fresh model.");
#ifdef EXL2_WITH_CUDA
  auto b = m.def_submodule("cuda_bench", "CUDA timing helpers for bench/ (seconds per call, CUDA events)");
  b.def("copy", &cuda::bench_copy_seconds, py::arg("nbytes"), py::arg("iters") = 20, py::arg("use_kernel") = true,
        py::call_guard<py::gil_scoped_release>(),
        "Seconds per device-to-device copy of nbytes (our 16-byte copy kernel, or cudaMemcpyAsync).");
  b.def("matmul_f16", &cuda::bench_matmul_f16_seconds, py::arg("n"), py::arg("in_features"),
        py::arg("out_features"), py::arg("iters") = 20, py::call_guard<py::gil_scoped_release>(),
        "Seconds per f16 y[n, out] = x[n, in] @ w[out, in]^T through cuda::matmul_nt (cuBLAS).");
  b.def("attention", &cuda::bench_attention_seconds, py::arg("n"), py::arg("ctx"), py::arg("n_heads"),
        py::arg("n_heads_kv"), py::arg("head_dim"), py::arg("iters") = 20, py::call_guard<py::gil_scoped_release>(),
        "Seconds per cuda::attention_paged call: n rows of one sequence ending at position ctx - 1.");
#endif
}
}  // namespace exl2
