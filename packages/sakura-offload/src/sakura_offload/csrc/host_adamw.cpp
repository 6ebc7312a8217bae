// sakura-offload: AdamW on host memory, for fp32, bf16 and blockwise 8-bit moments.
//
// A plain C ABI (called through ctypes), with no torch headers, so the first-use build
// takes seconds.  Built with -O3 -march=native -ffp-contract=off: no multiply-add is fused
// unless written as one (fmaf / _mm512_fmadd_ps), so the AVX-512 loops and the portable
// loops (the fallback on CPUs without AVX-512, and the tails) round identically, bit for
// bit (tests/test_host_adamw_speedpaths.py builds both and compares them).  Work is split
// across OpenMP threads in fixed chunks, so the result never depends on the thread count.
//
// The arithmetic mirrors torch.optim.AdamW's single-tensor path, operation by operation:
//   p = p * (1 - lr * wd)
//   m = fma(1 - beta1, g - m, m)                  (torch's lerp for weights < 0.5)
//   v = v * beta2 + ((1 - beta2) * g) * g         (addcmul)
//   p = p + (-lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps))
// (int8 moments: sqrt(v) * (1 / sqrt(bc2)), one division fewer; see adam_step.)
//
// Moment formats (the Python side, sakura_offload/host_optimizer/moments.py, holds the same
// definitions; a test checks that both decode every code to the same value):
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
// Where the time goes (Sapphire Rapids, 2 cores, 50 M parameters; benchmarks/offload_adamw.py):
// fp32 moments are bound by memory bandwidth (28 bytes per parameter), like torch's fused
// AdamW.  bf16 and int8 moves 20 and 16 bytes but were bound by instructions: the
// auto-vectorised loops spent more cycles per value than memory took.  What made their byte
// savings show: explicit AVX-512 loops (16 values per instruction, the hash's input as one
// vector addition per step, saturating packs for the codes), software prefetch a few KiB
// ahead on every stream (the hardware prefetcher stops at each 4 KiB page, and with 7
// streams per core it fell behind), and transparent huge pages for the optimizer's own state
// (sakura_offload_advise_huge; fewer TLB misses).  bf16 is then bound by memory.  int8 is
// bound by instructions on one thread (about 0.9 ns per value: decode, AdamW with its
// sqrt and division, the hash, the encode).  Its encode loop must wait for the block's
// maxima and needs no divider, so a block's codes are made inside the next block's update
// loop (int8_blocks_vec; 3-8 % less time than the two loops one after the other).  Tried
// without gain: the division as rcp14 + Newton steps + Markstein's correction (identical
// results on the tests, 9-13 % slower: the vector ports, not the divider, are the limit),
// longer or shorter prefetch distances.  Subnormal codes (a value under about 2^-14 of its
// block's absmax, common where a gradient has outliers) are fp32 denormals in the plain
// decode and encode, and each instruction that reads or writes one costs a microcode
// assist (about a hundred cycles): with 1-in-1000 gradient values 300x the rest a step took
// 1.3x as long.  Blocks whose codes were subnormal are decoded and encoded by exact integer
// and normal-range arithmetic instead (vec_decode_no_denormal, vec_scaled_no_denormal: the
// same real products, so the same roundings, unless the thread flushes denormals).
//
// Long file: the portable and the AVX-512 loops of three formats, kept side by side so that
// each vector loop sits next to the portable loop it must match bit for bit.

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adamw_math.h"  // the element arithmetic and formats, shared with adamw_cuda.cu

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(SAKURA_OFFLOAD_PORTABLE)
#include <immintrin.h>
#define SAKURA_AVX512 1
#else
#define SAKURA_AVX512 0
#endif

