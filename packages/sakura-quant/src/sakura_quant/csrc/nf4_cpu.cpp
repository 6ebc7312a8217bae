// NF4 quantize / dequantize on the CPU, one fused pass each (sakura-quant).
//
// A plain C ABI with no torch headers, so the build takes seconds; called through ctypes.
// The arithmetic is the pure-torch path's, step for step, so both give the same bits:
//   absmax = max |x| over the block (fp32)
//   inv    = 1.0f / max(absmax, 1e-38f)
//   s      = clamp(x * inv, -1, 1)
//   index  = number of the 15 midpoints strictly below s   (a tie goes to the lower code)
//   bytes  : even index in the high nibble; an odd count pads with the code of 0.0
// Dequantize: code[index] * absmax in fp32, then rounded to nearest even for bf16.
//
// Every entry point is given the element count of each buffer it reads or writes and checks
// them (and the block size) before touching any memory: a call whose sizes disagree returns
// SAKURA_QUANT_BAD_ARGUMENTS and reads nothing.  The sizes come from a model file in the end,
// so they are never trusted.  Quantize also refuses NaN / Inf input (returns their count):
// no code can store them, and the torch path refuses them too.
#include <stdint.h>
#include <float.h>
#include <string.h>
#if defined(__SSSE3__)
#include <immintrin.h>
#endif

#define SAKURA_QUANT_ABI 2
#define SAKURA_QUANT_BAD_ARGUMENTS (-1)
#define SAKURA_QUANT_MAX_BLOCK (((int64_t)1) << 31)
#define SAKURA_QUANT_MAX_COUNT (((int64_t)1) << 62)

extern "C" int sakura_quant_abi_version(void) { return SAKURA_QUANT_ABI; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

struct F32 {
    static inline float get(const void* p, int64_t i) { return ((const float*)p)[i]; }
};
struct BF16 {
    static inline float get(const void* p, int64_t i) { return bf16_to_f32(((const uint16_t*)p)[i]); }
};

// Values are handled in chunks of CHUNK so the scaling and the midpoint counts run as
// simple loops over arrays, which the compiler vectorizes.
#define CHUNK 256

template <typename T>
static int64_t count_non_finite(const void* x, int64_t n, int threads) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : bad)
    for (int64_t i = 0; i < n; ++i) {
        const float a = T::get(x, i);
        bad += !(a <= FLT_MAX && a >= -FLT_MAX);  // NaN fails both comparisons
    }
    return bad;
}

template <typename T>
static void quantize(const void* x, int64_t n, int64_t block, const float* mid, float* absmax,
                     uint8_t* out, int threads) {
    const int64_t blocks = (n + block - 1) / block;
    uint8_t zero_index = 0;
    for (int k = 0; k < 15; ++k) zero_index += 0.0f > mid[k];
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * block;
        const int64_t end = start + block < n ? start + block : n;
        float m = 0.0f;
        for (int64_t i = start; i < end; ++i) {
            float a = T::get(x, i);
            a = a < 0 ? -a : a;
            m = a > m ? a : m;
        }
        absmax[b] = m;
        const float inv = 1.0f / (m > 1e-38f ? m : 1e-38f);
        float s[CHUNK];
        uint8_t idx[CHUNK + 1];
        for (int64_t c = start; c < end; c += CHUNK) {
            const int len = (int)(end - c < CHUNK ? end - c : CHUNK);
            for (int j = 0; j < len; ++j) {
                float v = T::get(x, c + j) * inv;
                v = v < -1.0f ? -1.0f : v;
                s[j] = v > 1.0f ? 1.0f : v;
                idx[j] = 0;
            }
            for (int k = 0; k < 15; ++k) {
                const float mk = mid[k];
                for (int j = 0; j < len; ++j) idx[j] += s[j] > mk;
            }
            // block and CHUNK are even, so chunks start on a byte boundary.
            if (len & 1) idx[len] = zero_index;
            uint8_t* o = out + ((c - 0) >> 1);
            const int pairs = (len + 1) >> 1;
            for (int j = 0; j < pairs; ++j) o[j] = (uint8_t)((idx[2 * j] << 4) | idx[2 * j + 1]);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One block on AVX-512: the 16 products code[k] * scale are formed once in a register, then
// each 16 packed bytes (32 values) are split into nibble indices and looked up with one
// permute per 16 fp32 values (vpermps) or per 32 bf16 values (vpermw).  The products and
// the bf16 rounding (nearest even, NaN kept quiet) are the scalar path's, so the bits are
// the same.  Returns the first index it did not handle.
static inline __m512 scaled_codes(const float* code, float scale) {
    return _mm512_mul_ps(_mm512_loadu_ps(code), _mm512_set1_ps(scale));
}

static inline __m512i bf16_codes(__m512 products) {
    const __m512i u = _mm512_castps_si512(products);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                 _mm512_set1_epi32(0x7f800000));
    const __m512i bits = _mm512_mask_blend_epi32(nan, rounded, quiet);
    return _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bits));  // 16 bf16 in the low half
}

