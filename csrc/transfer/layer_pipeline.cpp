#include "transfer/layer_pipeline.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

namespace banaserve::transfer {
namespace {

std::atomic<int> g_live_threads{0};

const char* stage_name(Stage s) {
  switch (s) {
    case Stage::kFetch:
      return "fetch";
    case Stage::kCompute:
      return "compute";
    case Stage::kStore:
      return "store";
  }
  return "?";
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Counts a worker as live from its first instruction to its last, so a test can see a thread
// that was never joined (the count stays up) without reaching into std::thread.
class LiveThread {
 public:
  LiveThread() { g_live_threads.fetch_add(1); }
  ~LiveThread() { g_live_threads.fetch_sub(1); }
  LiveThread(const LiveThread&) = delete;
  LiveThread& operator=(const LiveThread&) = delete;
};

void check_copies(std::vector<LayerSegments>& copies, int num_layers, const char* name) {
  if (copies.empty()) {
    copies.resize(static_cast<std::size_t>(num_layers));  // no segments: nothing to copy
    return;
  }
  if (copies.size() != static_cast<std::size_t>(num_layers)) {
    throw std::invalid_argument(std::string(name) + ": " + std::to_string(copies.size()) +
                                " copies for " + std::to_string(num_layers) + " layers");
  }
  for (std::size_t i = 0; i < copies.size(); ++i) {
    for (std::size_t k = 0; k < copies[i].size(); ++k) {
      const LayerCopy& c = copies[i][k];
      if (c.bytes != 0 && (c.src == 0 || c.dst == 0)) {
        throw std::invalid_argument(std::string(name) + " of layer " + std::to_string(i) +
                                    ", segment " + std::to_string(k) + ": null address");
      }
    }
  }
}

}  // namespace

std::size_t total_bytes(const LayerSegments& segments) {
  std::size_t n = 0;
  for (const LayerCopy& c : segments) n += c.bytes;
  return n;
}

LayerPipeline::LayerPipeline(PipelineSpec spec, std::unique_ptr<StageCopier> copier)
    : spec_(std::move(spec)), copier_(std::move(copier)) {
  if (spec_.num_layers < 1) throw std::invalid_argument("num_layers must be >= 1");
  if (spec_.depth < 1) throw std::invalid_argument("depth must be >= 1");
  if (!copier_) throw std::invalid_argument("no copier");
  check_copies(spec_.fetch, spec_.num_layers, "fetch");
  check_copies(spec_.store, spec_.num_layers, "store");
  const std::size_t n = static_cast<std::size_t>(spec_.num_layers) * 6;
  stamps_ = std::make_unique<std::atomic<std::int64_t>[]>(n);
  for (std::size_t i = 0; i < n; ++i) stamps_[i].store(-1, std::memory_order_relaxed);

  fetch_thread_ = std::thread([this] { run_worker(Stage::kFetch); });
  try {
    store_thread_ = std::thread([this] { run_worker(Stage::kStore); });
  } catch (...) {
    abort();  // joins the fetch thread before the members it uses go away
    throw;
  }
}

LayerPipeline::~LayerPipeline() { abort(); }

void LayerPipeline::stamp(int layer, Stage stage, int edge) {
  const std::size_t idx = static_cast<std::size_t>(layer) * 6 +
                          static_cast<std::size_t>(stage) * 2 + static_cast<std::size_t>(edge);
  stamps_[idx].store(now_ns(), std::memory_order_relaxed);
}

void LayerPipeline::maybe_inject(Stage stage, int layer) const {
  if (spec_.fault_stage == static_cast<int>(stage) && spec_.fault_layer == layer) {
    throw std::runtime_error(std::string("injected fault in ") + stage_name(stage));
  }
}

void LayerPipeline::run_worker(Stage stage) {
  LiveThread live;
  try {
    copier_->on_thread_start();
    if (stage == Stage::kFetch) {
      fetch_loop();
    } else {
      store_loop();
    }
  } catch (...) {
    fail(std::current_exception());
  }
}

void LayerPipeline::fetch_loop() {
  for (int j = 0; j < spec_.num_layers; ++j) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // The ring: layer j may start only when layer j - depth has been stored, so slot
      // j % depth (and any caller buffer rotated the same way) is free again. Gated: the host
      // source must also be complete, or the copy would read bytes still being written.
      cv_.wait(lock, [&] {
        return stop_ || (j < stored_ + spec_.depth && (!spec_.gated || j < sources_ready_));
      });
      if (stop_) return;
      max_in_flight_ = std::max(max_in_flight_, j + 1 - stored_);
    }
    stamp(j, Stage::kFetch, 0);
    try {
      maybe_inject(Stage::kFetch, j);
      copier_->fetch(j, j % spec_.depth, spec_.fetch[static_cast<std::size_t>(j)]);
    } catch (const std::exception& e) {
      throw std::runtime_error("fetch of layer " + std::to_string(j) + " failed: " + e.what());
    }
    stamp(j, Stage::kFetch, 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fetched_ = j + 1;
    }
    cv_.notify_all();
  }
}