namespace {

constexpr int64_t kChunk = 16384;                 // values per parallel work item
constexpr int64_t kBlocksPerItem = kChunk / kBlock;  // int8 blocks per work item
constexpr int64_t kPrefetch = 1024;  // values ahead that every stream is prefetched (4 KiB of fp32)

// One element of AdamW; returns the new parameter, updates m and v, gives sqrt(v).
// kScaled: the gradient is multiplied by grad_scale (a product by 1 changes nothing, so
// without clipping it is left out).  kDivide: sqrt(v) / sqrt(bc2) as torch (fp32 and bf16
// moments); otherwise a product by inv_bc2 = 1 / sqrt(bc2) (int8 moments, within an ulp;
// their moments are approximate anyway).  The AVX-512 loops (vec_adam) do the same
// operations in the same order.
template <bool kScaled, bool kDivide>
inline float adam_step(const Hyper& h, float inv_bc2, float p, float g, float& m, float& v,
                       float& s) {
  if (kScaled) g = g * h.grad_scale;
  p = p * h.decay;
  m = fmaf(h.w1, g - m, m);
  v = v * h.beta2 + (h.c2 * g) * g;
  s = sqrtf(v);
  const float den = (kDivide ? s / h.bc2_sqrt : s * inv_bc2) + h.eps;
  return p + h.neg_step * (m / den);
}

template <typename T>
inline void prefetch(const T* where) {
  __builtin_prefetch(static_cast<const void*>(where), 0, 3);
}

// One tensor's update, as the batched entry point takes it.
struct Job {
  float* p;
  const float* g;
  void* m;        // fp32 / bf16 exp_avg, or int8 exp_avg codes
  void* v;        // fp32 / bf16 exp_avg_sq, or int8 sqrt(exp_avg_sq) codes
  float* m_absmax;  // int8 only
  float* v_absmax;  // int8 only
  int64_t n;
  float hyper[8];  // Hyper's fields, in its order
  uint32_t key;
  uint32_t reserved;
};
static_assert(sizeof(Job) == 96, "Job is mirrored by kernel.py's ctypes Structure");

inline Hyper hyper_of(const Job& job) {
  const float* f = job.hyper;
  return Hyper{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]};
}

// ---------------------------------------------------------------------------------------
// Portable loops (auto-vectorised; the fallback without AVX-512 and the tails)

template <bool kScaled>
void fp32_portable(const Hyper h, float* p, const float* g, float* m, float* v, int64_t begin,
                   int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float mi = m[i], vi = v[i], s;
    p[i] = adam_step<kScaled, true>(h, 0.0f, p[i], g[i], mi, vi, s);
    m[i] = mi;
    v[i] = vi;
  }
}

template <bool kScaled>
void bf16_portable(const Hyper h, float* p, const float* g, uint16_t* m, uint16_t* v,
                   int64_t begin, int64_t end, uint32_t key) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float mi = bf16_decode(m[i]), vi = bf16_decode(v[i]), s;
    p[i] = adam_step<kScaled, true>(h, 0.0f, p[i], g[i], mi, vi, s);
    const uint32_t r = element_bits(key, i);
    m[i] = bf16_encode_stochastic(mi, r & 0xFFFFU);
    v[i] = bf16_encode_stochastic(vi, r >> 16);
  }
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
// kFiniteBits, which a float max would not reliably tell).  kFast: a full block whose decode
// scales take the 2^112 in (both absmaxes under kFoldLimit, so the products are finite);
// otherwise len values and decode's own two multiplications.
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
    pb[j] = adam_step<kScaled, false>(h, inv_bc2, pb[j], gb[j], mi, vi, s);
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

// The end of a block's update once m_new / s_new (all kBlock values, padding zero) and the
// bits of their maxima are known: the codes and the absmaxes.
inline void int8_finish(float* m_new, float* s_new, uint32_t m_bits, uint32_t s_bits,
                        const Int8Block& b, uint32_t key);

// One block of the int8 update, portable loops: len values (a full block is kBlock).
template <bool kScaled>
inline void int8_block_portable(const Hyper& h, const Int8Block& b, int64_t len,
                                uint32_t key) {
  alignas(64) float m_new[kBlock];
  alignas(64) float s_new[kBlock];
  uint32_t m_bits, s_bits;
  if (len == kBlock && *b.m_absmax < kFoldLimit && *b.s_absmax < kFoldLimit) {
    int8_update<true, kScaled>(h, b, len, m_new, s_new, m_bits, s_bits);
  } else {
    int8_update<false, kScaled>(h, b, len, m_new, s_new, m_bits, s_bits);
    std::fill(m_new + len, m_new + kBlock, 0.0f);
    std::fill(s_new + len, s_new + kBlock, 0.0f);
  }
  int8_finish(m_new, s_new, m_bits, s_bits, b, key);
}