static inline void nibbles(const uint8_t* packed, __m128i* first, __m128i* second) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)packed);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i lo = _mm_and_si128(bytes, low4);
    *first = _mm_unpacklo_epi8(hi, lo);   // values 0..15: even index from the high nibble
    *second = _mm_unpackhi_epi8(hi, lo);  // values 16..31
}

static int64_t dequantize_block_avx512(const uint8_t* data, float scale, int64_t i, int64_t end,
                                       const float* code, float* out) {
    const __m512 table = scaled_codes(code, scale);
    for (; end - i >= 32; i += 32) {
        __m128i first, second;
        nibbles(data + (i >> 1), &first, &second);
        _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(first), table));
        _mm512_storeu_ps(out + i + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(second), table));
    }
    return i;
}

static int64_t dequantize_block_avx512(const uint8_t* data, float scale, int64_t i, int64_t end,
                                       const float* code, uint16_t* out) {
    if (end - i < 32) return i;
    const __m512i table = bf16_codes(scaled_codes(code, scale));
    for (; end - i >= 32; i += 32) {
        __m128i first, second;
        nibbles(data + (i >> 1), &first, &second);
        const __m512i index = _mm512_cvtepu8_epi16(_mm256_set_m128i(second, first));
        _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(index, table));
    }
    return i;
}
#endif

template <typename Out>
static void dequantize(const uint8_t* data, const float* absmax, int64_t n, int64_t block,
                       const float* code, Out* out, int threads) {
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * block;
        const int64_t end = start + block < n ? start + block : n;
        const float scale = absmax[b];
        int64_t i = start;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        i = dequantize_block_avx512(data, scale, i, end, code, out);
        if (i == end) continue;
#endif
        // code[k] * scale, rounded once to the output type: the same value per element as
        // multiplying each one, computed 16 times per block instead of once per value.
        Out table[16];
        for (int k = 0; k < 16; ++k) {
            const float v = code[k] * scale;
            if constexpr (sizeof(Out) == 4) table[k] = v; else table[k] = f32_to_bf16(v);
        }
#if defined(__SSSE3__)
        // 16 packed bytes (32 values) at a time: the byte planes of the 16-entry table are
        // looked up with pshufb, then interleaved back into whole values.
        if (end - i >= 32) {
            uint8_t planes[sizeof(Out)][16];
            for (int k = 0; k < 16; ++k) {
                uint8_t bytes[sizeof(Out)];
                memcpy(bytes, &table[k], sizeof(Out));
                for (unsigned p = 0; p < sizeof(Out); ++p) planes[p][k] = bytes[p];
            }
            __m128i plane[sizeof(Out)];
            for (unsigned p = 0; p < sizeof(Out); ++p)
                plane[p] = _mm_loadu_si128((const __m128i*)planes[p]);
            const __m128i low4 = _mm_set1_epi8(0x0f);
            for (; end - i >= 32; i += 32) {
                const __m128i packed = _mm_loadu_si128((const __m128i*)(data + (i >> 1)));
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
                const __m128i lo = _mm_and_si128(packed, low4);
                const __m128i first = _mm_unpacklo_epi8(hi, lo);   // values 0..15
                const __m128i second = _mm_unpackhi_epi8(hi, lo);  // values 16..31
                if constexpr (sizeof(Out) == 2) {
                    const __m128i a0 = _mm_shuffle_epi8(plane[0], first);
                    const __m128i a1 = _mm_shuffle_epi8(plane[1], first);
                    const __m128i b0 = _mm_shuffle_epi8(plane[0], second);
                    const __m128i b1 = _mm_shuffle_epi8(plane[1], second);
                    __m128i* o = (__m128i*)(out + i);
                    _mm_storeu_si128(o + 0, _mm_unpacklo_epi8(a0, a1));
                    _mm_storeu_si128(o + 1, _mm_unpackhi_epi8(a0, a1));
                    _mm_storeu_si128(o + 2, _mm_unpacklo_epi8(b0, b1));
                    _mm_storeu_si128(o + 3, _mm_unpackhi_epi8(b0, b1));
                } else {
                    const __m128i idx[2] = {first, second};
                    __m128i* o = (__m128i*)(out + i);
                    for (int h = 0; h < 2; ++h) {
                        const __m128i p0 = _mm_shuffle_epi8(plane[0], idx[h]);
                        const __m128i p1 = _mm_shuffle_epi8(plane[1], idx[h]);
                        const __m128i p2 = _mm_shuffle_epi8(plane[2], idx[h]);
                        const __m128i p3 = _mm_shuffle_epi8(plane[3], idx[h]);
                        const __m128i l01 = _mm_unpacklo_epi8(p0, p1), h01 = _mm_unpackhi_epi8(p0, p1);
                        const __m128i l23 = _mm_unpacklo_epi8(p2, p3), h23 = _mm_unpackhi_epi8(p2, p3);
                        _mm_storeu_si128(o + 4 * h + 0, _mm_unpacklo_epi16(l01, l23));
                        _mm_storeu_si128(o + 4 * h + 1, _mm_unpackhi_epi16(l01, l23));
                        _mm_storeu_si128(o + 4 * h + 2, _mm_unpacklo_epi16(h01, h23));
                        _mm_storeu_si128(o + 4 * h + 3, _mm_unpackhi_epi16(h01, h23));
                    }
                }
            }
        }
#endif
        for (; i + 1 < end; i += 2) {
            const uint8_t byte = data[i >> 1];
            out[i] = table[byte >> 4];
            out[i + 1] = table[byte & 15];
        }
        if (i < end) out[i] = table[data[i >> 1] >> 4];
    }
}

