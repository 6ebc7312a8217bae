// sakura-offload: AdamW on host memory, for fp32, bf16 and blockwise 8-bit moments.
//
// A plain C ABI (called through ctypes), with no torch headers, so the first-use build
// takes seconds.  The loops are written for the compiler's auto-vectoriser (-O3
// -march=native gives AVX2 / AVX-512 code where the CPU has it) and split across OpenMP
// threads in fixed chunks, so the result never depends on the thread count.
//
// The arithmetic mirrors torch.optim.AdamW's single-tensor path, operation by operation:
//   p = p * (1 - lr * wd)
//   m = m + (1 - beta1) * (g - m)                 (torch's lerp for weights < 0.5)
//   v = v * beta2 + ((1 - beta2) * g) * g         (addcmul)
//   p = p + (-lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps))
//
// Moment formats (the Python side, sakura_offload/_formats.py, holds the same definitions;
// a test checks that both decode every code to the same value):
//   bf16: the top 16 bits of the fp32 value after adding 16 random bits (stochastic rounding).
//   int8: blocks of 256 values share an fp32 absmax; each value is one byte, a small float
//         relative to it.  exp_avg: sign + E4M3 (bias 15, subnormals), rounded to nearest
//         even.  exp_avg_sq is stored as its square root, unsigned E4M4 (bias 15,
//         subnormals), stochastically rounded.  Scaled so the absmax maps to the largest
//         code (1.875 and 1.9375).
//
// Random bits come from a counter-based hash of (key, element index): the same on every
// thread count and identical to the pure-torch fallback's.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adamw_math.h"  // the element arithmetic, shared with adamw_cuda.cu

namespace {

constexpr int64_t kChunk = 16384;  // elements per parallel work item (fp32 / bf16)

// AdamW on one element with sqrt(v) / sqrt(bc2) as a product by 1 / sqrt(bc2) (one
// division fewer per element; within an ulp of adam_element's denominator).  Only the int8
// path uses it: its moments are approximate anyway, and it is the path bound by arithmetic.
inline float adam_element_scaled(const Hyper& h, float inv_bc2, float p, float g, float& m,
                                 float& v, float& s) {
  g = g * h.grad_scale;
  p = p * h.decay;
  m = m + h.w1 * (g - m);
  v = v * h.beta2 + (h.c2 * g) * g;
  s = sqrtf(v);
  const float denom = s * inv_bc2 + h.eps;
  return p + h.neg_step * (m / denom);
}

struct Int8Block {
  float* p;
  const float* g;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* s_codes;
  float* s_absmax;
  uint32_t first;  // index of the block's first element (the random stream's counter)
};

// One block of the int8 update: decode, AdamW, the block's new absmaxes, encode.  LEN is
// kBlock for the full blocks (a compile-time trip count: both loops vectorise without
// remainder handling) and 0 for a partial last block, whose length is len.
template <int64_t LEN>
inline void int8_block(const Hyper& h, const Int8Block& b, int64_t len_arg, uint32_t key) {
  const int64_t len = LEN ? LEN : len_arg;
  float m_new[kBlock];
  float s_new[kBlock];
  const float m_scale = *b.m_absmax / kSignedMax;
  const float s_scale = *b.s_absmax / kUnsignedMax;
  const float inv_bc2 = 1.0f / h.bc2_sqrt;
  float m_max = 0.0f;
  float s_max = 0.0f;
  float* pb = b.p;
  const float* gb = b.g;
  uint8_t* mb = b.m_codes;
  uint8_t* sb = b.s_codes;
#pragma omp simd reduction(max : m_max, s_max)
  for (int64_t j = 0; j < len; ++j) {
    float mi = signed_decode(mb[j]) * m_scale;
    const float so = unsigned_decode(sb[j]) * s_scale;
    float vi = so * so, s;
    pb[j] = adam_element_scaled(h, inv_bc2, pb[j], gb[j], mi, vi, s);
    m_new[j] = mi;
    s_new[j] = s;
    const float am = std::fabs(mi);
    m_max = m_max > am ? m_max : am;
    s_max = s_max > s ? s_max : s;
  }
  const float m_inv = m_max > 0.0f ? kSignedMax / m_max : 0.0f;
  const float s_inv = s_max > 0.0f ? kUnsignedMax / s_max : 0.0f;
  const int count = static_cast<int>(len);  // a 32-bit counter keeps the hash in 32-bit lanes
#pragma omp simd
  for (int j = 0; j < count; ++j) {
    mb[j] = signed_encode_nearest(m_new[j] * m_inv);
    const uint32_t r = mix32((b.first + static_cast<uint32_t>(j)) * 0x9E3779B9U + key);
    sb[j] = unsigned_encode_stochastic(s_new[j] * s_inv, r);
  }
  *b.m_absmax = m_max;
  *b.s_absmax = s_max;
}

}  // namespace

extern "C" {

int sakura_offload_abi_version() { return 2; }

// Every code's value, for the test that holds this file and _formats.py to one definition.
void sakura_decode_tables(float* signed_values, float* unsigned_values) {
  for (int c = 0; c < 256; ++c) {
    signed_values[c] = signed_decode(static_cast<uint8_t>(c));
    unsigned_values[c] = unsigned_decode(static_cast<uint8_t>(c));
  }
}

void sakura_adamw_fp32(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                       float w1, float beta2, float c2, float eps, float neg_step,
                       float bc2_sqrt, float grad_scale, int threads) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    const int64_t end = std::min(n, begin + kChunk);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      float mi = m[i], vi = v[i], s;
      p[i] = adam_element(h, p[i], g[i], mi, vi, s);
      m[i] = mi;
      v[i] = vi;
    }
  }
}

void sakura_adamw_bf16(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                       float decay, float w1, float beta2, float c2, float eps, float neg_step,
                       float bc2_sqrt, float grad_scale, uint32_t key, int threads) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    const int64_t end = std::min(n, begin + kChunk);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      float mi = bf16_decode(m[i]), vi = bf16_decode(v[i]), s;
      p[i] = adam_element(h, p[i], g[i], mi, vi, s);
      const uint32_t r = element_bits(key, i);
      m[i] = bf16_encode_stochastic(mi, r & 0xFFFFU);
      v[i] = bf16_encode_stochastic(vi, r >> 16);
    }
  }
}

// m_codes / s_codes hold ceil(n / 256) * 256 bytes; m_absmax / s_absmax one float per block.
void sakura_adamw_int8(float* p, const float* g, uint8_t* m_codes, float* m_absmax,
                       uint8_t* s_codes, float* s_absmax, int64_t n, float decay, float w1, float beta2,
                       float c2, float eps, float neg_step, float bc2_sqrt, float grad_scale,
                       uint32_t key, int threads) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 64)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock;
    const int64_t len = std::min(n, begin + kBlock) - begin;
    Int8Block block{p + begin, g + begin, m_codes + begin, m_absmax + b,
                    s_codes + begin, s_absmax + b, static_cast<uint32_t>(begin)};
    if (len == kBlock)
      int8_block<kBlock>(h, block, len, key);
    else
      int8_block<0>(h, block, len, key);
  }
}

// Triad a = b + k * c, for the benchmark's bandwidth figure (same threads, same compiler).
void sakura_triad(float* a, const float* b, const float* c, float k, int64_t n, int threads) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && chunks > 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t begin = ch * kChunk;
    const int64_t end = std::min(n, begin + kChunk);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) a[i] = b[i] + k * c[i];
  }
}

}  // extern "C"