inline void int8_finish(float* m_new, float* s_new, uint32_t m_bits, uint32_t s_bits,
                        const Int8Block& b, uint32_t key) {
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

#if SAKURA_AVX512
// ---------------------------------------------------------------------------------------
// AVX-512 loops: 16 values per instruction, the same operations as the portable ones.

struct VecHyper {
  __m512 decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, inv_bc2, grad_scale;
  explicit VecHyper(const Hyper& h)
      : decay(_mm512_set1_ps(h.decay)),
        w1(_mm512_set1_ps(h.w1)),
        beta2(_mm512_set1_ps(h.beta2)),
        c2(_mm512_set1_ps(h.c2)),
        eps(_mm512_set1_ps(h.eps)),
        neg_step(_mm512_set1_ps(h.neg_step)),
        bc2_sqrt(_mm512_set1_ps(h.bc2_sqrt)),
        inv_bc2(_mm512_set1_ps(1.0f / h.bc2_sqrt)),
        grad_scale(_mm512_set1_ps(h.grad_scale)) {}
};

// adam_step on 16 values
template <bool kScaled, bool kDivide>
inline __m512 vec_adam(const VecHyper& h, __m512 p, __m512 g, __m512& m, __m512& v,
                       __m512& s) {
  if (kScaled) g = _mm512_mul_ps(g, h.grad_scale);
  p = _mm512_mul_ps(p, h.decay);
  m = _mm512_fmadd_ps(h.w1, _mm512_sub_ps(g, m), m);
  v = _mm512_add_ps(_mm512_mul_ps(v, h.beta2), _mm512_mul_ps(_mm512_mul_ps(h.c2, g), g));
  s = _mm512_sqrt_ps(v);
  const __m512 scaled = kDivide ? _mm512_div_ps(s, h.bc2_sqrt) : _mm512_mul_ps(s, h.inv_bc2);
  const __m512 den = _mm512_add_ps(scaled, h.eps);
  return _mm512_add_ps(p, _mm512_mul_ps(h.neg_step, _mm512_div_ps(m, den)));
}

inline __m512i vec_mix32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// i * 0x9E3779B9 + key for the 16 values from i (the hash's input, element_bits)
inline __m512i vec_counter(int64_t i, uint32_t key) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i steps = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(0x9E3779B9U)));
  const uint32_t base = static_cast<uint32_t>(i) * 0x9E3779B9U + key;
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base)), steps);
}

// 16 bf16 values to fp32 (exact: the bits shifted up)
inline __m512 vec_bf16_load(const uint16_t* a) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
#if defined(__AVX512BF16__)
  return _mm512_cvtpbh_ps((__m256bh)h);
#else
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#endif
}

// bf16_encode_stochastic on 16 values: (bits + r16) >> 16, the low halves of the 32-bit
// lanes packed.  (AVX512_BF16's vcvtne2ps2bf16 rounds to nearest even and flushes
// denormals, neither of which is this rounding, so the pack is vpmovdw.)
inline void vec_bf16_store(uint16_t* a, __m512 x, __m512i r16) {
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(x), r16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

template <bool kScaled>
void fp32_vec(const Hyper h, float* p, const float* g, float* m, float* v, int64_t begin,
              int64_t end) {
  const VecHyper vh(h);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    prefetch(p + i + kPrefetch);
    prefetch(g + i + kPrefetch);
    prefetch(m + i + kPrefetch);
    prefetch(v + i + kPrefetch);
    __m512 mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i), s;
    const __m512 pi =
        vec_adam<kScaled, true>(vh, _mm512_loadu_ps(p + i), _mm512_loadu_ps(g + i), mi, vi, s);
    _mm512_storeu_ps(p + i, pi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
  }
  fp32_portable<kScaled>(h, p, g, m, v, i, end);
}

template <bool kScaled>
void bf16_vec(const Hyper h, float* p, const float* g, uint16_t* m, uint16_t* v, int64_t begin,
              int64_t end, uint32_t key) {
  const VecHyper vh(h);
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  const __m512i step = _mm512_set1_epi32(static_cast<int>(16U * 0x9E3779B9U));
  __m512i counter = vec_counter(begin, key);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    prefetch(p + i + kPrefetch);
    prefetch(g + i + kPrefetch);
    if ((i & 31) == 0) {  // a cache line holds 32 bf16 values
      prefetch(m + i + kPrefetch);
      prefetch(v + i + kPrefetch);
    }
    __m512 mi = vec_bf16_load(m + i), vi = vec_bf16_load(v + i), s;
    const __m512 pi =
        vec_adam<kScaled, true>(vh, _mm512_loadu_ps(p + i), _mm512_loadu_ps(g + i), mi, vi, s);
    _mm512_storeu_ps(p + i, pi);
    const __m512i r = vec_mix32(counter);
    counter = _mm512_add_epi32(counter, step);
    vec_bf16_store(m + i, mi, _mm512_and_si512(r, low));
    vec_bf16_store(v + i, vi, _mm512_srli_epi32(r, 16));
  }
  bf16_portable<kScaled>(h, p, g, m, v, i, end, key);
}

// signed_encode_nearest on 16 scaled values, as 16 bytes
inline __m128i vec_signed_codes(__m512 y) {
  const __m512i b = _mm512_castps_si512(y);
  __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  mag = _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(0x7FFFF)), odd);
  mag = _mm512_min_epu32(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(127));
  // mag | ((b >> 24) & 0x80)
  const __m512i code = _mm512_ternarylogic_epi32(mag, _mm512_srli_epi32(b, 24),
                                                 _mm512_set1_epi32(0x80), 0xF8);
  return _mm512_cvtepi32_epi8(code);
}

