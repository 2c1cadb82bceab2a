// bfloat16 on the host as its uint16 bit pattern (the upper half of a float32). numpy has no
// bfloat16, so the Python side hands torch's bfloat16 storage over as uint16; the CUDA side uses
// __nv_bfloat16 instead.
#pragma once

#include <cstdint>
#include <cstring>

namespace banaserve {

struct BFloat16 {
  std::uint16_t bits;
};
static_assert(sizeof(BFloat16) == 2, "BFloat16 must alias torch.bfloat16 storage");

inline float bfloat16_to_float(BFloat16 h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, like torch's .to(torch.bfloat16) and CUDA's __float2bfloat16_rn.
inline BFloat16 float_to_bfloat16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return BFloat16{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};  // keep NaN a (quiet) NaN
  }
  const std::uint32_t odd = (u >> 16) & 1u;
  u += 0x7fffu + odd;  // overflow past the largest finite value rounds to inf, as it should
  return BFloat16{static_cast<std::uint16_t>(u >> 16)};
}

}  // namespace banaserve
