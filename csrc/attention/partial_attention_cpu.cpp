#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "attention/partial_attention.h"

namespace banaserve::attention {
namespace {

inline float load(Half x) { return half_to_float(x); }
inline float load(BFloat16 x) { return bfloat16_to_float(x); }
inline float load(float x) { return x; }
inline double load(double x) { return x; }

inline void store(Half* dst, float v) { *dst = float_to_half(v); }
inline void store(BFloat16* dst, float v) { *dst = float_to_bfloat16(v); }
inline void store(float* dst, float v) { *dst = v; }
inline void store(double* dst, double v) { *dst = v; }

std::string str(std::int64_t x) { return std::to_string(x); }

}  // namespace

void validate_partial_attention(const PartialAttentionParams& p) {
  if (p.tokens < 0 || p.kv_len < 0) {
    throw std::invalid_argument("partial_attention: tokens (" + str(p.tokens) + ") and kv_len (" +
                                str(p.kv_len) + ") must be >= 0");
  }
  if (p.head_dim <= 0) {
    throw std::invalid_argument("partial_attention: head_dim must be > 0, got " +
                                str(p.head_dim));
  }
  if (p.kv_heads <= 0 || p.q_heads <= 0 || p.q_heads % p.kv_heads != 0) {
    throw std::invalid_argument("partial_attention: q_heads (" + str(p.q_heads) +
                                ") must be a positive multiple of kv_heads (" + str(p.kv_heads) +
                                ")");
  }
  if (p.start < 0 || p.stop > p.kv_len || p.start > p.stop) {
    throw std::invalid_argument("partial_attention: token_range [" + str(p.start) + ", " +
                                str(p.stop) + ") must satisfy 0 <= start <= stop <= kv_len (" +
                                str(p.kv_len) + ")");
  }
  std::unordered_set<std::int64_t> seen;
  for (const std::int64_t g : p.kv_head_groups) {
    if (g < 0 || g >= p.kv_heads) {
      throw std::invalid_argument("partial_attention: kv_head_groups index " + str(g) +
                                  " out of range [0, " + str(p.kv_heads) + ")");
    }
    if (!seen.insert(g).second) {
      throw std::invalid_argument("partial_attention: kv_head_groups index " + str(g) +
                                  " repeated");
    }
  }
  if (!std::isfinite(p.scale)) {
    throw std::invalid_argument("partial_attention: scale must be finite");
  }
}

template <typename T, typename L>
void partial_attention_cpu(const T* q, const T* k, const T* v, const std::int64_t* q_positions,
                           T* out, L* lse, const PartialAttentionParams& p) {
  validate_partial_attention(p);
  if (p.causal && q_positions == nullptr && p.tokens > 0) {
    throw std::invalid_argument("partial_attention: causal needs q_positions");
  }
  using Acc = L;  // float, or double for double inputs
  const std::int64_t dim = p.head_dim;
  const std::int64_t group = p.group_size();
  const std::int64_t out_heads = p.out_heads();
  const Acc scale = static_cast<Acc>(p.scale);
  std::vector<Acc> qrow(dim), acc(dim), scores;
  scores.reserve(static_cast<std::size_t>(p.stop - p.start));

  for (std::int64_t t = 0; t < p.tokens; ++t) {
    // Causal masking only shortens the range: keys j with kv_offset + j <= position.
    std::int64_t stop = p.stop;
    if (p.causal) {
      const std::int64_t last_visible = q_positions[t] - p.kv_offset;  // may be < 0
      stop = std::max(p.start, std::min(stop, last_visible + 1));
    }
    for (std::int64_t o = 0; o < out_heads; ++o) {
      const std::int64_t kv_head = p.kv_head(o / group);
      const std::int64_t q_head = kv_head * group + o % group;
      const T* qp = q + (t * p.q_heads + q_head) * dim;
      for (std::int64_t d = 0; d < dim; ++d) qrow[d] = static_cast<Acc>(load(qp[d]));

      // Two passes over the keys (scores, then weighted values) instead of an online softmax:
      // the max is known before any exp(), so nothing is rescaled and rounding stays minimal.
      scores.clear();
      Acc peak = -std::numeric_limits<Acc>::infinity();
      for (std::int64_t j = p.start; j < stop; ++j) {
        const T* kp = k + (j * p.kv_heads + kv_head) * dim;
        Acc s = 0;
        for (std::int64_t d = 0; d < dim; ++d) s += qrow[d] * static_cast<Acc>(load(kp[d]));
        s *= scale;
        scores.push_back(s);
        peak = std::max(peak, s);
      }
      T* op = out + (t * out_heads + o) * dim;
      if (scores.empty()) {
        for (std::int64_t d = 0; d < dim; ++d) store(op + d, Acc(0));
        lse[t * out_heads + o] = -std::numeric_limits<L>::infinity();
        continue;
      }
      std::fill(acc.begin(), acc.end(), Acc(0));
      Acc total = 0;
      for (std::int64_t j = p.start; j < stop; ++j) {
        const Acc w = std::exp(scores[j - p.start] - peak);
        total += w;
        const T* vp = v + (j * p.kv_heads + kv_head) * dim;
        for (std::int64_t d = 0; d < dim; ++d) acc[d] += w * static_cast<Acc>(load(vp[d]));
      }
      for (std::int64_t d = 0; d < dim; ++d) store(op + d, acc[d] / total);
      lse[t * out_heads + o] = static_cast<L>(peak + std::log(total));
    }
  }
}

#define BANASERVE_INSTANTIATE(T, L)                                                  \
  template void partial_attention_cpu<T, L>(const T*, const T*, const T*,           \
                                            const std::int64_t*, T*, L*,            \
                                            const PartialAttentionParams&);
BANASERVE_INSTANTIATE(Half, float)
BANASERVE_INSTANTIATE(BFloat16, float)
BANASERVE_INSTANTIATE(float, float)
BANASERVE_INSTANTIATE(double, double)
#undef BANASERVE_INSTANTIATE

}  // namespace banaserve::attention