// unsigned_encode_stochastic on 16 scaled values with the dither's random bits already in
// bits 3..18 of shifted (the pack saturates at 255)
inline __m128i vec_unsigned_codes(__m512 y, __m512i shifted) {
  // (shifted & 0x7FFF8) | 4
  const __m512i dither = _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi32(0x7FFF8),
                                                   _mm512_set1_epi32(4), 0xEA);
  const __m512i sum = _mm512_add_epi32(_mm512_castps_si512(y), dither);
  return _mm512_cvtusepi32_epi8(_mm512_srli_epi32(sum, 19));
}

// A block whose new moments and scales are known and whose codes are still to be written
// (by the next block's update loop, int8_update_vec, or by encode_all).
struct PendingCodes {
  const float* m_new;
  const float* s_new;
  uint8_t* m_codes;
  uint8_t* s_codes;
  __m512 m_first, m_second, s_first, s_second;
  __m512 m_first_149, s_first_149;  // first * 2^149 (steps 3 only)
  __m512i base;  // the pair hash's input for pair 0
  int steps;     // 0: nothing pending; 1: both scales one factor; 2: two factors;
                 // 3: one factor, products under 2^-126 made without denormals
};

// tiny: the block is expected to have subnormal codes (its old codes had); taken where
// exact (one factor, first * 2^149 finite) and where the thread does not flush denormal
// results to zero (MXCSR.FTZ; then the plain product is what the portable path gives).
inline PendingCodes pending_codes(const float* m_new, const float* s_new, EncodeScale m_sc,
                                  EncodeScale s_sc, const Int8Block& b, uint32_t key,
                                  bool tiny) {
  constexpr int64_t kHalf = kBlock / 2;
  const bool one = m_sc.second == 1.0f && s_sc.second == 1.0f;
  const float m_149 = std::ldexp(m_sc.first, 149);
  const float s_149 = std::ldexp(s_sc.first, 149);
  const bool exact_tiny = tiny && one && is_finite(m_149) && is_finite(s_149) &&
                          (_mm_getcsr() & 0x8000U) == 0;
  return PendingCodes{
      m_new, s_new, b.m_codes, b.s_codes,
      _mm512_set1_ps(m_sc.first), _mm512_set1_ps(m_sc.second),
      _mm512_set1_ps(s_sc.first), _mm512_set1_ps(s_sc.second),
      _mm512_set1_ps(exact_tiny ? m_149 : 0.0f), _mm512_set1_ps(exact_tiny ? s_149 : 0.0f),
      _mm512_set1_epi32(
          static_cast<int>(static_cast<uint32_t>(b.index * kHalf) * 0x9E3779B9U + key)),
      exact_tiny ? 3 : (one ? 1 : 2)};
}

// x * first (first > 0) without an fp32 denormal result (a microcode assist): lanes whose
// product is under 2^-126 get the denormal's bits as an integer, |x| * first * 2^149
// rounded to nearest even: hi = RN(|x| * first_149) (first_149 = first * 2^149, exact),
// lo = |x| * first_149 - hi (exact, an fma); hi rounded to an integer, except where hi is
// a half-integer and lo is not zero: then lo's sign decides.  The sign is x's.
inline __m512 vec_scaled_no_denormal(__m512 x, __m512 first, __m512 first_149) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 hi = _mm512_mul_ps(ax, first_149);
  const __mmask16 tiny = _mm512_cmp_ps_mask(hi, _mm512_set1_ps(0x1p23f), _CMP_LT_OQ);
  if (tiny == 0) return _mm512_mul_ps(x, first);
  const __m512 normal = _mm512_mul_ps(_mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), x), first);
  const __m512 lo = _mm512_fmsub_ps(ax, first_149, hi);
  __m512 n = _mm512_roundscale_ps(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 down = _mm512_roundscale_ps(hi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __mmask16 half = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(hi, n)),
                                            _mm512_set1_ps(0.5f), _CMP_EQ_OQ);
  const __m512 zero = _mm512_setzero_ps();
  n = _mm512_mask_mov_ps(n, half & _mm512_cmp_ps_mask(lo, zero, _CMP_LT_OQ), down);
  n = _mm512_mask_mov_ps(n, half & _mm512_cmp_ps_mask(lo, zero, _CMP_GT_OQ),
                         _mm512_add_ps(down, _mm512_set1_ps(1.0f)));
  // n | (x & sign), as bits
  const __m512i bits = _mm512_ternarylogic_epi32(
      _mm512_cvttps_epi32(n), _mm512_castps_si512(x),
      _mm512_set1_epi32(static_cast<int>(0x80000000U)), 0xF8);
  return _mm512_mask_mov_ps(normal, tiny, _mm512_castsi512_ps(bits));
}

