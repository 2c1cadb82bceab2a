#include "transfer/cpu_copier.h"

#include <chrono>
#include <cstring>
#include <thread>

namespace banaserve::transfer {

void CpuCopier::copy(const LayerSegments& segments) const {
  const std::size_t bytes = total_bytes(segments);
  if (bytes == 0) return;
  const auto start = std::chrono::steady_clock::now();
  for (const LayerCopy& c : segments) {
    if (c.bytes == 0) continue;  // a 0-byte segment may carry null addresses (not validated)
    std::memcpy(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src), c.bytes);
  }
  if (bytes_per_second_ > 0) {
    // Sleep, not spin: the copy should take its paced time without taking a core from compute.
    // Paced on the layer's total, so splitting a layer into pages does not change its duration.
    const auto paced = std::chrono::duration<double>(static_cast<double>(bytes) /
                                                     bytes_per_second_);
    std::this_thread::sleep_until(
        start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(paced));
  }
}

void CpuCopier::fetch(int /*layer*/, int /*slot*/, const LayerSegments& c) { copy(c); }

void CpuCopier::store(int /*layer*/, int /*slot*/, const LayerSegments& c) { copy(c); }

}  // namespace banaserve::transfer
