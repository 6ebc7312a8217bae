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
//         subnormals), stochastically rounded with 16 random bits.  Scaled so the absmax
//         maps to the largest code (1.875 and 1.9375); encoded from the bits of the scaled
//         value times 2^-112 (adamw_math.h).  Non-finite values are left out of the
//         absmax (a non-finite m is stored as 0, a non-finite sqrt(v) as the largest
//         code), so an Inf or NaN gradient element costs that element only, as in torch.
//
// Random bits come from a counter-based hash of (key, element index) for bf16, of (key,
// pair of values j and j + 128 of a block) for int8: the same on every thread count and
// identical to the pure-torch fallback's.
//
// Where the int8 time goes (one thread, Zen 4, ~0.7 ns per value): AdamW itself with its
// sqrt and division and the decode are about two thirds, the encode and the hash the rest;
// what keeps it there is the count of vector operations, not memory.

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
// kScaled: whether the gradient is multiplied by grad_scale (a product by 1 changes
// nothing, so without clipping the multiplication is left out).
template <bool kScaled>
inline float adam_element_scaled(const Hyper& h, float inv_bc2, float p, float g, float& m,
                                 float& v, float& s) {
  if (kScaled) g = g * h.grad_scale;
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
  int64_t index;  // the block's index (the random stream's counter)
};

// The first half of a block's update: decode, AdamW, the new moments (m and sqrt(v)) into
// m_new / s_new and the bits of their largest magnitudes (an integer max of the bits of
// |x|: for finite values the order of the floats, and any Inf or NaN lands above
// kFiniteBits, which a float max would not reliably tell).  kFast: a full block (a
// compile-time trip count: the loop vectorises without remainder handling) whose decode
// scales take the 2^112 in (both absmaxes under kFoldLimit, so the products are finite);
// otherwise len values and decode's own two multiplications.  The Hyper is copied so that its fields stay in
// registers (the stores to p could alias a reference).
template <bool kFast, bool kScaled>
inline void int8_update(const Hyper h, const Int8Block& b, int64_t len_arg, float* m_new,
                        float* s_new, uint32_t& m_top, uint32_t& s_top) {
  const int64_t len = kFast ? kBlock : len_arg;
  const float m_scale = *b.m_absmax / kSignedMax;
  const float s_scale = *b.s_absmax / kUnsignedMax;
  const float m_fold = m_scale * kDecodeShift;
  const float s_fold = s_scale * kDecodeShift;
  const float inv_bc2 = 1.0f / h.bc2_sqrt;
  uint32_t m_max = 0;
  uint32_t s_max = 0;
  float* pb = b.p;
  const float* gb = b.g;
  const uint8_t* mb = b.m_codes;
  const uint8_t* sb = b.s_codes;
#pragma omp simd reduction(max : m_max, s_max)
  for (int64_t j = 0; j < len; ++j) {
    float mi = kFast ? signed_code_bits(mb[j]) * m_fold : signed_decode(mb[j]) * m_scale;
    const float so =
        kFast ? unsigned_code_bits(sb[j]) * s_fold : unsigned_decode(sb[j]) * s_scale;
    float vi = so * so, s;
    pb[j] = adam_element_scaled<kScaled>(h, inv_bc2, pb[j], gb[j], mi, vi, s);
    m_new[j] = mi;
    s_new[j] = s;
    const uint32_t am = to_bits(mi) & 0x7FFFFFFFU;
    const uint32_t as = to_bits(s) & 0x7FFFFFFFU;
    m_max = m_max > am ? m_max : am;
    s_max = s_max > as ? s_max : as;
  }
  m_top = m_max;
  s_top = s_max;
}

// j * 0x9E3779B9 for each pair j of a block: the hash's input for pair j is base + that,
// a load and an addition per vector instead of a 32-bit multiplication
struct PairSteps {
  uint32_t step[kBlock / 2];
};
constexpr PairSteps pair_steps() {
  PairSteps s{};
  for (int j = 0; j < kBlock / 2; ++j) s.step[j] = static_cast<uint32_t>(j) * 0x9E3779B9U;
  return s;
}
alignas(64) constexpr PairSteps kPairSteps = pair_steps();