// int8_encode on the pairs (j .. j + 15, j + 128 .. j + 143): 64 codes.  kTiny: steps 3.
template <bool kOneStep, bool kTiny = false>
inline void encode_pairs_vec(const PendingCodes& e, int j) {
  constexpr int kHalf = kBlock / 2;
  const auto m_scaled = [&](const float* x) {
    if (kTiny) return vec_scaled_no_denormal(_mm512_load_ps(x), e.m_first, e.m_first_149);
    const __m512 y = _mm512_mul_ps(_mm512_load_ps(x), e.m_first);
    return kOneStep ? y : _mm512_mul_ps(y, e.m_second);
  };
  const auto s_scaled = [&](const float* x) {
    if (kTiny) return vec_scaled_no_denormal(_mm512_load_ps(x), e.s_first, e.s_first_149);
    const __m512 y = _mm512_mul_ps(_mm512_load_ps(x), e.s_first);
    return kOneStep ? y : _mm512_mul_ps(y, e.s_second);
  };
  const __m512i steps = _mm512_load_si512(kPairSteps.step + j);
  const __m512i r = vec_mix32(_mm512_add_epi32(e.base, steps));
  auto* mb = reinterpret_cast<__m128i*>(e.m_codes + j);
  auto* sb = reinterpret_cast<__m128i*>(e.s_codes + j);
  _mm_storeu_si128(mb, vec_signed_codes(m_scaled(e.m_new + j)));
  _mm_storeu_si128(mb + kHalf / 16, vec_signed_codes(m_scaled(e.m_new + j + kHalf)));
  _mm_storeu_si128(sb, vec_unsigned_codes(s_scaled(e.s_new + j), _mm512_slli_epi32(r, 3)));
  _mm_storeu_si128(sb + kHalf / 16,
                   vec_unsigned_codes(s_scaled(e.s_new + j + kHalf), _mm512_srli_epi32(r, 13)));
}

inline void encode_all_vec(const PendingCodes& e) {
  for (int j = 0; j < kBlock / 2; j += 16) {
    if (e.steps == 1)
      encode_pairs_vec<true>(e, j);
    else if (e.steps == 2)
      encode_pairs_vec<false>(e, j);
    else
      encode_pairs_vec<true, true>(e, j);
  }
}

// code_bits * fold without an fp32 denormal operand (which costs the CPU a microcode assist,
// about a hundred cycles): a lane whose code is subnormal and not zero has code_bits
// +-k * 2^(shift - 149) (k its mantissa); it is computed as +-k * fold_sub, fold_sub =
// fold * 2^(shift - 149), a normal float (the caller checks): the same real product, so the
// same single rounding.  The other lanes as before (the subnormal ones zeroed first).
inline __m512 vec_decode_no_denormal(__m512i bits, __m512 fold, __m512 fold_sub, int shift) {
  const __m512i mantissa = _mm512_set1_epi32(0x007FFFFF);
  const __mmask16 sub = _mm512_mask_test_epi32_mask(
      _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7F800000)), bits, mantissa);
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_maskz_mov_epi32(~sub, bits)), fold);
  const __m512i k = _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_and_si512(bits, mantissa), shift)));
  // k | (bits & sign)
  const __m512 signed_k = _mm512_castsi512_ps(
      _mm512_ternarylogic_epi32(k, bits, _mm512_set1_epi32(static_cast<int>(0x80000000U)), 0xF8));
  return _mm512_mask_mul_ps(value, sub, signed_k, fold_sub);
}

// Whether a block holds a subnormal code other than zero: signed codes with exponent bits
// (0x78) clear and mantissa bits (0x07) not, unsigned codes 1..15.
inline bool has_subnormal_codes(const uint8_t* m_codes, const uint8_t* s_codes) {
  __mmask64 any = 0;
  for (int j = 0; j < kBlock; j += 64) {
    const __m512i mc = _mm512_loadu_si512(m_codes + j);
    const __m512i sc = _mm512_loadu_si512(s_codes + j);
    any |= _mm512_mask_test_epi8_mask(_mm512_testn_epi8_mask(mc, _mm512_set1_epi8(0x78)), mc,
                                      _mm512_set1_epi8(0x07));
    any |= _mm512_mask_test_epi8_mask(
        _mm512_testn_epi8_mask(sc, _mm512_set1_epi8(static_cast<char>(0xF0))), sc,
        _mm512_set1_epi8(0x0F));
  }
  return any != 0;
}

