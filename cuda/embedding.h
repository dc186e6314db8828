// CUDA embedding extras: the out-of-range id flag of cuda::embedding (ids are clamped on the device, never
// checked on the host, so a step can run without a host sync).
#pragma once

namespace exl2::cuda {

// True when an embedding launched on the current device since the last call saw an id outside [0, vocab)
// (that row was filled from the clamped id). Synchronizes the current stream; resets the flag.
bool embedding_take_oob_flag();

}  // namespace exl2::cuda
