// Partial attention: queries attend over a token range of a KV sequence and/or over a subset of
// KV-head groups, returning the output with the log-sum-exp (lse) of the scores, so that partial
// results over disjoint key ranges can be recombined exactly by merge_attn_states.
//
// Layouts (C-contiguous):
//   q   [tokens, q_heads, head_dim]       k, v [kv_len, kv_heads, head_dim]
//   out [tokens, n_out_heads, head_dim]   lse  [tokens, n_out_heads]
// GQA: q_heads = kv_heads * group_size; query head h reads KV head h / group_size. Selecting
// KV heads g_0, g_1, ... (kv_head_groups) selects whole groups: output head i*group_size + r is
// query head g_i*group_size + r. Without a selection every KV head is selected in order.
// Keys: index j of k/v has absolute position kv_offset + j; only j in [start, stop) is read.
// Causal: a query at absolute position p sees keys at positions <= p.
// Rows (token, head) with no visible key get lse = -inf and out = 0.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/bfloat16.h"
#include "attention/merge_attn_states.h"  // ScalarType
#include "common/float16.h"

namespace banaserve::attention {

// Everything but the data pointers: shared by the CPU and CUDA entry points and validated once.
struct PartialAttentionParams {
  std::int64_t tokens = 0;
  std::int64_t q_heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t kv_len = 0;
  std::int64_t head_dim = 0;
  std::int64_t start = 0;  // key index range [start, stop) into k/v
  std::int64_t stop = 0;
  std::vector<std::int64_t> kv_head_groups;  // selected KV heads in output order; empty = all
  bool causal = false;
  std::int64_t kv_offset = 0;  // absolute position of k[0]
  double scale = 1.0;  // multiplies q.k before the softmax (float32 in the float32 kernels)

  std::int64_t group_size() const { return kv_heads > 0 ? q_heads / kv_heads : 0; }
  std::int64_t n_groups() const {
    return kv_head_groups.empty() ? kv_heads : static_cast<std::int64_t>(kv_head_groups.size());
  }
  std::int64_t out_heads() const { return n_groups() * group_size(); }
  std::int64_t kv_head(std::int64_t group_index) const {
    return kv_head_groups.empty() ? group_index : kv_head_groups[group_index];
  }
};

// Throws std::invalid_argument (ValueError in Python) naming the offending value: negative sizes,
// head_dim == 0, q_heads not a positive multiple of kv_heads, start/stop outside [0, kv_len] or
// start > stop, a KV-head index out of range or repeated, a non-finite scale.
void validate_partial_attention(const PartialAttentionParams& p);

// CPU. T is Half, BFloat16, float or double; L is float, or double when T is double (the
// accumulation type too). q_positions: [tokens] absolute positions, read only when causal. The
// caller allocates out and lse; no aliasing with the inputs. Validates p first.
template <typename T, typename L>
void partial_attention_cpu(const T* q, const T* k, const T* v, const std::int64_t* q_positions,
                           T* out, L* lse, const PartialAttentionParams& p);

// CUDA. Device addresses as integers (torch's data_ptr()), like CudaMergeArgs. lse is float32,
// q_positions int64 (0 when not causal). Every buffer lives on `device`.
struct CudaPartialAttentionArgs {
  std::uintptr_t out;
  std::uintptr_t lse;
  std::uintptr_t q;
  std::uintptr_t k;
  std::uintptr_t v;
  std::uintptr_t q_positions;
  PartialAttentionParams params;
  ScalarType dtype;
  int device;
  std::uintptr_t stream;  // cudaStream_t; 0 is the legacy default stream
};

// The CUDA kernel keeps head_dim / 32 elements per lane in registers and the selected KV heads
// in its parameter block, which bounds both.
inline constexpr std::int64_t kCudaMaxHeadDim = 512;
inline constexpr std::int64_t kCudaMaxSelectedGroups = 512;

// Validates, enqueues on args.stream and returns without synchronizing. Launch errors throw
// std::runtime_error; faults during execution surface at the next sync. Throws
// std::runtime_error without a usable device, std::invalid_argument for bad parameters
// (including head_dim > kCudaMaxHeadDim).
void partial_attention_cuda(const CudaPartialAttentionArgs& args);

}  // namespace banaserve::attention
