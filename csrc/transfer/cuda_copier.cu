#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/cuda_utils.cuh"
#include "transfer/cuda_copier.h"

namespace banaserve::transfer {
namespace {

// RAII owners. Destructors ignore errors: they run during teardown (possibly after an error),
// when there is nobody left to report to.
struct PinnedFree {
  void operator()(void* p) const noexcept { cudaFreeHost(p); }
};
using PinnedPtr = std::unique_ptr<void, PinnedFree>;

class Stream {
 public:
  Stream() { BANASERVE_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    cudaStreamSynchronize(s_);  // nothing may still be copying into memory we are about to free
    cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() { BANASERVE_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(e_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Whether CUDA knows `p` as page-locked host memory (cudaHostAlloc'd or registered, as torch's
// pin_memory() is): the DMA engine reads and writes it directly, at full link bandwidth.
bool is_pinned_host(std::uintptr_t p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(p)) != cudaSuccess) {
    cudaGetLastError();  // pageable memory may report an error on old drivers: clear it
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

class CudaCopier final : public StageCopier {
 public:
  CudaCopier(const PipelineSpec& spec, int device, std::uintptr_t compute_stream)
      : device_(device), compute_stream_(reinterpret_cast<cudaStream_t>(compute_stream)) {
    DeviceGuard guard(device_);
    // A slot holds a whole layer (all its segments back to back), so a scattered layer still
    // needs only depth x max-layer-bytes of pinned memory.
    for (const auto* copies : {&spec.fetch, &spec.store}) {
      for (const LayerSegments& l : *copies) slot_bytes_ = std::max(slot_bytes_, total_bytes(l));
    }
    // Member order matters for teardown: streams (declared last) are synchronized and destroyed
    // first, then events, then the pinned ring, so no copy can outlive its buffer.
    const std::size_t total = slot_bytes_ * static_cast<std::size_t>(spec.depth);
    if (total > 0) {
      void* p = nullptr;
      BANASERVE_CUDA_CHECK(cudaHostAlloc(&p, total, cudaHostAllocDefault));
      pinned_.reset(p);
    }
    const auto depth = static_cast<std::size_t>(spec.depth);
    fetch_done_ = std::vector<Event>(depth);
    compute_done_ = std::vector<Event>(depth);
    store_done_ = std::vector<Event>(depth);
    fetch_stream_ = std::make_unique<Stream>();
    store_stream_ = std::make_unique<Stream>();
  }

  void on_thread_start() override { BANASERVE_CUDA_CHECK(cudaSetDevice(device_)); }

  void fetch(int /*layer*/, int slot, const LayerSegments& segments) override {
    const cudaEvent_t done = fetch_done_[static_cast<std::size_t>(slot)].get();
    // Pinned sources are copied directly: staging them cost a host memcpy on this one thread,
    // which bounded the pipeline (7.7 GB/s against 55 GB/s pinned on an H200, RESULTS.md).
    // Pageable ones go through the pinned slot (from pageable memory cudaMemcpyAsync degrades
    // to a driver-staged blocking copy), packed back to back. One cudaMemcpyAsync per segment
    // because the device pages are scattered.
    char* staging = slot_ptr(slot);
    std::size_t offset = 0;
    for (const LayerCopy& c : segments) {
      if (c.bytes == 0) continue;
      const void* from = reinterpret_cast<const void*>(c.src);
      if (!is_pinned_host(c.src)) {
        std::memcpy(staging + offset, from, c.bytes);
        from = staging + offset;
        offset += c.bytes;
      }
      BANASERVE_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(c.dst), from, c.bytes,
                                           cudaMemcpyHostToDevice, fetch_stream_->get()));
    }
    BANASERVE_CUDA_CHECK(cudaEventRecord(done, fetch_stream_->get()));
    // The staging slot is held until the copy out of it has completed.
    BANASERVE_CUDA_CHECK(cudaEventSynchronize(done));
  }

  void before_compute(int /*layer*/, int slot) override {
    DeviceGuard guard(device_);
    BANASERVE_CUDA_CHECK(cudaStreamWaitEvent(
        compute_stream_, fetch_done_[static_cast<std::size_t>(slot)].get(), 0));
  }

  void after_compute(int /*layer*/, int slot) override {
    DeviceGuard guard(device_);
    BANASERVE_CUDA_CHECK(
        cudaEventRecord(compute_done_[static_cast<std::size_t>(slot)].get(), compute_stream_));
  }

  void store(int /*layer*/, int slot, const LayerSegments& segments) override {
    const auto s = static_cast<std::size_t>(slot);
    // The device side orders the store after the layer's compute; the host thread only waits
    // for the copies into staging to land, then scatters them to the host destinations.
    BANASERVE_CUDA_CHECK(cudaStreamWaitEvent(store_stream_->get(), compute_done_[s].get(), 0));
    // Pinned destinations are written by the DMA engine directly; the others through staging.
    char* staging = slot_ptr(slot);
    std::vector<bool> staged(segments.size(), false);
    std::size_t offset = 0;
    for (std::size_t i = 0; i < segments.size(); ++i) {
      const LayerCopy& c = segments[i];
      if (c.bytes == 0) continue;
      void* to = reinterpret_cast<void*>(c.dst);
      if (!is_pinned_host(c.dst)) {
        staged[i] = true;
        to = staging + offset;
        offset += c.bytes;
      }
      BANASERVE_CUDA_CHECK(cudaMemcpyAsync(to, reinterpret_cast<const void*>(c.src), c.bytes,
                                           cudaMemcpyDeviceToHost, store_stream_->get()));
    }
    BANASERVE_CUDA_CHECK(cudaEventRecord(store_done_[s].get(), store_stream_->get()));
    BANASERVE_CUDA_CHECK(cudaEventSynchronize(store_done_[s].get()));
    offset = 0;
    for (std::size_t i = 0; i < segments.size(); ++i) {
      if (!staged[i]) continue;
      const LayerCopy& c = segments[i];
      std::memcpy(reinterpret_cast<void*>(c.dst), staging + offset, c.bytes);
      offset += c.bytes;
    }
  }

 private:
  char* slot_ptr(int slot) const {
    return static_cast<char*>(pinned_.get()) + slot_bytes_ * static_cast<std::size_t>(slot);
  }

  int device_;
  cudaStream_t compute_stream_;  // borrowed from the caller
  std::size_t slot_bytes_ = 0;
  PinnedPtr pinned_;
  std::vector<Event> fetch_done_;
  std::vector<Event> compute_done_;
  std::vector<Event> store_done_;
  std::unique_ptr<Stream> fetch_stream_;
  std::unique_ptr<Stream> store_stream_;
};

}  // namespace

std::unique_ptr<StageCopier> make_cuda_copier(const PipelineSpec& spec, int device,
                                              std::uintptr_t compute_stream) {
  return std::make_unique<CudaCopier>(spec, device, compute_stream);
}

}  // namespace banaserve::transfer
