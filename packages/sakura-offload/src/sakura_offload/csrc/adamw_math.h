// sakura-offload: the element arithmetic of AdamW and of the moment formats, one
// definition for the host kernel (host_adamw.cpp, compiled by the C++ compiler) and the
// CUDA kernel (adamw_cuda.cu, compiled by nvcc, where these are __host__ __device__).
// See host_adamw.cpp for the update and the formats.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define SAKURA_HD __host__ __device__
#else
#define SAKURA_HD
#endif

namespace {

constexpr int64_t kBlock = 256;  // values per absmax (int8)
constexpr float kSignedMax = 1.875f;
constexpr float kUnsignedMax = 1.9375f;

SAKURA_HD inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

SAKURA_HD inline uint32_t element_bits(uint32_t key, int64_t i) {
  return mix32(static_cast<uint32_t>(i) * 0x9E3779B9U + key);
}

SAKURA_HD inline float from_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

SAKURA_HD inline uint32_t to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

SAKURA_HD inline float bf16_decode(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

SAKURA_HD inline uint16_t bf16_encode_stochastic(float f, uint32_t r16) {
  return static_cast<uint16_t>((to_bits(f) + r16) >> 16);
}

// The value of a code, from its bits: placed in an fp32 pattern (sign, exponent and
// mantissa in fp32's positions) and rebiased by a multiplication by 2^(127-15), which also
// turns the subnormal codes into their values through an fp32 denormal.  (Under a
// flush-denormals mode, e.g. torch.set_flush_denormal(True), those read as zero.)
SAKURA_HD inline float signed_decode(uint8_t code) {
  const uint32_t c = code;
  return from_bits(((c & 0x7FU) << 20) | ((c & 0x80U) << 24)) * 0x1p112f;
}

SAKURA_HD inline float unsigned_decode(uint8_t code) {
  return from_bits(static_cast<uint32_t>(code) << 19) * 0x1p112f;
}

// sign + E4M3 magnitude of x (already scaled so the block's absmax is kSignedMax).
// Branch-free (both cases computed, one selected) so the loop vectorises.
SAKURA_HD inline uint8_t signed_encode_nearest(float x) {
  const float a = fabsf(x);
  // subnormal codes 0..8: round-to-nearest-even through the 2^23 trick (on a clamped
  // value, so the conversion is always in range)
  const float t = a < 0x1p-14f ? a : 0x1p-14f;
  const uint32_t sub = static_cast<uint32_t>(static_cast<int32_t>((t * 0x1p17f + 0x1p23f) - 0x1p23f));
  uint32_t b = to_bits(a);
  b += 0x7FFFFU + ((b >> 20) & 1U);
  const uint32_t normal = (b >> 20) - (112U << 3);
  uint32_t mag = a < 0x1p-14f ? sub : normal;
  mag = mag < 127U ? mag : 127U;
  return static_cast<uint8_t>(mag | (x < 0.0f ? 0x80U : 0U));
}

// unsigned E4M4 code of a >= 0 (scaled so the block's absmax is kUnsignedMax), rounded
// stochastically with the random bits r.  Branch-free, as above.
SAKURA_HD inline uint8_t unsigned_encode_stochastic(float a, uint32_t r) {
  const float u = static_cast<float>(static_cast<int32_t>(r >> 8)) * 0x1p-24f;
  // Clamped so the conversion is always in range (the compiler then computes both cases);
  // t * 2^18 + u is >= 0, so truncation is floor.
  const float t = a < 0x1p-14f ? a : 0x1p-14f;
  const uint32_t sub = static_cast<uint32_t>(static_cast<int32_t>(t * 0x1p18f + u));
  const uint32_t normal = ((to_bits(a) + (r & 0x7FFFFU)) >> 19) - (112U << 4);
  uint32_t mag = a < 0x1p-14f ? sub : normal;
  mag = mag < 255U ? mag : 255U;
  return static_cast<uint8_t>(mag);
}

struct Hyper {
  float decay;      // 1 - lr * weight_decay
  float w1;         // 1 - beta1
  float beta2;
  float c2;         // 1 - beta2
  float eps;
  float neg_step;   // -lr / (1 - beta1^t)
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float grad_scale; // clipping coefficient (1 when not clipping)
};

// One element; returns the new parameter, updates m and v, and gives sqrt(v).
SAKURA_HD inline float adam_element(const Hyper& h, float p, float g, float& m, float& v, float& s) {
  g = g * h.grad_scale;
  p = p * h.decay;
  m = m + h.w1 * (g - m);
  v = v * h.beta2 + (h.c2 * g) * g;
  s = sqrtf(v);
  const float denom = s / h.bc2_sqrt + h.eps;
  return p + h.neg_step * (m / denom);
}

}  // namespace
