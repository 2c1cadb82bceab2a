// StageCopier for the CPU: "device" memory is host memory, so a stage is one memcpy per segment.
// An optional throttle paces each layer's copy to a bandwidth, which lets benchmarks model a
// transfer of a chosen duration without burning a core on it (like a DMA engine would not).
#pragma once

#include "transfer/layer_pipeline.h"

namespace banaserve::transfer {

class CpuCopier final : public StageCopier {
 public:
  // bytes_per_second <= 0: copy at memcpy speed.
  explicit CpuCopier(double bytes_per_second = 0.0) : bytes_per_second_(bytes_per_second) {}
  void fetch(int layer, int slot, const LayerSegments& copy) override;
  void store(int layer, int slot, const LayerSegments& copy) override;

 private:
  void copy(const LayerSegments& segments) const;
  double bytes_per_second_;
};

}  // namespace banaserve::transfer