// The sizes every call is checked against: counts of elements, not bytes.
// values_len: the unpacked values (n); packed_len: their codes, two per byte; absmax_len:
// one scale per block.  The block is even (both values of a byte share a block).
static bool sizes_ok(int64_t n, int64_t block, int64_t values_len, int64_t packed_len,
                     int64_t absmax_len, int threads) {
    if (n < 0 || n > SAKURA_QUANT_MAX_COUNT || threads < 1) return false;
    if (block < 2 || block > SAKURA_QUANT_MAX_BLOCK || (block & 1)) return false;
    return values_len == n && packed_len == (n + 1) / 2 && absmax_len == (n + block - 1) / block;
}

template <typename T>
static int64_t quantize_checked(const void* x, int64_t x_len, int64_t n, int64_t block,
                                const float* mid, float* absmax, int64_t absmax_len,
                                uint8_t* out, int64_t out_len, int threads) {
    if (!sizes_ok(n, block, x_len, out_len, absmax_len, threads)) return SAKURA_QUANT_BAD_ARGUMENTS;
    const int64_t bad = count_non_finite<T>(x, n, threads);
    if (bad) return bad;
    quantize<T>(x, n, block, mid, absmax, out, threads);
    return 0;
}

template <typename Out>
static int dequantize_checked(const uint8_t* data, int64_t data_len, const float* absmax,
                              int64_t absmax_len, int64_t n, int64_t block, const float* code,
                              Out* out, int64_t out_len, int threads) {
    if (!sizes_ok(n, block, out_len, data_len, absmax_len, threads)) return SAKURA_QUANT_BAD_ARGUMENTS;
    dequantize<Out>(data, absmax, n, block, code, out, threads);
    return 0;
}

// Quantize returns 0, SAKURA_QUANT_BAD_ARGUMENTS, or the (positive) count of NaN / Inf
// inputs (nothing written then); dequantize returns 0 or SAKURA_QUANT_BAD_ARGUMENTS.
// x_len / out_len: elements of the values (n); data_len: packed bytes ((n + 1) / 2);
// absmax_len: blocks ((n + block - 1) / block).
extern "C" {
int64_t sakura_nf4_quantize_f32(const float* x, int64_t x_len, int64_t n, int64_t block,
                                const float* mid, float* absmax, int64_t absmax_len,
                                uint8_t* out, int64_t out_len, int threads) {
    return quantize_checked<F32>(x, x_len, n, block, mid, absmax, absmax_len, out, out_len,
                                 threads);
}
int64_t sakura_nf4_quantize_bf16(const uint16_t* x, int64_t x_len, int64_t n, int64_t block,
                                 const float* mid, float* absmax, int64_t absmax_len,
                                 uint8_t* out, int64_t out_len, int threads) {
    return quantize_checked<BF16>(x, x_len, n, block, mid, absmax, absmax_len, out, out_len,
                                  threads);
}
int sakura_nf4_dequantize_f32(const uint8_t* data, int64_t data_len, const float* absmax,
                              int64_t absmax_len, int64_t n, int64_t block, const float* code,
                              float* out, int64_t out_len, int threads) {
    return dequantize_checked<float>(data, data_len, absmax, absmax_len, n, block, code, out,
                                     out_len, threads);
}
int sakura_nf4_dequantize_bf16(const uint8_t* data, int64_t data_len, const float* absmax,
                               int64_t absmax_len, int64_t n, int64_t block, const float* code,
                               uint16_t* out, int64_t out_len, int threads) {
    return dequantize_checked<uint16_t>(data, data_len, absmax, absmax_len, n, block, code, out,
                                        out_len, threads);
}
}
