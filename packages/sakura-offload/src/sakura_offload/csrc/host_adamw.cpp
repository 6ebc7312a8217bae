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

namespace {

constexpr int64_t kChunk = 16384;  // elements per parallel work item (fp32 / bf16)
constexpr int64_t kBlock = 256;    // values per absmax (int8)
constexpr float kSignedMax = 1.875f;
constexpr float kUnsignedMax = 1.9375f;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline uint32_t element_bits(uint32_t key, int64_t i) {
  return mix32(static_cast<uint32_t>(i) * 0x9E3779B9U + key);
}

inline float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float bf16_decode(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t bf16_encode_stochastic(float f, uint32_t r16) {
  return static_cast<uint16_t>((to_bits(f) + r16) >> 16);
}

// The value of a code, from its bits: placed in an fp32 pattern (sign, exponent and
// mantissa in fp32's positions) and rebiased by a multiplication by 2^(127-15), which also
// turns the subnormal codes into their values through an fp32 denormal.  (Under a
// flush-denormals mode, e.g. torch.set_flush_denormal(True), those read as zero.)
inline float signed_decode(uint8_t code) {
  const uint32_t c = code;
  return from_bits(((c & 0x7FU) << 20) | ((c & 0x80U) << 24)) * 0x1p112f;
}

inline float unsigned_decode(uint8_t code) {
  return from_bits(static_cast<uint32_t>(code) << 19) * 0x1p112f;
}

// sign + E4M3 magnitude of x (already scaled so the block's absmax is kSignedMax).
// Branch-free (both cases computed, one selected) so the loop vectorises.
inline uint8_t signed_encode_nearest(float x) {
  const float a = std::fabs(x);
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
inline uint8_t unsigned_encode_stochastic(float a, uint32_t r) {
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
inline float adam_element(const Hyper& h, float p, float g, float& m, float& v, float& s) {
  g = g * h.grad_scale;
  p = p * h.decay;
  m = m + h.w1 * (g - m);
  v = v * h.beta2 + (h.c2 * g) * g;
  s = std::sqrt(v);
  const float denom = s / h.bc2_sqrt + h.eps;
  return p + h.neg_step * (m / denom);
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
    float m_new[kBlock];
    float s_new[kBlock];
    const float m_scale = m_absmax[b] / kSignedMax;
    const float s_scale = s_absmax[b] / kUnsignedMax;
    float m_max = 0.0f;
    float s_max = 0.0f;
    float* pb = p + begin;
    const float* gb = g + begin;
    uint8_t* mb = m_codes + begin;
    uint8_t* sb = s_codes + begin;
#pragma omp simd reduction(max : m_max, s_max)
    for (int64_t j = 0; j < len; ++j) {
      float mi = signed_decode(mb[j]) * m_scale;
      const float so = unsigned_decode(sb[j]) * s_scale;
      float vi = so * so, s;
      pb[j] = adam_element(h, pb[j], gb[j], mi, vi, s);
      m_new[j] = mi;
      s_new[j] = s;
      const float am = std::fabs(mi);
      m_max = m_max > am ? m_max : am;
      s_max = s_max > s ? s_max : s;
    }
    const float m_inv = m_max > 0.0f ? kSignedMax / m_max : 0.0f;
    const float s_inv = s_max > 0.0f ? kUnsignedMax / s_max : 0.0f;
    const uint32_t base = static_cast<uint32_t>(begin);
    const int count = static_cast<int>(len);
#pragma omp simd
    for (int j = 0; j < count; ++j) {
      mb[j] = signed_encode_nearest(m_new[j] * m_inv);
      const uint32_t r = mix32((base + static_cast<uint32_t>(j)) * 0x9E3779B9U + key);
      sb[j] = unsigned_encode_stochastic(s_new[j] * s_inv, r);
    }
    m_absmax[b] = m_max;
    s_absmax[b] = s_max;
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