void LayerPipeline::store_loop() {
  for (int j = 0; j < spec_.num_layers; ++j) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || j < computed_; });
      if (stop_) return;
    }
    stamp(j, Stage::kStore, 0);
    try {
      maybe_inject(Stage::kStore, j);
      copier_->store(j, j % spec_.depth, spec_.store[static_cast<std::size_t>(j)]);
    } catch (const std::exception& e) {
      throw std::runtime_error("store of layer " + std::to_string(j) + " failed: " + e.what());
    }
    stamp(j, Stage::kStore, 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stored_ = j + 1;
    }
    cv_.notify_all();
  }
}

void LayerPipeline::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::move(error);  // the first error is the cause; later ones follow
    stop_ = true;
  }
  cv_.notify_all();
}

void LayerPipeline::throw_if_failed_locked() {
  if (error_) {
    error_reported_ = true;
    std::rethrow_exception(error_);
  }
}

void LayerPipeline::wait_fetched(int layer) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    throw_if_failed_locked();
    if (closed_) throw std::invalid_argument("pipeline is closed");
    if (layer != computed_ || compute_begun_ != computed_) {
      throw std::invalid_argument("wait_fetched(" + std::to_string(layer) +
                                  "): expected layer " + std::to_string(computed_) +
                                  (compute_begun_ != computed_ ? " to be marked computed first"
                                                               : ""));
    }
    if (layer >= spec_.num_layers) {
      throw std::invalid_argument("layer " + std::to_string(layer) + " out of range");
    }
    cv_.wait(lock, [&] { return error_ || stop_ || layer < fetched_; });
    throw_if_failed_locked();
    if (stop_) throw std::invalid_argument("pipeline was stopped");
    compute_begun_ = layer + 1;
  }
  copier_->before_compute(layer, layer % spec_.depth);
  stamp(layer, Stage::kCompute, 0);
}

void LayerPipeline::computed(int layer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if_failed_locked();
    if (closed_) throw std::invalid_argument("pipeline is closed");
    if (layer != computed_ || compute_begun_ != layer + 1) {
      throw std::invalid_argument("computed(" + std::to_string(layer) +
                                  "): call wait_fetched(" + std::to_string(layer) +
                                  ") first, layers in order");
    }
  }
  stamp(layer, Stage::kCompute, 1);
  // Outside the lock: on CUDA this records an event, which the store thread must see before it
  // learns the layer is computed.
  copier_->after_compute(layer, layer % spec_.depth);
  {
    std::lock_guard<std::mutex> lock(mu_);
    computed_ = layer + 1;
  }
  cv_.notify_all();
}

bool LayerPipeline::source_ready(int layer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spec_.gated) throw std::invalid_argument("source_ready: the pipeline is not gated");
    // Checked before the order: after shutdown the reader's progress no longer matters, and it
    // must be able to finish its loop without handling errors.
    if (closed_ || stop_) return false;
    if (layer != sources_ready_) {
      throw std::invalid_argument("source_ready(" + std::to_string(layer) +
                                  "): expected layer " + std::to_string(sources_ready_) +
                                  " (layers are announced in order)");
    }
    if (layer >= spec_.num_layers) {
      throw std::invalid_argument("source_ready: layer " + std::to_string(layer) +
                                  " out of range");
    }
    sources_ready_ = layer + 1;
  }
  cv_.notify_all();
  return true;
}

bool LayerPipeline::source_failed(int layer, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spec_.gated) throw std::invalid_argument("source_failed: the pipeline is not gated");
    if (closed_ || stop_) return false;
    if (layer < 0 || layer >= spec_.num_layers) {
      throw std::invalid_argument("source_failed: layer " + std::to_string(layer) +
                                  " out of range");
    }
    // What fail() does, but under the same lock as the check above: a close() slipping in
    // between would otherwise miss the error (its unreported-error check already ran) while
    // this call claimed to have failed the pipeline. Reported like a worker's fetch error.
    error_ = std::make_exception_ptr(
        std::runtime_error("source of layer " + std::to_string(layer) + " failed: " + message));
    stop_ = true;
  }
  cv_.notify_all();
  return true;
}

void LayerPipeline::stop_and_join(bool drain) noexcept {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (drain) cv_.wait(lock, [&] { return stop_ || stored_ >= computed_; });
    stop_ = true;
    closed_ = true;
  }
  cv_.notify_all();
  if (fetch_thread_.joinable()) fetch_thread_.join();
  if (store_thread_.joinable()) store_thread_.join();
}

void LayerPipeline::close() {
  stop_and_join(/*drain=*/true);
  std::lock_guard<std::mutex> lock(mu_);
  if (error_ && !error_reported_) throw_if_failed_locked();
}

void LayerPipeline::abort() noexcept { stop_and_join(/*drain=*/false); }

std::vector<std::int64_t> LayerPipeline::timestamps() const {
  const std::size_t n = static_cast<std::size_t>(spec_.num_layers) * 6;
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = stamps_[i].load(std::memory_order_relaxed);
  return out;
}

int LayerPipeline::max_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return max_in_flight_;
}

int LayerPipeline::live_threads() { return g_live_threads.load(); }

}  // namespace banaserve::transfer
