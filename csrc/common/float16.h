// IEEE binary16 on the host, bit for bit numpy's float16. Hand-written rather than _Float16 so
// that the CPU build does not depend on compiler support for it; the CUDA side uses __half.
#pragma once

#include <cstdint>
#include <cstring>

namespace banaserve {

struct Half {
  std::uint16_t bits;
};
static_assert(sizeof(Half) == 2, "Half must alias numpy float16 storage");

inline float half_to_float(Half h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (h.bits >> 10) & 0x1fu;
  std::uint32_t mantissa = h.bits & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    // Subnormal half: every one of them is a normal float once the leading 1 is shifted out.
    std::uint32_t shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, like numpy's astype(float16) and CUDA's __float2half_rn.
inline Half float_to_half(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  std::uint16_t bits;
  if (u >= 0x47800000u) {  // |f| >= 65536 (or inf/nan): inf, or a quiet NaN
    bits = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {  // |f| < 2^-14: subnormal half or zero
    // Adding 0.5 puts the 10 half-mantissa bits at the bottom of the float's mantissa and lets
    // the FPU do the round-to-nearest-even.
    const float magic = 0.5f;
    float g;
    std::memcpy(&g, &u, sizeof g);
    g += magic;
    std::uint32_t gu;
    std::memcpy(&gu, &g, sizeof gu);
    bits = static_cast<std::uint16_t>(gu - 0x3f000000u);
  } else {
    const std::uint32_t odd = (u >> 13) & 1u;
    u += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu + odd;
    bits = static_cast<std::uint16_t>(u >> 13);
  }
  return Half{static_cast<std::uint16_t>(bits | sign)};
}

}  // namespace banaserve