// int8_update<true, kScaled> on a full block, 16 values at a time, in the order of the
// pairs (j, j + 128) (the maxima do not depend on the order).  kPending (1 or 2, the
// previous block's PendingCodes::steps; 0: none): that block's codes are made in the same
// loop, one pair chunk per step.  The update's sqrt and division wait on the divider while
// the codes' integer work needs none, so the two overlap (a block's codes cannot be made
// in its own update loop: they need its maxima).
template <bool kScaled, int kPending, bool kSubnormal>
inline void int8_update_vec(const VecHyper& vh, const Int8Block& b, float* m_new,
                            float* s_new, uint32_t& m_top, uint32_t& s_top,
                            const PendingCodes& pending) {
  const float m_fold_1 = *b.m_absmax / kSignedMax * kDecodeShift;
  const float s_fold_1 = *b.s_absmax / kUnsignedMax * kDecodeShift;
  const __m512 m_fold = _mm512_set1_ps(m_fold_1);
  const __m512 s_fold = _mm512_set1_ps(s_fold_1);
  // the subnormal codes' scales (exact: kSubnormal only where they are normal floats)
  const __m512 m_fold_sub = _mm512_set1_ps(kSubnormal ? std::ldexp(m_fold_1, 20 - 149) : 0.0f);
  const __m512 s_fold_sub = _mm512_set1_ps(kSubnormal ? std::ldexp(s_fold_1, 19 - 149) : 0.0f);
  const __m512i sign_exp_mantissa = _mm512_set1_epi32(static_cast<int>(0x87F00000U));
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i m_max = _mm512_setzero_si512();
  __m512i s_max = _mm512_setzero_si512();
  const auto update = [&](int j) {
    prefetch(b.p + j + kPrefetch);
    prefetch(b.g + j + kPrefetch);
    if ((j & 63) == 0) {
      prefetch(b.m_codes + j + kPrefetch);
      prefetch(b.s_codes + j + kPrefetch);
    }
    const __m128i mc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.m_codes + j));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.s_codes + j));
    // signed_code_bits / unsigned_code_bits, times the folded scales
    const __m512i m_bits =
        _mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(mc), 20), sign_exp_mantissa);
    const __m512i s_bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(sc), 19);
    __m512 mi = kSubnormal ? vec_decode_no_denormal(m_bits, m_fold, m_fold_sub, 20)
                           : _mm512_mul_ps(_mm512_castsi512_ps(m_bits), m_fold);
    const __m512 so = kSubnormal ? vec_decode_no_denormal(s_bits, s_fold, s_fold_sub, 19)
                                 : _mm512_mul_ps(_mm512_castsi512_ps(s_bits), s_fold);
    __m512 vi = _mm512_mul_ps(so, so), s;
    const __m512 pi =
        vec_adam<kScaled, false>(vh, _mm512_loadu_ps(b.p + j), _mm512_loadu_ps(b.g + j), mi, vi, s);
    _mm512_storeu_ps(b.p + j, pi);
    _mm512_store_ps(m_new + j, mi);
    _mm512_store_ps(s_new + j, s);
    m_max = _mm512_max_epu32(m_max, _mm512_and_si512(_mm512_castps_si512(mi), magnitude));
    s_max = _mm512_max_epu32(s_max, _mm512_and_si512(_mm512_castps_si512(s), magnitude));
  };
  for (int j = 0; j < kBlock / 2; j += 16) {
    update(j);
    update(j + kBlock / 2);
    if (kPending != 0) encode_pairs_vec<kPending != 2, kPending == 3>(pending, j);
  }
  m_top = _mm512_reduce_max_epu32(m_max);
  s_top = _mm512_reduce_max_epu32(s_max);
}

template <bool kScaled, bool kSubnormal>
inline void int8_update_dispatch(const VecHyper& vh, const Int8Block& b, float* m_new,
                                 float* s_new, uint32_t& m_top, uint32_t& s_top,
                                 const PendingCodes& pending) {
  switch (pending.steps) {
    case 0:
      int8_update_vec<kScaled, 0, kSubnormal>(vh, b, m_new, s_new, m_top, s_top, pending);
      break;
    case 1:
      int8_update_vec<kScaled, 1, kSubnormal>(vh, b, m_new, s_new, m_top, s_top, pending);
      break;
    case 2:
      int8_update_vec<kScaled, 2, kSubnormal>(vh, b, m_new, s_new, m_top, s_top, pending);
      break;
    default:
      int8_update_vec<kScaled, 3, kSubnormal>(vh, b, m_new, s_new, m_top, s_top, pending);
  }
}

