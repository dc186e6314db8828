// Host-visible helpers for models whose layers span several GPUs (layer split): switching the current device,
// peer access between GPUs, and the stream-ordered GPU-to-GPU copy that moves hidden states from one layer's
// device to the next without a host sync. Host-only types, so cpp/model/ includes it without CUDA headers.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace exl2::cuda {

// RAII: make `device` the current CUDA device (kernels launch on its current stream), restore the previous one.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int prev_ = -1;
};

// Enables peer access in both directions for every pair of `devices` where cudaDeviceCanAccessPeer says yes
// (idempotent; "already enabled" is not an error). Pairs without peer access still work: cudaMemcpyPeerAsync
// then stages through host memory in the driver (slower, same results).
void enable_peer_access(const std::vector<int>& devices);
// Whether `device` can read/write `peer`'s memory directly (cudaDeviceCanAccessPeer; false for device == peer).
bool can_access_peer(int device, int peer);

// Copies `bytes` from `src` on GPU `src_device` to `dst` on GPU `dst_device`, ordered on the streams: the current
// stream of dst_device first waits (cudaStreamWaitEvent) for everything queued so far on the current stream of
// src_device, then runs cudaMemcpyPeerAsync. The host does not wait. Work queued later on src_device's stream
// must not overwrite `src` before dst_device's stream is known to be past the copy (the model's steps satisfy
// this: every step ends with a sync of the last device, which waited for all earlier ones).
// Not capturable into a CUDA graph (split models run eagerly).
void copy_peer_async(void* dst, int dst_device, const void* src, int src_device, size_t bytes);

}  // namespace exl2::cuda
