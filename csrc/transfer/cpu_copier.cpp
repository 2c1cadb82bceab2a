#include "transfer/cpu_copier.h"

#include <chrono>
#include <cstring>
#include <thread>

namespace banaserve::transfer {

void CpuCopier::copy(const LayerCopy& c) const {
  if (c.bytes == 0) return;
  const auto start = std::chrono::steady_clock::now();
  std::memcpy(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src), c.bytes);
  if (bytes_per_second_ > 0) {
    // Sleep, not spin: the copy should take its paced time without taking a core from compute.
    const auto paced = std::chrono::duration<double>(static_cast<double>(c.bytes) /
                                                     bytes_per_second_);
    std::this_thread::sleep_until(
        start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(paced));
  }
}

void CpuCopier::fetch(int /*layer*/, int /*slot*/, const LayerCopy& c) { copy(c); }

void CpuCopier::store(int /*layer*/, int /*slot*/, const LayerCopy& c) { copy(c); }

}  // namespace banaserve::transfer