// The second half: all 256 codes of the block (a partial block's padding holds zeros, as
// the Python side's).  Values j and j + 128 share one hash (pair_bits), so the loop runs
// over the pairs.  kOneStep: both scales are one factor (EncodeScale::second == 1).
template <bool kOneStep>
inline void int8_encode(const float* m_new, const float* s_new, EncodeScale m_sc,
                        EncodeScale s_sc, const Int8Block& b, uint32_t key) {
  constexpr int kHalf = kBlock / 2;
  uint8_t* mb = b.m_codes;
  uint8_t* sb = b.s_codes;
  const uint32_t base = static_cast<uint32_t>(b.index * kHalf) * 0x9E3779B9U + key;
  const auto m_code = [&](float x) {
    return signed_encode_nearest(kOneStep ? x * m_sc.first : x * m_sc.first * m_sc.second);
  };
  const auto s_code = [&](float x, uint32_t r) {
    return unsigned_encode_stochastic(
        kOneStep ? x * s_sc.first : x * s_sc.first * s_sc.second, r);
  };
#pragma omp simd
  for (int j = 0; j < kHalf; ++j) {
    const uint32_t r = mix32(base + kPairSteps.step[j]);
    mb[j] = m_code(m_new[j]);
    mb[j + kHalf] = m_code(m_new[j + kHalf]);
    sb[j] = s_code(s_new[j], r);
    sb[j + kHalf] = s_code(s_new[j + kHalf], r >> 16);
  }
}

// absmaxes below this fold the decode's 2^112 into their scale (absmax / top * 2^112
// stays finite)
constexpr float kFoldLimit = 0x1p15f;

// The bits of the largest finite float; those of |x| are above them for Inf and NaN.
constexpr uint32_t kFiniteBits = 0x7F7FFFFFU;

// A block with a non-finite new moment (an Inf or NaN gradient element, rare; off the
// vectorised loop): the absmaxes of its finite values, a non-finite m stored as 0, a
// non-finite sqrt(v) left to saturate at the largest code (adamw_math.h).
inline void keep_local(float* m_new, const float* s_new, uint32_t& m_max, uint32_t& s_max) {
  float m_top = 0.0f, s_top = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) {
    m_new[j] = finite_or_zero(m_new[j]);
    m_top = std::max(m_top, std::fabs(m_new[j]));
    s_top = std::max(s_top, finite_or_zero(s_new[j]));
  }
  m_max = to_bits(m_top);
  s_max = to_bits(s_top);
}

// One block of the int8 update: len values (a full block is kBlock).
template <bool kScaled>
inline void int8_block(const Hyper& h, const Int8Block& b, int64_t len, uint32_t key) {
  alignas(64) float m_new[kBlock];
  alignas(64) float s_new[kBlock];
  uint32_t m_bits, s_bits;
  if (len == kBlock && *b.m_absmax < kFoldLimit && *b.s_absmax < kFoldLimit) {
    int8_update<true, kScaled>(h, b, len, m_new, s_new, m_bits, s_bits);
  } else {
    int8_update<false, true>(h, b, len, m_new, s_new, m_bits, s_bits);
    std::fill(m_new + len, m_new + kBlock, 0.0f);
    std::fill(s_new + len, s_new + kBlock, 0.0f);
  }
  if (m_bits > kFiniteBits || s_bits > kFiniteBits) keep_local(m_new, s_new, m_bits, s_bits);
  const float m_max = from_bits(m_bits);
  const float s_max = from_bits(s_bits);
  const EncodeScale m_sc = encode_scale(m_max, kSignedMax);
  const EncodeScale s_sc = encode_scale(s_max, kUnsignedMax);
  if (m_sc.second == 1.0f && s_sc.second == 1.0f)
    int8_encode<true>(m_new, s_new, m_sc, s_sc, b, key);
  else
    int8_encode<false>(m_new, s_new, m_sc, s_sc, b, key);
  *b.m_absmax = m_max;
  *b.s_absmax = s_max;
}

}  // namespace

extern "C" {

int sakura_offload_abi_version() { return 4; }

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
    const Int8Block block{p + begin, g + begin, m_codes + begin, m_absmax + b,
                          s_codes + begin, s_absmax + b, b};
    if (grad_scale == 1.0f)
      int8_block<false>(h, block, len, key);
    else
      int8_block<true>(h, block, len, key);
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