// The int8 blocks [first, last) of one tensor.  Full blocks with small absmaxes take the
// AVX-512 loops, their codes made during the next block's update (software pipelining,
// two buffers of new moments); the others, and a block with a non-finite new moment, the
// portable path, after the pending codes are written.
template <bool kScaled>
void int8_blocks_vec(const Hyper& h, const Job& job, int64_t first, int64_t last) {
  const VecHyper vh(h);
  auto* mc = static_cast<uint8_t*>(job.m);
  auto* sc = static_cast<uint8_t*>(job.v);
  alignas(64) float m_new[2][kBlock];
  alignas(64) float s_new[2][kBlock];
  PendingCodes pending{};
  pending.steps = 0;
  int buffer = 0;
  const bool denormals_read = (_mm_getcsr() & 0x0040U) == 0;  // MXCSR.DAZ clear
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = b * kBlock;
    const int64_t len = std::min(job.n, begin + kBlock) - begin;
    const Int8Block block{job.p + begin, job.g + begin, mc + begin, job.m_absmax + b,
                          sc + begin,    job.v_absmax + b, b};
    if (len != kBlock || !(*block.m_absmax < kFoldLimit && *block.s_absmax < kFoldLimit)) {
      if (pending.steps != 0) encode_all_vec(pending);
      pending.steps = 0;
      int8_block_portable<kScaled>(h, block, len, job.key);
      continue;
    }
    float* m_out = m_new[buffer];
    float* s_out = s_new[buffer];
    uint32_t m_bits, s_bits;
    // subnormal codes decoded without fp32 denormals where their scales allow it (absmaxes
    // above about 1e-32) and where the thread reads denormals as such (under
    // denormals-are-zero the portable decode reads them as zero: so does this one)
    const bool subnormal = denormals_read && *block.m_absmax / kSignedMax * kDecodeShift >= 0x1p3f &&
                           *block.s_absmax / kUnsignedMax * kDecodeShift >= 0x1p4f &&
                           has_subnormal_codes(block.m_codes, block.s_codes);
    if (subnormal)
      int8_update_dispatch<kScaled, true>(vh, block, m_out, s_out, m_bits, s_bits, pending);
    else
      int8_update_dispatch<kScaled, false>(vh, block, m_out, s_out, m_bits, s_bits, pending);
    pending.steps = 0;
    if (m_bits > kFiniteBits || s_bits > kFiniteBits) {
      int8_finish(m_out, s_out, m_bits, s_bits, block, job.key);  // rare: the portable path
      continue;
    }
    const float m_max = from_bits(m_bits);
    const float s_max = from_bits(s_bits);
    pending = pending_codes(m_out, s_out, encode_scale(m_max, kSignedMax),
                            encode_scale(s_max, kUnsignedMax), block, job.key, subnormal);
    *block.m_absmax = m_max;  // read by this block's decode only, done
    *block.s_absmax = s_max;
    buffer ^= 1;
  }
  if (pending.steps != 0) encode_all_vec(pending);
}
#endif  // SAKURA_AVX512

// ---------------------------------------------------------------------------------------
// Work items: one tensor's values [begin, end) (fp32, bf16) or blocks (int8).

enum Format { kFp32 = 0, kBf16 = 1, kInt8 = 2 };

template <bool kScaled>
void run_item(int format, const Job& job, int64_t item) {
  const Hyper h = hyper_of(job);
  if (format == kInt8) {
    const int64_t blocks = (job.n + kBlock - 1) / kBlock;
    const int64_t first = item * kBlocksPerItem;
    const int64_t last = std::min(blocks, first + kBlocksPerItem);
#if SAKURA_AVX512
    int8_blocks_vec<kScaled>(h, job, first, last);
#else
    auto* mc = static_cast<uint8_t*>(job.m);
    auto* sc = static_cast<uint8_t*>(job.v);
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kBlock;
      const int64_t len = std::min(job.n, begin + kBlock) - begin;
      const Int8Block block{job.p + begin, job.g + begin, mc + begin, job.m_absmax + b,
                            sc + begin,    job.v_absmax + b, b};
      int8_block_portable<kScaled>(h, block, len, job.key);
    }
#endif
    return;
  }
  const int64_t begin = item * kChunk;
  const int64_t end = std::min(job.n, begin + kChunk);
  if (format == kFp32) {
    auto* m = static_cast<float*>(job.m);
    auto* v = static_cast<float*>(job.v);
#if SAKURA_AVX512
    fp32_vec<kScaled>(h, job.p, job.g, m, v, begin, end);
#else
    fp32_portable<kScaled>(h, job.p, job.g, m, v, begin, end);
#endif
  } else {
    auto* m = static_cast<uint16_t*>(job.m);
    auto* v = static_cast<uint16_t*>(job.v);
#if SAKURA_AVX512
    bf16_vec<kScaled>(h, job.p, job.g, m, v, begin, end, job.key);
#else
    bf16_portable<kScaled>(h, job.p, job.g, m, v, begin, end, job.key);
#endif
  }
}

