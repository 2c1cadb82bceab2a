// The layer-wise three-stage pipeline (DESIGN.md mechanism 3): while the caller computes layer
// i, a fetch thread brings layer i+1 (and further, up to the ring depth) to the device and a
// store thread writes layer i-1 back to the host. The engine here owns the ordering, the bounded
// ring and the threads; a StageCopier (cpu_copier.h, cuda_copier.h) does the bytes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace banaserve::transfer {

// One copy of one layer. Addresses are raw because they come from numpy, torch or a KV pool;
// the caller owns the memory and keeps it alive until the pipeline is closed. bytes == 0 means
// "nothing to copy for this layer in this direction".
struct LayerCopy {
  std::uintptr_t src = 0;
  std::uintptr_t dst = 0;
  std::size_t bytes = 0;
};

// One layer's copy in one direction as a list of segments, because device KV pages are scattered
// (one segment per page run). Empty, or all segments of 0 bytes: nothing to copy for this layer.
using LayerSegments = std::vector<LayerCopy>;

// Sum of the segment sizes of one layer (the staging bytes it needs on CUDA).
std::size_t total_bytes(const LayerSegments& segments);

enum class Stage : int { kFetch = 0, kCompute = 1, kStore = 2 };

struct PipelineSpec {
  int num_layers = 0;
  // Host -> device, one segment list per layer (or empty: nothing is fetched).
  std::vector<LayerSegments> fetch;
  // Device -> host, one segment list per layer (or empty: nothing is stored).
  std::vector<LayerSegments> store;
  // Ring depth: at most `depth` layers are in flight (fetch started, store not finished). This
  // bounds staging memory and lets a caller use `depth` device buffers in rotation (layer j in
  // buffer j % depth). 3 gives full overlap: one fetching, one computing, one storing.
  int depth = 3;
  // Gated fetch: layer j's fetch also waits for source_ready(j), because its host bytes are
  // still arriving (e.g. a reader thread pulling them from the KV store) when the pipeline starts.
  bool gated = false;
  // Test hook: make this stage fail at this layer (-1: never), so that error paths can be
  // exercised without a broken device.
  int fault_stage = -1;
  int fault_layer = -1;
};

// Moves the bytes of a stage. Called from the fetch thread (fetch), the store thread (store) or
// the caller's thread (before/after_compute); the engine guarantees that ring slot `slot` belongs
// to `layer` alone from the start of its fetch to the end of its store.
class StageCopier {
 public:
  virtual ~StageCopier() = default;
  // Runs first on each worker thread (CUDA: make the device current there).
  virtual void on_thread_start() {}
  // Returns once the layer's data is usable by compute ordered after before_compute().
  virtual void fetch(int layer, int slot, const LayerSegments& copy) = 0;
  // The caller is about to compute `layer` (CUDA: its compute stream waits for the fetch).
  virtual void before_compute(int /*layer*/, int /*slot*/) {}
  // The caller has issued the compute of `layer` (CUDA: an event marks it on the stream).
  virtual void after_compute(int /*layer*/, int /*slot*/) {}
  // Returns once the layer's bytes are in the host destination.
  virtual void store(int layer, int slot, const LayerSegments& copy) = 0;
};

class LayerPipeline {
 public:
  // Starts the fetch and store threads. Throws std::invalid_argument on a malformed spec.
  LayerPipeline(PipelineSpec spec, std::unique_ptr<StageCopier> copier);
  // Stops without draining and joins; never throws (an unreported error is lost: call close()).
  ~LayerPipeline();
  LayerPipeline(const LayerPipeline&) = delete;
  LayerPipeline& operator=(const LayerPipeline&) = delete;

  // Blocks until layer `layer` is fetched. Layers go in order: layer must be the next one and
  // the previous one must have been marked computed. Rethrows a stage error.
  void wait_fetched(int layer);
  // Marks `layer` computed (after wait_fetched(layer)); its store may start. Rethrows a stage
  // error.
  void computed(int layer);
  // Waits for the stores of every computed layer, stops the threads and joins them. Idempotent.
  // Rethrows a stage error that no earlier call has reported, so errors are never silent.
  void close();
  // Stops without waiting for pending stores and joins. Idempotent; never throws.
  void abort() noexcept;

  // Gated pipelines only (std::invalid_argument otherwise). Any thread may call these, typically
  // a reader thread while the caller blocks in wait_fetched().
  //
  // The host source bytes of `layer` have arrived: its fetch may start (once the ring allows).
  // Layers must be announced in order 0, 1, ... (std::invalid_argument otherwise). Returns false
  // and does nothing once the pipeline is closed, aborted or failed, so a reader racing with
  // shutdown needs no error handling; true otherwise.
  bool source_ready(int layer);
  // The host source bytes of `layer` will never arrive: the pipeline fails as if that layer's
  // fetch had failed ("source of layer L failed: <message>", reported at the next wait_fetched/
  // computed or at close()), and every blocked call wakes up. Returns false and does nothing once
  // the pipeline is closed, aborted or failed (the first error stays the reported one).
  bool source_failed(int layer, const std::string& message);
  bool gated() const { return spec_.gated; }

  int num_layers() const { return spec_.num_layers; }
  int depth() const { return spec_.depth; }
  // Per layer, per stage (fetch, compute, store): start and end in steady_clock nanoseconds,
  // -1 where not reached. Layout [layer][stage][start/end]. For compute these are the host
  // times of wait_fetched() returning and computed() being called.
  std::vector<std::int64_t> timestamps() const;
  // Most layers ever in flight at once (fetch started, store not finished); <= depth.
  int max_in_flight() const;
  // Worker threads of every pipeline in the process that have not exited yet (leak checks).
  static int live_threads();

 private:
  void run_worker(Stage stage);
  void fetch_loop();
  void store_loop();
  void fail(std::exception_ptr error);
  void throw_if_failed_locked();
  void stop_and_join(bool drain) noexcept;
  void stamp(int layer, Stage stage, int edge);
  void maybe_inject(Stage stage, int layer) const;

  PipelineSpec spec_;
  std::unique_ptr<StageCopier> copier_;
  // [layer][stage][edge]; each entry written by one thread, read by any: hence atomics.
  std::unique_ptr<std::atomic<std::int64_t>[]> stamps_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int fetched_ = 0;        // layers whose fetch finished (fetches finish in order)
  int compute_begun_ = 0;  // layers for which wait_fetched() returned
  int computed_ = 0;       // layers marked computed
  int stored_ = 0;         // layers whose store finished
  int sources_ready_ = 0;  // gated: layers announced by source_ready() (in order)
  int max_in_flight_ = 0;
  bool stop_ = false;
  bool closed_ = false;
  std::exception_ptr error_;
  bool error_reported_ = false;

  std::thread fetch_thread_;
  std::thread store_thread_;
};

}  // namespace banaserve::transfer
