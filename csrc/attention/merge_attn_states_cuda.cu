#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "attention/merge_attn_states.h"
#include "common/cuda_convert.cuh"
#include "common/cuda_utils.cuh"

namespace banaserve::attention {
namespace {

// kPack elements moved as one 16-byte access when the layout allows it.
template <typename T, int kPack>
struct alignas(sizeof(T) * kPack) Pack {
  T v[kPack];
};

// One thread per kPack elements of a row; the lse loads of a row are shared through L1.
template <typename T, int kPack>
__global__ void merge_attn_states_kernel(T* __restrict__ out, float* __restrict__ lse,
                                         const T* __restrict__ out_a,
                                         const float* __restrict__ lse_a,
                                         const T* __restrict__ out_b,
                                         const float* __restrict__ lse_b, std::int64_t rows,
                                         std::int64_t packs_per_row) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * packs_per_row) return;
  const std::int64_t row = i / packs_per_row;
  const MergeWeights<float> w = merge_weights<float>(lse_a[row], lse_b[row]);
  if (i % packs_per_row == 0) lse[row] = w.lse;

  using P = Pack<T, kPack>;
  const P a = reinterpret_cast<const P*>(out_a)[i];
  const P b = reinterpret_cast<const P*>(out_b)[i];
  P o;
#pragma unroll
  for (int k = 0; k < kPack; ++k) {
    float acc = 0.f;
    if (w.scale_a != 0.f) acc += to_float(a.v[k]) * w.scale_a;
    if (w.scale_b != 0.f) acc += to_float(b.v[k]) * w.scale_b;
    o.v[k] = from_float<T>(acc);
  }
  reinterpret_cast<P*>(out)[i] = o;
}

template <typename T, int kPack>
void launch(const CudaMergeArgs& args) {
  const std::int64_t rows = args.shape.tokens * args.shape.heads;
  const std::int64_t packs_per_row = args.shape.head_dim / kPack;
  const std::int64_t threads = rows * packs_per_row;
  constexpr int kBlock = 256;
  const std::int64_t blocks = (threads + kBlock - 1) / kBlock;
  if (blocks > std::numeric_limits<int>::max()) {
    throw std::runtime_error("merge_attn_states_cuda: " + std::to_string(threads) +
                             " threads exceed one grid");
  }
  merge_attn_states_kernel<T, kPack>
      <<<static_cast<unsigned>(blocks), kBlock, 0, reinterpret_cast<cudaStream_t>(args.stream)>>>(
          reinterpret_cast<T*>(args.out), reinterpret_cast<float*>(args.lse),
          reinterpret_cast<const T*>(args.out_a), reinterpret_cast<const float*>(args.lse_a),
          reinterpret_cast<const T*>(args.out_b), reinterpret_cast<const float*>(args.lse_b), rows,
          packs_per_row);
  BANASERVE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_pack(const CudaMergeArgs& args) {
  constexpr int kVector = 16 / sizeof(T);
  const bool aligned = ((args.out | args.out_a | args.out_b) % 16 == 0) &&
                       args.shape.head_dim % kVector == 0;
  if (aligned) {
    launch<T, kVector>(args);
  } else {
    launch<T, 1>(args);
  }
}

}  // namespace

void merge_attn_states_cuda(const CudaMergeArgs& args) {
  const MergeShape& s = args.shape;
  // The kernel derives each row's lse from its head_dim threads, so a zero-width head has none.
  if (s.tokens < 0 || s.heads < 0 || s.head_dim <= 0) {
    throw std::invalid_argument("merge_attn_states_cuda: need tokens, heads >= 0, head_dim > 0");
  }
  DeviceGuard guard(args.device);
  if (s.tokens == 0 || s.heads == 0) return;
  switch (args.dtype) {
    case ScalarType::kFloat32:
      dispatch_pack<float>(args);
      break;
    case ScalarType::kFloat16:
      dispatch_pack<__half>(args);
      break;
    case ScalarType::kBFloat16:
      dispatch_pack<__nv_bfloat16>(args);
      break;
    default:
      throw std::invalid_argument("merge_attn_states_cuda: unknown dtype code " +
                                  std::to_string(static_cast<int>(args.dtype)));
  }
}

}  // namespace banaserve::attention
