// bfloat16 <-> float32 for Glassbox's C++ kernels, bit for bit as torch converts: bfloat16 is
// the top 16 bits of a float32; a float32 rounds to the nearest bfloat16, ties to even, and a
// NaN stays a NaN. Included by small_linear_cpu.cpp and brgemm_linear_cpu.cpp (kernel_build.py
// puts this folder's headers in each kernel's hash, so an edit here rebuilds them).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float x) {  // round to nearest, ties to even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}
