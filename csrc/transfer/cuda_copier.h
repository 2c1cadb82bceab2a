// StageCopier for CUDA: host buffers are staged through a bounded ring of pinned buffers, and
// the fetch, compute and store streams are ordered by events. Defined in cuda_copier.cu, built
// only with BANASERVE_WITH_CUDA; this header needs no CUDA headers so that bindings can use it.
#pragma once

#include <cstdint>
#include <memory>

#include "transfer/layer_pipeline.h"

namespace banaserve::transfer {

// `compute_stream` is the caller's cudaStream_t as an integer (0: the legacy default stream).
// Allocates depth x max-layer-bytes of pinned memory. Throws std::runtime_error without a device.
std::unique_ptr<StageCopier> make_cuda_copier(const PipelineSpec& spec, int device,
                                              std::uintptr_t compute_stream);

}  // namespace banaserve::transfer
