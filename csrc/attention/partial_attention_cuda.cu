#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "attention/partial_attention.h"
#include "common/cuda_convert.cuh"
#include "common/cuda_utils.cuh"

namespace banaserve::attention {
namespace {

constexpr int kWarpSize = 32;
// Four warps per (token, head) row: enough to keep several key loads in flight per row while
// short rows (decode against a small range) still waste little of the block.
constexpr int kWarps = 4;

// Passed by value in the kernel's parameter block, so the head selection needs no device
// allocation (and nothing to free or to keep alive until the kernel has run).
struct KernelParams {
  std::int64_t q_heads;
  std::int64_t kv_heads;
  std::int64_t head_dim;
  std::int64_t start;
  std::int64_t stop;
  std::int64_t kv_offset;
  std::int64_t group;
  std::int64_t out_heads;
  float scale;
  int causal;
  int n_selected;  // 0: every KV head, in order
  int selected[kCudaMaxSelectedGroups];
};

// One block per (token, output head). Warp w takes keys start+w, start+w+kWarps, ... with its
// own online softmax (running max m, sum l, accumulator); lane i owns dims i, i+32, ..., so a
// key's dot product is one warp reduction and no block-wide sync is needed inside the loop.
// The kWarps partial states are merged through shared memory at the end, like merge_attn_states.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kWarps * kWarpSize)
    partial_attention_kernel(T* __restrict__ out, float* __restrict__ lse,
                             const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, const std::int64_t* __restrict__ q_positions,
                             const KernelParams p) {
  extern __shared__ float shared[];  // [kWarps] m, [kWarps] l, [kWarps][head_dim] acc
  float* sm_m = shared;
  float* sm_l = shared + kWarps;
  float* sm_acc = shared + 2 * kWarps;

  const std::int64_t row = blockIdx.x;  // token * out_heads + output head
  const std::int64_t t = row / p.out_heads;
  const std::int64_t o = row % p.out_heads;
  const std::int64_t g = o / p.group;
  const std::int64_t kv_head = p.n_selected > 0 ? p.selected[g] : g;
  const std::int64_t q_head = kv_head * p.group + o % p.group;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t dim = p.head_dim;

  std::int64_t stop = p.stop;
  if (p.causal) {
    // A query at position P sees keys with kv_offset + j <= P: causality only shortens the range.
    const std::int64_t last_visible = q_positions[t] - p.kv_offset;
    stop = last_visible + 1 < stop ? last_visible + 1 : stop;
  }

  float qr[kPerLane];
  float acc[kPerLane];
  const T* qp = q + (t * p.q_heads + q_head) * dim;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const std::int64_t d = lane + i * kWarpSize;
    qr[i] = d < dim ? to_float(qp[d]) : 0.f;
    acc[i] = 0.f;
  }

  float m = -INFINITY;
  float l = 0.f;
  for (std::int64_t j = p.start + warp; j < stop; j += kWarps) {
    const T* kp = k + (j * p.kv_heads + kv_head) * dim;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const std::int64_t d = lane + i * kWarpSize;
      if (d < dim) s += qr[i] * to_float(kp[d]);
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      s += __shfl_xor_sync(0xffffffffu, s, offset);
    }
    s *= p.scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);  // 0 on the first key (m = -inf)
    const float w = expf(s - m_new);
    l = l * correction + w;
    const T* vp = v + (j * p.kv_heads + kv_head) * dim;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const std::int64_t d = lane + i * kWarpSize;
      const float vd = d < dim ? to_float(vp[d]) : 0.f;
      acc[i] = acc[i] * correction + w * vd;
    }
    m = m_new;
  }

  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const std::int64_t d = lane + i * kWarpSize;
    if (d < dim) sm_acc[warp * dim + d] = acc[i];
  }
  __syncthreads();

  float peak = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) peak = fmaxf(peak, sm_m[w]);
  T* op = out + row * dim;
  if (peak == -INFINITY) {  // no visible key in this row: the merge identity
    for (std::int64_t d = threadIdx.x; d < dim; d += blockDim.x) op[d] = from_float<T>(0.f);
    if (threadIdx.x == 0) lse[row] = -INFINITY;
    return;
  }
  // A warp that saw no key has m = -inf and so weight exactly 0.
  float weight[kWarps];
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = expf(sm_m[w] - peak);
    total += sm_l[w] * weight[w];
  }
  for (std::int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += sm_acc[w * dim + d] * weight[w];
    op[d] = from_float<T>(sum / total);
  }
  if (threadIdx.x == 0) lse[row] = peak + logf(total);
}

