// Exact merge of two partial attention results computed over disjoint key ranges A and B.
//
// For each (token, head) row, with lse = log-sum-exp of the scores of a range (natural log):
//   lse = log(exp(lse_a) + exp(lse_b))
//   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
// Layouts are C-contiguous: out_* is [tokens, heads, head_dim], lse_* is [tokens, heads].
// An empty range has lse = -inf: its out is never read (kernels often leave 0/0 there), and when
// both ranges are empty the merge is out = 0, lse = -inf.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/float16.h"

#if defined(__CUDACC__)
#define BANASERVE_HOST_DEVICE __host__ __device__
#else
#define BANASERVE_HOST_DEVICE
#endif

namespace banaserve::attention {

struct MergeShape {
  std::int64_t tokens;
  std::int64_t heads;
  std::int64_t head_dim;
};

// Weights of one row. A side whose scale is 0 must be skipped, not multiplied, so that garbage
// in an empty range's output cannot turn into NaN.
template <typename Acc>
struct MergeWeights {
  Acc scale_a;
  Acc scale_b;
  Acc lse;
};

BANASERVE_HOST_DEVICE inline float exp_acc(float x) { return expf(x); }
BANASERVE_HOST_DEVICE inline double exp_acc(double x) { return exp(x); }
BANASERVE_HOST_DEVICE inline float log_acc(float x) { return logf(x); }
BANASERVE_HOST_DEVICE inline double log_acc(double x) { return log(x); }

// Shared by the CPU and CUDA paths so that both implement one formula. Subtracting the max keeps
// exp() in range for any finite lse; a NaN lse propagates (the comparison picks the NaN side).
template <typename Acc>
BANASERVE_HOST_DEVICE inline MergeWeights<Acc> merge_weights(Acc lse_a, Acc lse_b) {
  const Acc max_lse = lse_a > lse_b ? lse_a : lse_b;
  if (max_lse == -INFINITY) {
    return {Acc(0), Acc(0), Acc(-INFINITY)};
  }
  const Acc w_a = exp_acc(lse_a - max_lse);
  const Acc w_b = exp_acc(lse_b - max_lse);
  const Acc sum = w_a + w_b;
  return {w_a / sum, w_b / sum, max_lse + log_acc(sum)};
}

// CPU. T is Half, float or double; L (the lse type) is float or double. Accumulates in float, or
// in double when T or L is double. Writes out and lse, which the caller allocates; no aliasing.
template <typename T, typename L>
void merge_attn_states_cpu(const T* out_a, const L* lse_a, const T* out_b, const L* lse_b, T* out,
                           L* lse, MergeShape shape);

// CUDA: element types of out_a/out_b/out; lse is always float32 on the device.
enum class ScalarType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Device pointers as integers (torch's data_ptr()), so no CUDA or torch type crosses the
// Python boundary. Every buffer lives on `device`; the caller allocates out and lse.
struct CudaMergeArgs {
  std::uintptr_t out;
  std::uintptr_t lse;
  std::uintptr_t out_a;
  std::uintptr_t lse_a;
  std::uintptr_t out_b;
  std::uintptr_t lse_b;
  MergeShape shape;
  ScalarType dtype;
  int device;
  std::uintptr_t stream;  // cudaStream_t; 0 is the legacy default stream
};

// Enqueues the merge on args.stream and returns without synchronizing: errors of the launch
// itself throw std::runtime_error here, faults during execution surface at the next sync.
// Throws std::runtime_error if no CUDA device can be used.
void merge_attn_states_cuda(const CudaMergeArgs& args);

}  // namespace banaserve::attention
