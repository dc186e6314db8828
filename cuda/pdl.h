// Host-side switch of programmatic dependent launch (PDL, sm_90 and newer): whether the kernels of a model step are
// launched as programmatic dependents of the kernel before them. No CUDA headers, so bindings can include it; the
// device helpers, the launch helper and the correctness contract are in cuda/pdl.cuh.
#pragma once

namespace exl2::cuda {

// Whether kernels launched through cuda/pdl.cuh on the current device (or on `device`) get the
// programmatic-stream-serialization attribute now: the device has compute capability >= 9.0, this build's device
// code for it was compiled for compute_90 or newer (a PTX JIT from an older virtual arch would lack the
// griddepcontrol.wait the contract needs), and the switch is on: set_pdl_override() when set, else option pdl
// (exl2/options.h, read at every call). Device support is probed once per device. pdl_enabled(device) is false
// for a device that is not visible (no GPU: no exception).
bool pdl_enabled();
bool pdl_enabled(int device);

// Tests: -1 (default) lets option pdl decide, 0 turns PDL off, 1 on (where the device supports it). Takes effect
// for later launches; CUDA graphs already captured keep the edges they were captured with.
void set_pdl_override(int mode);

}  // namespace exl2::cuda
