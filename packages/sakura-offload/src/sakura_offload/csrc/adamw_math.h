// sakura-offload: the element arithmetic of AdamW and of the moment formats, one
// definition for the host kernel (host_adamw.cpp, compiled by the C++ compiler) and the
// CUDA kernel (adamw_cuda.cu, compiled by nvcc, where these are __host__ __device__).
// See host_adamw.cpp for the update and the formats.
#pragma once

#include <float.h>
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
// mantissa in fp32's positions), which is the value times 2^-112 (code_bits), then
// rebiased by a multiplication by 2^(127-15), which also turns the subnormal codes into
// their values through an fp32 denormal.  (Under a flush-denormals mode, e.g.
// torch.set_flush_denormal(True), those read as zero.)  The host kernel folds the 2^112
// into the block's scale where that product is finite: the same single rounding of the
// same real product.  The signed code is sign-extended so one shift and one mask place its
// sign and magnitude.
constexpr float kDecodeShift = 0x1p112f;

SAKURA_HD inline float signed_code_bits(uint8_t code) {
  const uint32_t c = static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(code)));
  return from_bits((c << 20) & 0x87F00000U);
}

SAKURA_HD inline float unsigned_code_bits(uint8_t code) {
  return from_bits(static_cast<uint32_t>(code) << 19);
}

SAKURA_HD inline float signed_decode(uint8_t code) {
  return signed_code_bits(code) * kDecodeShift;
}

SAKURA_HD inline float unsigned_decode(uint8_t code) {
  return unsigned_code_bits(code) * kDecodeShift;
}

// Encoding is the decode reversed: a value x (scaled so the block's absmax is kSignedMax or
// kUnsignedMax) is multiplied by 2^-112, which leaves the code's exponent and mantissa in
// their fp32 positions, and fp32's own denormals hold the subnormal codes (no separate
// path, no conversion: integer operations on the bits round it).  The block's scale and the
// 2^-112 are one factor where that is a normal float, two multiplications otherwise
// (encode_scale); every implementation applies them alike.
constexpr float kCodeShift = 0x1p-112f;

struct EncodeScale {
  float first;   // the value is (x * first) * second
  float second;  // 1 whenever the block's absmax allows one factor (almost always)
};

SAKURA_HD inline EncodeScale encode_scale(float absmax, float top) {
  const float inv = absmax > 0.0f ? top / absmax : 0.0f;
  // inv * 2^-112 is a normal float (so exact) for inv >= 2^-14, i.e. absmax <= top * 2^14
  if (inv >= 0x1p-14f || inv == 0.0f) return EncodeScale{inv * kCodeShift, 1.0f};
  return EncodeScale{inv, kCodeShift};
}

// sign + E4M3 of y (a value times its EncodeScale), rounded to nearest even: on the
// magnitude's bits, round at bit 20 (the carry may step into the next binade; subnormal
// codes round the same way on the denormal's bits), saturate at 127, then the sign bit.
SAKURA_HD inline uint8_t signed_encode_nearest(float y) {
  const uint32_t b = to_bits(y);
  uint32_t mag = b & 0x7FFFFFFFU;
  mag = (mag + 0x7FFFFU + ((mag >> 20) & 1U)) >> 20;
  mag = mag < 127U ? mag : 127U;
  return static_cast<uint8_t>(mag | ((b >> 24) & 0x80U));
}

// unsigned E4M4 of y >= 0 (a value times its EncodeScale), rounded stochastically with 16
// random bits r16: they stand for the 19 bits truncated below the code's mantissa (shifted
// up 3, plus 4 so they sit at the middle of each 8-wide step: the chance of rounding up is
// within 2^-17 of the exact fraction, with no bias on average).
SAKURA_HD inline uint8_t unsigned_encode_stochastic(float y, uint32_t r16) {
  const uint32_t mag = (to_bits(y) + (((r16 << 3) & 0x7FFF8U) | 4U)) >> 19;
  return static_cast<uint8_t>(mag < 255U ? mag : 255U);
}

// Non-finite moments stay local.  An Inf or NaN gradient element makes its own new m and
// sqrt(v) non-finite (and its parameter NaN, as in torch.optim.AdamW); taken into the
// block's absmax it would make the absmax, and through the decode every value of the
// block, non-finite for good.  So the block max leaves non-finite values out, a non-finite
// m is stored as 0 and a non-finite sqrt(v) saturates at the largest code (the block's
// absmax); the other 255 values keep their exact update.  The CUDA kernel applies these
// per value (one select); the host kernel's vectorised loop only takes an integer max of
// the bits (no extra work: it replaces the float max) and applies them to a block whose
// max shows an Inf or NaN, after the loop.
SAKURA_HD inline bool is_finite(float x) { return fabsf(x) <= FLT_MAX; }  // false for NaN

SAKURA_HD inline float finite_or_zero(float x) { return is_finite(x) ? x : 0.0f; }

// The 16 random bits of value j (0..255) of int8 block b: one hash per pair (j, j + 128),
// its low half for the first, its high half for the second.
SAKURA_HD inline uint32_t pair_bits(uint32_t key, int64_t block, int j) {
  const uint32_t pair = static_cast<uint32_t>(block * (kBlock / 2) + (j & 127));
  const uint32_t r = mix32(pair * 0x9E3779B9U + key);
  return j < kBlock / 2 ? r & 0xFFFFU : r >> 16;
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