template <typename T, int kPerLane>
void launch(const CudaPartialAttentionArgs& args, const KernelParams& kp, std::int64_t rows) {
  const std::size_t shared_bytes = sizeof(float) * (2 * kWarps + kWarps * kp.head_dim);
  partial_attention_kernel<T, kPerLane>
      <<<static_cast<unsigned>(rows), kWarps * kWarpSize, shared_bytes,
         reinterpret_cast<cudaStream_t>(args.stream)>>>(
          reinterpret_cast<T*>(args.out), reinterpret_cast<float*>(args.lse),
          reinterpret_cast<const T*>(args.q), reinterpret_cast<const T*>(args.k),
          reinterpret_cast<const T*>(args.v),
          reinterpret_cast<const std::int64_t*>(args.q_positions), kp);
  BANASERVE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_dim(const CudaPartialAttentionArgs& args, const KernelParams& kp,
                  std::int64_t rows) {
  // Registers per lane grow with kPerLane; pick the smallest that covers head_dim.
  const std::int64_t per_lane = (kp.head_dim + kWarpSize - 1) / kWarpSize;
  if (per_lane <= 1) return launch<T, 1>(args, kp, rows);
  if (per_lane <= 2) return launch<T, 2>(args, kp, rows);
  if (per_lane <= 4) return launch<T, 4>(args, kp, rows);
  if (per_lane <= 8) return launch<T, 8>(args, kp, rows);
  return launch<T, 16>(args, kp, rows);
}

}  // namespace

void partial_attention_cuda(const CudaPartialAttentionArgs& args) {
  const PartialAttentionParams& p = args.params;
  validate_partial_attention(p);
  if (p.head_dim > kCudaMaxHeadDim) {
    throw std::invalid_argument("partial_attention_cuda: head_dim " + std::to_string(p.head_dim) +
                                " exceeds " + std::to_string(kCudaMaxHeadDim));
  }
  if (static_cast<std::int64_t>(p.kv_head_groups.size()) > kCudaMaxSelectedGroups) {
    throw std::invalid_argument("partial_attention_cuda: more than " +
                                std::to_string(kCudaMaxSelectedGroups) +
                                " kv_head_groups selected; select all (None) or split the call");
  }
  if (p.causal && args.q_positions == 0 && p.tokens > 0) {
    throw std::invalid_argument("partial_attention_cuda: causal needs q_positions");
  }
  DeviceGuard guard(args.device);
  const std::int64_t rows = p.tokens * p.out_heads();
  if (rows == 0) return;
  if (rows > std::numeric_limits<int>::max()) {
    throw std::runtime_error("partial_attention_cuda: " + std::to_string(rows) +
                             " (token, head) rows exceed one grid");
  }

  KernelParams kp{};
  kp.q_heads = p.q_heads;
  kp.kv_heads = p.kv_heads;
  kp.head_dim = p.head_dim;
  kp.start = p.start;
  kp.stop = p.stop;
  kp.kv_offset = p.kv_offset;
  kp.group = p.group_size();
  kp.out_heads = p.out_heads();
  kp.scale = static_cast<float>(p.scale);
  kp.causal = p.causal ? 1 : 0;
  kp.n_selected = static_cast<int>(p.kv_head_groups.size());
  for (std::size_t i = 0; i < p.kv_head_groups.size(); ++i) {
    kp.selected[i] = static_cast<int>(p.kv_head_groups[i]);
  }

  switch (args.dtype) {
    case ScalarType::kFloat32:
      return dispatch_dim<float>(args, kp, rows);
    case ScalarType::kFloat16:
      return dispatch_dim<__half>(args, kp, rows);
    case ScalarType::kBFloat16:
      return dispatch_dim<__nv_bfloat16>(args, kp, rows);
  }
  throw std::invalid_argument("partial_attention_cuda: unknown dtype code " +
                              std::to_string(static_cast<int>(args.dtype)));
}

}  // namespace banaserve::attention
