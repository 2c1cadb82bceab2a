#include <type_traits>

#include "attention/merge_attn_states.h"

namespace banaserve::attention {
namespace {

inline float load(Half x) { return half_to_float(x); }
inline float load(float x) { return x; }
inline double load(double x) { return x; }

inline void store(Half* dst, float v) { *dst = float_to_half(v); }
inline void store(float* dst, float v) { *dst = v; }
inline void store(double* dst, double v) { *dst = v; }

template <typename T>
using StoreT = std::conditional_t<std::is_same_v<T, double>, double, float>;

}  // namespace

template <typename T, typename L>
void merge_attn_states_cpu(const T* out_a, const L* lse_a, const T* out_b, const L* lse_b, T* out,
                           L* lse, MergeShape shape) {
  using Acc = std::common_type_t<StoreT<T>, L>;
  const std::int64_t rows = shape.tokens * shape.heads;
  const std::int64_t dim = shape.head_dim;
  for (std::int64_t r = 0; r < rows; ++r) {
    const MergeWeights<Acc> w =
        merge_weights<Acc>(static_cast<Acc>(lse_a[r]), static_cast<Acc>(lse_b[r]));
    lse[r] = static_cast<L>(w.lse);
    const T* a = out_a + r * dim;
    const T* b = out_b + r * dim;
    T* o = out + r * dim;
    for (std::int64_t j = 0; j < dim; ++j) {
      Acc acc = 0;
      if (w.scale_a != 0) acc += static_cast<Acc>(load(a[j])) * w.scale_a;
      if (w.scale_b != 0) acc += static_cast<Acc>(load(b[j])) * w.scale_b;
      store(o + j, static_cast<StoreT<T>>(acc));
    }
  }
}

#define BANASERVE_INSTANTIATE(T, L)                                                          \
  template void merge_attn_states_cpu<T, L>(const T*, const L*, const T*, const L*, T*, L*, \
                                            MergeShape);
BANASERVE_INSTANTIATE(Half, float)
BANASERVE_INSTANTIATE(Half, double)
BANASERVE_INSTANTIATE(float, float)
BANASERVE_INSTANTIATE(float, double)
BANASERVE_INSTANTIATE(double, float)
BANASERVE_INSTANTIATE(double, double)
#undef BANASERVE_INSTANTIATE

}  // namespace banaserve::attention