inline int64_t items_of(const Job& job) { return (job.n + kChunk - 1) / kChunk; }

// Every tensor's update, their work items split across threads in one parallel region (a
// fixed split: the result does not depend on the thread count).
void run_jobs(int format, const Job* jobs, int64_t count, int threads) {
  int64_t total = 0;
  for (int64_t k = 0; k < count; ++k) total += items_of(jobs[k]);
#pragma omp parallel num_threads(threads) if (threads > 1 && total > 1)
  {
    int64_t job = 0, first_item = 0;  // each thread walks the jobs forward
#pragma omp for schedule(static)
    for (int64_t t = 0; t < total; ++t) {
      while (t - first_item >= items_of(jobs[job])) first_item += items_of(jobs[job++]);
      const Job& j = jobs[job];
      if (j.hyper[7] == 1.0f)
        run_item<false>(format, j, t - first_item);
      else
        run_item<true>(format, j, t - first_item);
    }
  }
}

Job make_job(float* p, const float* g, void* m, void* v, float* m_absmax, float* v_absmax,
             int64_t n, const Hyper& h, uint32_t key) {
  return Job{p, g, m, v, m_absmax, v_absmax, n,
             {h.decay, h.w1, h.beta2, h.c2, h.eps, h.neg_step, h.bc2_sqrt, h.grad_scale},
             key, 0};
}

}  // namespace

extern "C" {

int sakura_offload_abi_version() { return 5; }

// 16 where the AVX-512 loops are compiled in, 1 for the portable build.
int sakura_offload_vector_width() { return SAKURA_AVX512 ? 16 : 1; }

// Every code's value, for the test that holds this file and moments.py to one definition.
void sakura_decode_tables(float* signed_values, float* unsigned_values) {
  for (int c = 0; c < 256; ++c) {
    signed_values[c] = signed_decode(static_cast<uint8_t>(c));
    unsigned_values[c] = unsigned_decode(static_cast<uint8_t>(c));
  }
}

// Ask for transparent huge pages over the 2 MiB pages wholly inside [data, data + bytes)
// (before they are first written: pages already there are only merged later, by the
// kernel's khugepaged).  Returns the bytes advised; 0 when none or where madvise refuses.
int64_t sakura_offload_advise_huge(void* data, int64_t bytes) {
#if defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t stop = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) &
                         ~(kHuge - 1);
  if (bytes <= 0 || stop <= start) return 0;
  if (madvise(reinterpret_cast<void*>(start), stop - start, MADV_HUGEPAGE) != 0) return 0;
  return static_cast<int64_t>(stop - start);
#else
  (void)data;
  (void)bytes;
  return 0;
#endif
}

// Several tensors' updates in one call (format: 0 fp32, 1 bf16, 2 int8; see Job).
void sakura_adamw_batch(int format, const Job* jobs, int64_t count, int threads) {
  if (format < kFp32 || format > kInt8 || count <= 0) return;
  run_jobs(format, jobs, count, threads);
}

void sakura_adamw_fp32(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                       float w1, float beta2, float c2, float eps, float neg_step,
                       float bc2_sqrt, float grad_scale, int threads) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  const Job job = make_job(p, g, m, v, nullptr, nullptr, n, h, 0);
  run_jobs(kFp32, &job, 1, threads);
}

void sakura_adamw_bf16(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                       float decay, float w1, float beta2, float c2, float eps, float neg_step,
                       float bc2_sqrt, float grad_scale, uint32_t key, int threads) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  const Job job = make_job(p, g, m, v, nullptr, nullptr, n, h, key);
  run_jobs(kBf16, &job, 1, threads);
}

// m_codes / s_codes hold ceil(n / 256) * 256 bytes; m_absmax / s_absmax one float per block.
void sakura_adamw_int8(float* p, const float* g, uint8_t* m_codes, float* m_absmax,
                       uint8_t* s_codes, float* s_absmax, int64_t n, float decay, float w1,
                       float beta2, float c2, float eps, float neg_step, float bc2_sqrt,
                       float grad_scale, uint32_t key, int threads) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  const Job job = make_job(p, g, m_codes, s_codes, m_absmax, s_absmax, n, h, key);
  run_jobs(kInt8, &job, 1, threads);
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
