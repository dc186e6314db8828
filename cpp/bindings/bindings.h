// Binding entry points, one per area, each in its own file of cpp/bindings/. Tensors cross as NumPy arrays
// (copied) through to_numpy/from_numpy; bf16 crosses as uint16.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "exl2/tensor.h"

namespace exl2 {

void bind_core(pybind11::module_& m);   // bind_core.cpp: Tensor I/O, safetensors, json, config, device query
void bind_ops(pybind11::module_& m);    // bind_ops.cpp: every op, for tests/test_backend_ops.py
void bind_model(pybind11::module_& m);  // bind_model.cpp: Model, KVCache, Batch, sampler
void bind_quant(pybind11::module_& m);  // bind_quant.cpp: EXL2 pack/unpack/dequant
void bind_engine(pybind11::module_& m); // bind_engine.cpp: sampler (and later the engine)
void bind_cuda(pybind11::module_& m);   // bind_cuda.cpp: _C.cuda_bench timing helpers (CUDA builds only)
void bind_engine_jobs(pybind11::module_& m);  // bind_engine_jobs.cpp: the batching Engine (after bind_engine)
void bind_moe(pybind11::module_& m);    // bind_moe.cpp: the MoE ops and MoeExperts (called by bind_ops)
void bind_calibration(pybind11::module_& m);  // bind_calibration.cpp: the converter's calibration forward
void bind_options(pybind11::module_& m);  // bind_options.cpp: runtime options, the EXL2 matmul planner

// NumPy <-> Tensor (CPU copies). f16 <-> numpy.float16, bf16 <-> numpy.uint16 (raw bits) unless dtype given.
pybind11::array to_numpy(const Tensor& t);
Tensor from_numpy(const pybind11::array& a, const std::string& dtype = "");

}  // namespace exl2
