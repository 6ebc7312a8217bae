// Fused decoder-block kernels for the CPU (sakura_kernels.blocks): RMSNorm forward and
// backward, rotary embedding forward and backward, SwiGLU / GeGLU (gelu tanh) forward and
// backward, the attention softmax and its backward; and the softmax cross-entropy of rows of
// logits (sakura_kernels.losses: the log-sum-exp, the picked logit and the gradient written
// over the logits).  Plain C ABI, no torch headers (sakura_torch.native.NativeLibrary).
// Long file: one translation unit per library (NativeLibrary builds one source list), and
// each kernel exists twice, generic and AVX-512.
//
// Every element is computed in fp32 and rounded once to its storage type (fp32 or bf16,
// round to nearest even).  Two implementations of each block kernel:
// * where the build targets AVX-512 F + BW + VL (SAKURA_AVX512; -march=native on such a CPU),
//   the *_avx512 functions at the end: explicit 16-lane intrinsics that read and write the
//   storage type directly, masked loads / stores for the tails (any size), double sums as
//   fused multiply-adds of exact float products (the same value as multiply then add);
// * elsewhere the generic loops, written for the compiler's vectoriser (AVX2 or scalar).
// bf16 rounding uses AVX-512-BF16's vcvtneps2bf16 where the CPU has it (it reads fp32
// subnormals as zero), else the integer round-to-nearest-even of f32_to_bf16.
// The activations need exp: on AVX-512 a 16-lane exp of our own (exp_ps below, within 2 ulps
// of expf); glibc's vector expf (libmvec) is only used by the compiler under -ffast-math,
// which this build does not use, so a plain `omp simd` loop over std::exp stays scalar (it
// made SwiGLU several times slower than torch's).  Elsewhere the scalar std::exp.  On the
// AVX-512 path silu's division is a refined reciprocal (recip_ps, about 1 ulp).
// -ffp-contract=off keeps the compiler from fusing a*b+c: each product rounds as torch's.
//
// The RMSNorm weight gradient is summed in a fixed order: rows in fixed blocks of
// RMS_BLOCK (each block in row order, fp32), then the blocks' partial sums in block order,
// in double.  The same bits every run, whatever the thread count, and the same bits from
// both implementations given the same 1/rms.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SAKURA_AVX512 1
// The entry points call the explicit AVX-512 code (fn_avx512) where the build targets it.
#define SAKURA_PATH(fn) fn##_avx512
#else
#define SAKURA_PATH(fn) fn
#endif

namespace {

constexpr int64_t RMS_BLOCK = 32;
constexpr int BAD_ARGUMENTS = -1;

inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// Load a row of n elements into fp32 and store fp32 back, per storage type.
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void load_row(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void store_row(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    for (; i + 16 <= n; i += 16) {
        __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)packed);
    }
#endif
    for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t h,
                     float eps) {
    std::vector<float> wf(h);
    load_row(w, wf.data(), h);
#pragma omp parallel
    {
        std::vector<float> row(h), out(h);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            load_row(x + r * h, row.data(), h);
            double sum = 0.0;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < h; ++i) sum += static_cast<double>(row[i]) * row[i];
            const float inv = static_cast<float>(1.0 / std::sqrt(sum / h + eps));
            rstd[r] = inv;
#pragma omp simd
            for (int64_t i = 0; i < h; ++i) out[i] = wf[i] * (row[i] * inv);
            store_row(out.data(), y + r * h, h);
        }
    }
}

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const float* rstd, T* dx, float* dw,
                      int64_t rows, int64_t h) {
    std::vector<float> wf(h);
    load_row(w, wf.data(), h);
    const int64_t blocks = (rows + RMS_BLOCK - 1) / RMS_BLOCK;
    std::vector<float> partial(static_cast<size_t>(blocks) * h, 0.0f);
#pragma omp parallel
    {
        std::vector<float> xr(h), gr(h), out(h);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            float* acc = partial.data() + b * h;
            const int64_t end = (b + 1) * RMS_BLOCK < rows ? (b + 1) * RMS_BLOCK : rows;
            for (int64_t r = b * RMS_BLOCK; r < end; ++r) {
                load_row(x + r * h, xr.data(), h);
                load_row(dy + r * h, gr.data(), h);
                const float inv = rstd[r];
                double dot = 0.0;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < h; ++i) {
                    const float xhat = xr[i] * inv;
                    dot += static_cast<double>(gr[i] * wf[i]) * xhat;
                    acc[i] += gr[i] * xhat;
                }
                const float mean = static_cast<float>(dot / h);
#pragma omp simd
                for (int64_t i = 0; i < h; ++i)
                    out[i] = inv * (gr[i] * wf[i] - (xr[i] * inv) * mean);
                store_row(out.data(), dx + r * h, h);
            }
        }
    }
    std::vector<double> total(h, 0.0);
    for (int64_t b = 0; b < blocks; ++b) {
        const float* acc = partial.data() + b * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) total[i] += acc[i];
    }
    for (int64_t i = 0; i < h; ++i) dw[i] = static_cast<float>(total[i]);
}

// Row strides (in elements) of a (batch, heads, seq, dim) tensor whose dim is contiguous:
// the projections' layout (batch, seq, heads, dim) seen through a transpose reads and writes
// in place, with no copy into or out of the kernel.
struct RowStrides {
    int64_t batch, heads, seq;
    int64_t at(int64_t b, int64_t h, int64_t s) const { return b * batch + h * heads + s * seq; }
};

// q, out: (batch, heads, seq, dim) at their row strides; cos/sin: (batch, seq, dim) contiguous.
template <typename T>
void rope(const T* q, RowStrides qs, const T* cos, const T* sin, T* out, RowStrides os,
          int64_t batch, int64_t heads, int64_t seq, int64_t dim, bool backward) {
    const int64_t half = dim / 2;
    const int64_t rows = batch * heads * seq;
#pragma omp parallel
    {
        std::vector<float> qr(dim), cr(dim), sr(dim), o(dim);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t b = r / (heads * seq), h = (r / seq) % heads, s = r % seq;
            load_row(q + qs.at(b, h, s), qr.data(), dim);
            load_row(cos + (b * seq + s) * dim, cr.data(), dim);
            load_row(sin + (b * seq + s) * dim, sr.data(), dim);
            if (!backward) {
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    o[i] = qr[i] * cr[i] + (-qr[i + half]) * sr[i];
                    o[i + half] = qr[i + half] * cr[i + half] + qr[i] * sr[i + half];
                }
            } else {
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    o[i] = qr[i] * cr[i] + qr[i + half] * sr[i + half];
                    o[i + half] = qr[i + half] * cr[i + half] - qr[i] * sr[i];
                }
            }
            store_row(o.data(), out + os.at(b, h, s), dim);
        }
    }
}

constexpr float GELU_C = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_K = 0.044715f;

// tanh(z) = 1 - 2 / (exp(2z) + 1): one vector expf (libmvec) instead of a scalar tanhf; the
// cancellation near z = 0 costs an absolute error of a few 1e-8, far below a bf16 rounding
// and below the fp32 tolerance of the tests (relative to the output's scale).
inline float fast_tanh(float z) { return 1.0f - 2.0f / (std::exp(2.0f * z) + 1.0f); }

inline float act(float g, int kind) {
    if (kind == 0) return g / (1.0f + std::exp(-g));
    const float t = fast_tanh(GELU_C * (g + GELU_K * g * g * g));
    return 0.5f * g * (1.0f + t);
}

// act and act_grad from one exp / tanh (the same values as calling both).
inline void act_and_grad(float g, int kind, float& value, float& slope) {
    if (kind == 0) {
        const float e = std::exp(-g);
        const float sig = 1.0f / (1.0f + e);
        value = g / (1.0f + e);
        slope = sig * (1.0f + g * (1.0f - sig));
        return;
    }
    const float t = fast_tanh(GELU_C * (g + GELU_K * g * g * g));
    value = 0.5f * g * (1.0f + t);
    slope = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * GELU_C * (1.0f + 3.0f * GELU_K * g * g);
}

#if defined(__AVX512F__)
// exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite, two-part ln2), exp(r) by
// Cephes' degree-7 polynomial, times 2^n by vscalefps (which also gives 0 / inf past the
// range).  Within 2 ulps of expf over the clamped range.
inline __m512 exp_ps_in_range(__m512 x);
inline __m512 exp_ps(__m512 x) {
    return exp_ps_in_range(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)), _mm512_set1_ps(88.8f)));
}
// exp_ps for x already within [-103, 88.8] (the callers that clamp their argument anyway).
inline __m512 exp_ps_in_range(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

// The same formulas as act / act_and_grad, 16 lanes at a time; returns how many elements
// it did (a multiple of 16), the caller finishes the tail with the scalar code.
inline int64_t glu_forward_vec(const float* g, const float* u, float* o, int64_t len, int kind) {
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        __m512 value;
        if (kind == 0) {
            value = _mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        } else {
            const __m512 z = _mm512_mul_ps(
                _mm512_set1_ps(GELU_C),
                _mm512_add_ps(gv, _mm512_mul_ps(_mm512_set1_ps(GELU_K), _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv))));
            const __m512 t = _mm512_sub_ps(
                one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(exp_ps(_mm512_add_ps(z, z)), one)));
            value = _mm512_mul_ps(_mm512_mul_ps(half, gv), _mm512_add_ps(one, t));
        }
        _mm512_storeu_ps(o + i, _mm512_mul_ps(value, _mm512_loadu_ps(u + i)));
    }
    return i;
}

inline int64_t glu_backward_vec(const float* d, const float* g, const float* u, float* dg,
                                float* du, int64_t len, int kind) {
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i), dv = _mm512_loadu_ps(d + i);
        __m512 value, slope;
        if (kind == 0) {
            const __m512 e1 = _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
            const __m512 sig = _mm512_div_ps(one, e1);
            value = _mm512_div_ps(gv, e1);
            slope = _mm512_mul_ps(sig, _mm512_add_ps(one, _mm512_mul_ps(gv, _mm512_sub_ps(one, sig))));
        } else {
            const __m512 g2 = _mm512_mul_ps(gv, gv);
            const __m512 z = _mm512_mul_ps(
                _mm512_set1_ps(GELU_C),
                _mm512_add_ps(gv, _mm512_mul_ps(_mm512_set1_ps(GELU_K), _mm512_mul_ps(g2, gv))));
            const __m512 t = _mm512_sub_ps(
                one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(exp_ps(_mm512_add_ps(z, z)), one)));
            const __m512 onept = _mm512_add_ps(one, t);
            value = _mm512_mul_ps(_mm512_mul_ps(half, gv), onept);
            const __m512 inner = _mm512_mul_ps(
                _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(half, gv), _mm512_sub_ps(one, _mm512_mul_ps(t, t))),
                              _mm512_set1_ps(GELU_C)),
                _mm512_add_ps(one, _mm512_mul_ps(_mm512_set1_ps(3.0f * GELU_K), g2)));
            slope = _mm512_add_ps(_mm512_mul_ps(half, onept), inner);
        }
        _mm512_storeu_ps(dg + i, _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_loadu_ps(u + i)), slope));
        _mm512_storeu_ps(du + i, _mm512_mul_ps(dv, value));
    }
    return i;
}
#else
inline int64_t glu_forward_vec(const float*, const float*, float*, int64_t, int) { return 0; }
inline int64_t glu_backward_vec(const float*, const float*, const float*, float*, float*, int64_t,
                                int) {
    return 0;
}
#endif

constexpr int64_t CHUNK = 1024;

template <typename T>
void glu_forward(const T* gate, const T* up, T* out, int64_t n, int kind) {
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel
    {
        float g[CHUNK], u[CHUNK], o[CHUNK];
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t start = c * CHUNK, len = n - start < CHUNK ? n - start : CHUNK;
            load_row(gate + start, g, len);
            load_row(up + start, u, len);
            for (int64_t i = glu_forward_vec(g, u, o, len, kind); i < len; ++i)
                o[i] = act(g[i], kind) * u[i];
            store_row(o, out + start, len);
        }
    }
}

template <typename T>
void glu_backward(const T* grad, const T* gate, const T* up, T* dgate, T* dup, int64_t n,
                  int kind) {
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel
    {
        float d[CHUNK], g[CHUNK], u[CHUNK], dg[CHUNK], du[CHUNK];
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t start = c * CHUNK, len = n - start < CHUNK ? n - start : CHUNK;
            load_row(grad + start, d, len);
            load_row(gate + start, g, len);
            load_row(up + start, u, len);
            for (int64_t i = glu_backward_vec(d, g, u, dg, du, len, kind); i < len; ++i) {
                float value, slope;
                act_and_grad(g[i], kind, value, slope);
                dg[i] = d[i] * u[i] * slope;
                du[i] = d[i] * value;
            }
            store_row(dg, dgate + start, len);
            store_row(du, dup + start, len);
        }
    }
}

// Cross-entropy over rows of logits (vocab v), fp32 math: lse[r] = log sum exp(x), picked[r]
// = x[target]; with write_grad, the row is overwritten by d loss_r / d x = softmax(x) -
// onehot(target), rounded once to T (a row whose target is negative, ignored, by zeros).
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int i = 0; i < 16; ++i) p[i] = f32_to_bf16(tmp[i]);
#endif
}
#endif
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return bf16_to_f32(v); }
inline void from_f32(float v, float* p) { *p = v; }
inline void from_f32(float v, uint16_t* p) { *p = f32_to_bf16(v); }

template <typename T>
void xent_rows(T* logits, int64_t rows, int64_t v, const int64_t* targets, float* lse,
               float* picked, bool write_grad) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        T* x = logits + r * v;
        int64_t i = 0;
        float m = -INFINITY, sum = 0.0f;
#if defined(__AVX512F__)
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= v; i += 16) mv = _mm512_max_ps(mv, load16(x + i));
        m = _mm512_reduce_max_ps(mv);
#endif
        for (; i < v; ++i) m = to_f32(x[i]) > m ? to_f32(x[i]) : m;
        i = 0;
#if defined(__AVX512F__)
        const __m512 mb = _mm512_set1_ps(m);
        __m512 sv = _mm512_setzero_ps();
        for (; i + 16 <= v; i += 16) sv = _mm512_add_ps(sv, exp_ps(_mm512_sub_ps(load16(x + i), mb)));
        sum = _mm512_reduce_add_ps(sv);
#endif
        for (; i < v; ++i) sum += std::exp(to_f32(x[i]) - m);
        const float l = m + std::log(sum);
        const int64_t t = targets[r];
        lse[r] = l;
        picked[r] = t >= 0 ? to_f32(x[t]) : 0.0f;
        if (!write_grad) continue;
        if (t < 0) {
            std::memset(static_cast<void*>(x), 0, sizeof(T) * v);
            continue;
        }
        const float at_target = std::exp(to_f32(x[t]) - l) - 1.0f;
        i = 0;
#if defined(__AVX512F__)
        const __m512 lb = _mm512_set1_ps(l);
        for (; i + 16 <= v; i += 16) store16(x + i, exp_ps(_mm512_sub_ps(load16(x + i), lb)));
#endif
        for (; i < v; ++i) from_f32(std::exp(to_f32(x[i]) - l), x + i);
        from_f32(at_target, x + t);
    }
}

// exp over a row of fp32 in place (16 lanes on AVX-512, scalar tail / elsewhere).
inline void exp_inplace(float* x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp_ps(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// Attention probabilities, in place: scores s (outer, inner, k) -> softmax(s * scale + mask)
// over k, fp32 math, rounded once.  inner rows are (group member, query position) pairs:
// query position = inner row % q_len (inner a multiple of q_len: the entry point refuses
// others).  mask: (batch, q_len, k) fp32 additive, batch = outer /
// per_batch (mask_stride 0: one for all), or null; causal: key j > i + k - q_len masked.
template <typename T>
void attn_softmax_forward(T* s, int64_t outer, int64_t inner, int64_t q_len, int64_t k,
                          const float* mask, int64_t per_batch, int64_t mask_stride, int causal,
                          float scale) {
#pragma omp parallel
    {
        std::vector<float> row(k);
#pragma omp for schedule(static)
        for (int64_t rr = 0; rr < outer * inner; ++rr) {
            T* x = s + rr * k;
            const int64_t o = rr / inner, i = (rr % inner) % q_len;
            const int64_t limit = causal ? std::min<int64_t>(k, i + k - q_len + 1) : k;
            load_row(x, row.data(), limit);
            const float* mrow = mask ? mask + (o / per_batch) * mask_stride + i * k : nullptr;
            float m = -INFINITY;
            if (mrow) {
#pragma omp simd
                for (int64_t j = 0; j < limit; ++j) row[j] = row[j] * scale + mrow[j];
            } else {
#pragma omp simd
                for (int64_t j = 0; j < limit; ++j) row[j] = row[j] * scale;
            }
#pragma omp simd reduction(max : m)
            for (int64_t j = 0; j < limit; ++j) m = row[j] > m ? row[j] : m;
#pragma omp simd
            for (int64_t j = 0; j < limit; ++j) row[j] -= m;
            exp_inplace(row.data(), limit);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < limit; ++j) sum += row[j];
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t j = 0; j < limit; ++j) row[j] *= inv;
            for (int64_t j = limit; j < k; ++j) row[j] = 0.0f;
            store_row(row.data(), x, k);
        }
    }
}

// Its backward, in place: dp (rows, k) -> scale * p * (dp - sum_j p_j dp_j).  causal_q_len
// > 0: the forward was causal over q_len query positions (row r's position r % q_len), so p
// is zero past each row's limit: there the result is written as 0 without reading p or dp
// (the full formula gives 0 too, or -0, or NaN where dp is not finite).
inline int64_t causal_limit(int64_t r, int64_t causal_q_len, int64_t k) {
    return causal_q_len > 0 ? std::min<int64_t>(k, r % causal_q_len + k - causal_q_len + 1) : k;
}

template <typename T>
void attn_softmax_backward(const T* p, T* dp, int64_t rows, int64_t k, float scale,
                           int64_t causal_q_len) {
#pragma omp parallel
    {
        std::vector<float> pr(k), gr(k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t limit = causal_limit(r, causal_q_len, k);
            load_row(p + r * k, pr.data(), limit);
            load_row(dp + r * k, gr.data(), limit);
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < limit; ++j) dot += pr[j] * gr[j];
#pragma omp simd
            for (int64_t j = 0; j < limit; ++j) gr[j] = scale * (pr[j] * (gr[j] - dot));
            for (int64_t j = limit; j < k; ++j) gr[j] = 0.0f;
            store_row(gr.data(), dp + r * k, k);
        }
    }
}

#if defined(SAKURA_AVX512)
// ---- AVX-512 (F + BW + VL) paths: 16 lanes, masked loads and stores for the tails, reading
// and writing the storage type directly (no fp32 staging rows).  The same formulas and
// roundings as the generic loops above; where they differ, the function says so.
inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? static_cast<__mmask16>(0xFFFF)
                      : static_cast<__mmask16>((1u << static_cast<unsigned>(left)) - 1u);
}
inline __m512 loadm(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 loadm(const uint16_t* p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// fp32 -> bf16, round to nearest even, 16 lanes: vcvtneps2bf16 where the CPU has it (as the
// generic store_row), else the integer form of f32_to_bf16 (a NaN stays a quiet NaN).
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan,
                                    _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
inline void storem(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void storem(uint16_t* p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

inline __m512d low_pd(__m512 a) { return _mm512_cvtps_pd(_mm512_castps512_ps256(a)); }
inline __m512d high_pd(__m512 a) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
// Adds the products a*b (floats, widened) to two double accumulators.  A product of two
// floats is exact in double, so the fused multiply-add rounds once, as the generic loop's
// double multiply then add.
inline void add_products_pd(__m512 a, __m512 b, __m512d& lo, __m512d& hi) {
    lo = _mm512_fmadd_pd(low_pd(a), low_pd(b), lo);
    hi = _mm512_fmadd_pd(high_pd(a), high_pd(b), hi);
}

// 1 / d for d in [1, 2^126]: vrcp14ps and one Newton step, within about 1 ulp of the
// division (a vdivps costs 10+ cycles a vector: most of an activation's time).
inline __m512 recip_ps(__m512 d) {
    const __m512 r = _mm512_rcp14_ps(d);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
}

// Sum of squares in double (four accumulators, lane order: the generic `omp simd` reduction
// also sums in the vectoriser's lane order), then the same inverse and output.
template <typename T>
void rmsnorm_forward_avx512(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t h,
                            float eps) {
    std::vector<float> wf(h);
    load_row(w, wf.data(), h);
    const float* wp = wf.data();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * h;
        __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
        __m512d s2 = _mm512_setzero_pd(), s3 = _mm512_setzero_pd();
        int64_t i = 0;
        for (; i + 32 <= h; i += 32) {
            const __m512 a = loadm(xr + i, 0xFFFF), b = loadm(xr + i + 16, 0xFFFF);
            add_products_pd(a, a, s0, s1);
            add_products_pd(b, b, s2, s3);
        }
        for (; i < h; i += 16) {
            const __m512 a = loadm(xr + i, tail_mask(h - i));
            add_products_pd(a, a, s0, s1);
        }
        const double sum =
            _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(s0, s1), _mm512_add_pd(s2, s3)));
        const float inv = static_cast<float>(1.0 / std::sqrt(sum / h + eps));
        rstd[r] = inv;
        const __m512 iv = _mm512_set1_ps(inv);
        for (i = 0; i < h; i += 16) {
            const __mmask16 m = tail_mask(h - i);
            const __m512 out = _mm512_mul_ps(loadm(wp + i, m), _mm512_mul_ps(loadm(xr + i, m), iv));
            storem(y + r * h + i, m, out);
        }
    }
}

// The same blocks, partial sums (float, row order within a block: the same bits as the
// generic loop) and double dot product per row as the generic loop; the second pass
// re-reads x and dy (in L1) instead of keeping fp32 copies.
template <typename T>
void rmsnorm_backward_avx512(const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                             float* dw, int64_t rows, int64_t h) {
    std::vector<float> wf(h);
    load_row(w, wf.data(), h);
    const float* wp = wf.data();
    const int64_t blocks = (rows + RMS_BLOCK - 1) / RMS_BLOCK;
    std::vector<float> partial(static_cast<size_t>(blocks) * h, 0.0f);
    float* partial_p = partial.data();
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        float* acc = partial_p + b * h;
        const int64_t end = (b + 1) * RMS_BLOCK < rows ? (b + 1) * RMS_BLOCK : rows;
        for (int64_t r = b * RMS_BLOCK; r < end; ++r) {
            const T* xr = x + r * h;
            const T* gr = dy + r * h;
            const __m512 iv = _mm512_set1_ps(rstd[r]);
            __m512d d0 = _mm512_setzero_pd(), d1 = _mm512_setzero_pd();
            for (int64_t i = 0; i < h; i += 16) {
                const __mmask16 m = tail_mask(h - i);
                const __m512 g = loadm(gr + i, m);
                const __m512 xhat = _mm512_mul_ps(loadm(xr + i, m), iv);
                add_products_pd(_mm512_mul_ps(g, loadm(wp + i, m)), xhat, d0, d1);
                storem(acc + i, m, _mm512_add_ps(loadm(acc + i, m), _mm512_mul_ps(g, xhat)));
            }
            const double dot = _mm512_reduce_add_pd(_mm512_add_pd(d0, d1));
            const __m512 mean = _mm512_set1_ps(static_cast<float>(dot / h));
            for (int64_t i = 0; i < h; i += 16) {
                const __mmask16 m = tail_mask(h - i);
                const __m512 gw = _mm512_mul_ps(loadm(gr + i, m), loadm(wp + i, m));
                const __m512 xhat = _mm512_mul_ps(loadm(xr + i, m), iv);
                const __m512 out = _mm512_mul_ps(iv, _mm512_sub_ps(gw, _mm512_mul_ps(xhat, mean)));
                storem(dx + r * h + i, m, out);
            }
        }
    }
    std::vector<double> total(h, 0.0);
    for (int64_t b = 0; b < blocks; ++b) {
        const float* acc = partial_p + b * h;
        for (int64_t i = 0; i < h; ++i) total[i] += acc[i];
    }
    for (int64_t i = 0; i < h; ++i) dw[i] = static_cast<float>(total[i]);
}

// Rotation of one row half by half, 16 lanes at a time (the same products and sums).
template <typename T>
void rope_avx512(const T* q, RowStrides qs, const T* cos, const T* sin, T* out, RowStrides os,
                 int64_t batch, int64_t heads, int64_t seq, int64_t dim, bool backward) {
    const int64_t half = dim / 2;
    const int64_t rows = batch * heads * seq;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = r / (heads * seq), h = (r / seq) % heads, s = r % seq;
        const T* qr = q + qs.at(b, h, s);
        const T* cr = cos + (b * seq + s) * dim;
        const T* sr = sin + (b * seq + s) * dim;
        T* o = out + os.at(b, h, s);
        for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = tail_mask(half - i);
            const __m512 q1 = loadm(qr + i, m), q2 = loadm(qr + half + i, m);
            const __m512 c1 = loadm(cr + i, m), c2 = loadm(cr + half + i, m);
            const __m512 s1 = loadm(sr + i, m), s2 = loadm(sr + half + i, m);
            if (!backward) {  // q1 c1 + (-q2) s1 == q1 c1 - q2 s1 exactly
                storem(o + i, m, _mm512_sub_ps(_mm512_mul_ps(q1, c1), _mm512_mul_ps(q2, s1)));
                storem(o + half + i, m, _mm512_add_ps(_mm512_mul_ps(q2, c2), _mm512_mul_ps(q1, s2)));
            } else {
                storem(o + i, m, _mm512_add_ps(_mm512_mul_ps(q1, c1), _mm512_mul_ps(q2, s2)));
                storem(o + half + i, m, _mm512_sub_ps(_mm512_mul_ps(q2, c2), _mm512_mul_ps(q1, s1)));
            }
        }
    }
}

// The activations, 16 lanes: the formulas of act / act_and_grad with exp_ps.  silu's
// division is recip_ps (its exp(-g) clamped at exp(87) so that the denominator stays finite:
// for g < -87 silu is below 2e-36 in magnitude either way).  gelu keeps the division: its
// 1 + tanh cancels for negative inputs, where recip_ps's extra ulp would show (and the
// division is not what bounds its time); its exp(2z) is clamped at exp(87), where tanh(z) = 1
// in fp32 either way.
constexpr float EXP_ARG_MAX = 87.0f;

// -g clamped to [-103, 87] (a NaN gate gives -103: the value and slope stay NaN through g).
inline __m512 silu_exp_argument(__m512 g) {
    return _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(-103.0f)),
                         _mm512_set1_ps(EXP_ARG_MAX));
}

template <int KIND>
inline __m512 glu_value(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (KIND == 0) {
        const __m512 e = exp_ps_in_range(silu_exp_argument(g));
        return _mm512_mul_ps(g, recip_ps(_mm512_add_ps(one, e)));
    }
    const __m512 z = _mm512_mul_ps(
        _mm512_set1_ps(GELU_C),
        _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(GELU_K), _mm512_mul_ps(_mm512_mul_ps(g, g), g))));
    const __m512 e = exp_ps(_mm512_min_ps(_mm512_add_ps(z, z), _mm512_set1_ps(EXP_ARG_MAX)));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, t));
}

template <int KIND>
inline void glu_value_slope(__m512 g, __m512& value, __m512& slope) {
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    if (KIND == 0) {
        const __m512 e = exp_ps_in_range(silu_exp_argument(g));
        const __m512 sig = recip_ps(_mm512_add_ps(one, e));
        value = _mm512_mul_ps(g, sig);
        slope = _mm512_mul_ps(sig, _mm512_add_ps(one, _mm512_mul_ps(g, _mm512_sub_ps(one, sig))));
        return;
    }
    const __m512 g2 = _mm512_mul_ps(g, g);
    const __m512 z = _mm512_mul_ps(
        _mm512_set1_ps(GELU_C),
        _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(GELU_K), _mm512_mul_ps(g2, g))));
    const __m512 e = exp_ps(_mm512_min_ps(_mm512_add_ps(z, z), _mm512_set1_ps(EXP_ARG_MAX)));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    const __m512 onept = _mm512_add_ps(one, t);
    value = _mm512_mul_ps(_mm512_mul_ps(half, g), onept);
    const __m512 inner = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_sub_ps(one, _mm512_mul_ps(t, t))),
                      _mm512_set1_ps(GELU_C)),
        _mm512_add_ps(one, _mm512_mul_ps(_mm512_set1_ps(3.0f * GELU_K), g2)));
    slope = _mm512_add_ps(_mm512_mul_ps(half, onept), inner);
}

constexpr int64_t GLU_CHUNK = 4096;  // elements per OpenMP work item

// 32 bf16 at once as two fp32 vectors, the even-indexed elements and the odd ones: one load
// and one shift or mask each (instead of a widening load and a shift per 16).  Elementwise
// code runs on both halves alike; pair_store interleaves them back, rounded as storem.
struct Bf16Pair {
    __m512 even, odd;
};
inline Bf16Pair pair_load(const uint16_t* p) {
    const __m512i words = _mm512_loadu_si512(p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline void pair_store(uint16_t* p, __m512 even, __m512 odd) {
#if defined(__AVX512BF16__)
    // vcvtne2ps2bf16 puts the 16 even results in words 0-15 and the odd ones in 16-31.
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(interleave, packed));
#else
    const __m512i lo = _mm512_cvtepu16_epi32(to_bf16(even));
    const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(odd)), 16);
    _mm512_storeu_si512(p, _mm512_or_si512(lo, hi));
#endif
}

template <int KIND, typename T>
void glu_forward_avx512(const T* gate, const T* up, T* out, int64_t n) {
    const int64_t chunks = (n + GLU_CHUNK - 1) / GLU_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = std::min<int64_t>(n, (c + 1) * GLU_CHUNK);
        const auto step = [&](int64_t i, __mmask16 m) {
            const __m512 value = glu_value<KIND>(loadm(gate + i, m));
            storem(out + i, m, _mm512_mul_ps(value, loadm(up + i, m)));
        };
        int64_t i = c * GLU_CHUNK;
        if constexpr (std::is_same_v<T, uint16_t>) {
            for (; i + 32 <= end; i += 32) {
                const Bf16Pair g = pair_load(gate + i), u = pair_load(up + i);
                pair_store(out + i, _mm512_mul_ps(glu_value<KIND>(g.even), u.even),
                           _mm512_mul_ps(glu_value<KIND>(g.odd), u.odd));
            }
        }
        for (; i + 16 <= end; i += 16) step(i, 0xFFFF);  // full vectors: constant mask
        if (i < end) step(i, tail_mask(end - i));
    }
}

template <int KIND, typename T>
void glu_backward_avx512(const T* grad, const T* gate, const T* up, T* dgate, T* dup,
                         int64_t n) {
    const int64_t chunks = (n + GLU_CHUNK - 1) / GLU_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = std::min<int64_t>(n, (c + 1) * GLU_CHUNK);
        const auto step = [&](int64_t i, __mmask16 m) {
            __m512 value, slope;
            glu_value_slope<KIND>(loadm(gate + i, m), value, slope);
            const __m512 d = loadm(grad + i, m);
            storem(dgate + i, m, _mm512_mul_ps(_mm512_mul_ps(d, loadm(up + i, m)), slope));
            storem(dup + i, m, _mm512_mul_ps(d, value));
        };
        int64_t i = c * GLU_CHUNK;
        if constexpr (std::is_same_v<T, uint16_t>) {
            for (; i + 32 <= end; i += 32) {
                const Bf16Pair g = pair_load(gate + i), u = pair_load(up + i);
                const Bf16Pair d = pair_load(grad + i);
                __m512 value_e, slope_e, value_o, slope_o;
                glu_value_slope<KIND>(g.even, value_e, slope_e);
                glu_value_slope<KIND>(g.odd, value_o, slope_o);
                pair_store(dgate + i, _mm512_mul_ps(_mm512_mul_ps(d.even, u.even), slope_e),
                           _mm512_mul_ps(_mm512_mul_ps(d.odd, u.odd), slope_o));
                pair_store(dup + i, _mm512_mul_ps(d.even, value_e), _mm512_mul_ps(d.odd, value_o));
            }
        }
        for (; i + 16 <= end; i += 16) step(i, 0xFFFF);  // full vectors: constant mask
        if (i < end) step(i, tail_mask(end - i));
    }
}

template <typename T>
void glu_forward_avx512(const T* gate, const T* up, T* out, int64_t n, int kind) {
    if (kind == 0)
        glu_forward_avx512<0>(gate, up, out, n);
    else
        glu_forward_avx512<1>(gate, up, out, n);
}

template <typename T>
void glu_backward_avx512(const T* grad, const T* gate, const T* up, T* dgate, T* dup, int64_t n,
                         int kind) {
    if (kind == 0)
        glu_backward_avx512<0>(grad, gate, up, dgate, dup, n);
    else
        glu_backward_avx512<1>(grad, gate, up, dgate, dup, n);
}

// The attention softmax: one fp32 row buffer per thread; the row's max and sum in 16 lanes
// (the generic loop's `omp simd` reductions also sum in lane order, with the vectoriser's
// width); every exp is exp_ps (the generic loop takes std::exp for the last k % 16).
template <typename T>
void attn_softmax_forward_avx512(T* s, int64_t outer, int64_t inner, int64_t q_len, int64_t k,
                                 const float* mask, int64_t per_batch, int64_t mask_stride,
                                 int causal, float scale) {
#pragma omp parallel
    {
        std::vector<float> buffer(static_cast<size_t>(k));
        float* row = buffer.data();
        const __m512 sv = _mm512_set1_ps(scale);
        const int64_t members = inner / q_len;  // inner = members * q_len (the caller's)
        // Three loops collapsed: the indices advance without a division per row.
#pragma omp for schedule(static) collapse(3)
        for (int64_t o = 0; o < outer; ++o)
        for (int64_t member = 0; member < members; ++member)
        for (int64_t i = 0; i < q_len; ++i) {
            T* x = s + ((o * members + member) * q_len + i) * k;
            const int64_t limit = causal ? std::min<int64_t>(k, i + k - q_len + 1) : k;
            const float* mrow = mask ? mask + (o / per_batch) * mask_stride + i * k : nullptr;
            __m512 mv = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < limit; j += 16) {
                const __mmask16 m = tail_mask(limit - j);
                __m512 v = _mm512_mul_ps(loadm(x + j, m), sv);
                if (mrow) v = _mm512_add_ps(v, loadm(mrow + j, m));
                _mm512_mask_storeu_ps(row + j, m, v);
                mv = _mm512_mask_max_ps(mv, m, mv, v);
            }
            const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < limit; j += 16) {
                const __mmask16 m = tail_mask(limit - j);
                const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), mb));
                _mm512_mask_storeu_ps(row + j, m, e);
                sum = _mm512_mask_add_ps(sum, m, sum, e);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
            for (int64_t j = 0; j < k; j += 16) {
                const __mmask16 m = tail_mask(k - j);
                const __mmask16 live = j < limit ? tail_mask(limit - j) : static_cast<__mmask16>(0);
                storem(x + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + j), inv));
            }
        }
    }
}

template <typename T>
void attn_softmax_backward_avx512(const T* p, T* dp, int64_t rows, int64_t k, float scale,
                                  int64_t causal_q_len) {
    const __m512 sv = _mm512_set1_ps(scale);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* pr = p + r * k;
        T* gr = dp + r * k;
        const int64_t limit = causal_limit(r, causal_q_len, k);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < limit; j += 16) {
            const __mmask16 m = tail_mask(limit - j);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(loadm(pr + j, m), loadm(gr + j, m)));
        }
        const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
        for (int64_t j = 0; j < k; j += 16) {
            const __mmask16 m = tail_mask(k - j);
            const __mmask16 live = j < limit ? tail_mask(limit - j) : static_cast<__mmask16>(0);
            const __m512 v = _mm512_mul_ps(loadm(pr + j, live), _mm512_sub_ps(loadm(gr + j, live), dot));
            storem(gr + j, m, _mm512_maskz_mul_ps(live, sv, v));
        }
    }
}
// The cross-entropy rows with one exp per logit instead of two: the pass that sums
// exp(x - max) keeps those values in an fp32 row buffer (L2-resident), and the gradient is
// that buffer times 1 / sum, rounded once to T (the generic loop recomputes exp(x - lse):
// the same value within a few fp32 ulps; this one does not carry lse's rounding, a relative
// error of ulp(lse) in every element).  The target's entry is exp(x_t - lse) - 1 as there.
template <typename T>
void xent_rows_avx512(T* logits, int64_t rows, int64_t v, const int64_t* targets, float* lse,
                      float* picked, bool write_grad) {
#pragma omp parallel
    {
        std::vector<float> buffer(write_grad ? static_cast<size_t>(v) : 0);
        float* row = buffer.data();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            T* x = logits + r * v;
            __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
            int64_t i = 0;
            for (; i + 32 <= v; i += 32) {
                m0 = _mm512_max_ps(m0, loadm(x + i, 0xFFFF));
                m1 = _mm512_max_ps(m1, loadm(x + i + 16, 0xFFFF));
            }
            for (; i < v; i += 16) {
                const __mmask16 k = tail_mask(v - i);
                m0 = _mm512_mask_max_ps(m0, k, m0, loadm(x + i, k));
            }
            const float m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
            const __m512 mb = _mm512_set1_ps(m);
            __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
            for (i = 0; i + 32 <= v; i += 32) {
                const __m512 e0 = exp_ps(_mm512_sub_ps(loadm(x + i, 0xFFFF), mb));
                const __m512 e1 = exp_ps(_mm512_sub_ps(loadm(x + i + 16, 0xFFFF), mb));
                if (write_grad) {
                    _mm512_storeu_ps(row + i, e0);
                    _mm512_storeu_ps(row + i + 16, e1);
                }
                s0 = _mm512_add_ps(s0, e0);
                s1 = _mm512_add_ps(s1, e1);
            }
            for (; i < v; i += 16) {
                const __mmask16 k = tail_mask(v - i);
                const __m512 e = exp_ps(_mm512_sub_ps(loadm(x + i, k), mb));
                if (write_grad) _mm512_mask_storeu_ps(row + i, k, e);
                s0 = _mm512_mask_add_ps(s0, k, s0, e);
            }
            const float sum = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
            const float l = m + std::log(sum);
            const int64_t t = targets[r];
            lse[r] = l;
            picked[r] = t >= 0 ? to_f32(x[t]) : 0.0f;
            if (!write_grad) continue;
            if (t < 0) {
                std::memset(static_cast<void*>(x), 0, sizeof(T) * v);
                continue;
            }
            const float at_target = std::exp(to_f32(x[t]) - l) - 1.0f;
            const __m512 inv = _mm512_set1_ps(1.0f / sum);
            for (i = 0; i < v; i += 16) {
                const __mmask16 k = tail_mask(v - i);
                storem(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, row + i), inv));
            }
            from_f32(at_target, x + t);
        }
    }
}
#endif  // SAKURA_AVX512

int softmax_backward_entry(int dtype, const void* p, void* dp, int64_t rows, int64_t k,
                           float scale, int64_t causal_q_len) {
    if (dtype == 0)
        SAKURA_PATH(attn_softmax_backward)(static_cast<const float*>(p), static_cast<float*>(dp),
                                           rows, k, scale, causal_q_len);
    else if (dtype == 1)
        SAKURA_PATH(attn_softmax_backward)(static_cast<const uint16_t*>(p),
                                           static_cast<uint16_t*>(dp), rows, k, scale,
                                           causal_q_len);
    else
        return BAD_ARGUMENTS;
    return 0;
}

}  // namespace

extern "C" {

int sakura_kernels_blocks_abi_version(void) { return 4; }

// dtype: 0 = fp32, 1 = bf16.  Returns 0, or -1 when an argument is out of range.
int sakura_blocks_rmsnorm_forward(int dtype, const void* x, const void* w, void* y, float* rstd,
                                  int64_t rows, int64_t h, float eps) {
    if (rows < 0 || h <= 0 || !(eps >= 0.0f)) return BAD_ARGUMENTS;
    if (dtype == 0)
        SAKURA_PATH(rmsnorm_forward)(static_cast<const float*>(x), static_cast<const float*>(w),
                        static_cast<float*>(y), rstd, rows, h, eps);
    else if (dtype == 1)
        SAKURA_PATH(rmsnorm_forward)(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                        static_cast<uint16_t*>(y), rstd, rows, h, eps);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_blocks_rmsnorm_backward(int dtype, const void* dy, const void* x, const void* w,
                                   const float* rstd, void* dx, float* dw, int64_t rows,
                                   int64_t h) {
    if (rows < 0 || h <= 0) return BAD_ARGUMENTS;
    if (dtype == 0)
        SAKURA_PATH(rmsnorm_backward)(static_cast<const float*>(dy), static_cast<const float*>(x),
                         static_cast<const float*>(w), rstd, static_cast<float*>(dx), dw, rows,
                         h);
    else if (dtype == 1)
        SAKURA_PATH(rmsnorm_backward)(static_cast<const uint16_t*>(dy), static_cast<const uint16_t*>(x),
                         static_cast<const uint16_t*>(w), rstd, static_cast<uint16_t*>(dx), dw,
                         rows, h);
    else
        return BAD_ARGUMENTS;
    return 0;
}

// q and out at any row strides (dim contiguous): the projections' layout read and written
// through a transpose (ABI 4).  The strides must not make out overlap q unless they are equal.
int sakura_blocks_rope_strided(int dtype, const void* q, int64_t q_batch, int64_t q_heads,
                               int64_t q_seq, const void* cos, const void* sin, void* out,
                               int64_t o_batch, int64_t o_heads, int64_t o_seq, int64_t batch,
                               int64_t heads, int64_t seq, int64_t dim, int backward) {
    if (batch < 0 || heads < 0 || seq < 0 || dim <= 0 || dim % 2 != 0) return BAD_ARGUMENTS;
    if (q_batch < 0 || q_heads < 0 || q_seq < 0 || o_batch < 0 || o_heads < 0 || o_seq < 0)
        return BAD_ARGUMENTS;
    const RowStrides qs{q_batch, q_heads, q_seq}, os{o_batch, o_heads, o_seq};
    if (dtype == 0)
        SAKURA_PATH(rope)(static_cast<const float*>(q), qs, static_cast<const float*>(cos),
             static_cast<const float*>(sin), static_cast<float*>(out), os, batch, heads, seq,
             dim, backward != 0);
    else if (dtype == 1)
        SAKURA_PATH(rope)(static_cast<const uint16_t*>(q), qs, static_cast<const uint16_t*>(cos),
             static_cast<const uint16_t*>(sin), static_cast<uint16_t*>(out), os, batch, heads,
             seq, dim, backward != 0);
    else
        return BAD_ARGUMENTS;
    return 0;
}

// q, out: (batch, heads, seq, dim) contiguous.
int sakura_blocks_rope(int dtype, const void* q, const void* cos, const void* sin, void* out,
                       int64_t batch, int64_t heads, int64_t seq, int64_t dim, int backward) {
    return sakura_blocks_rope_strided(dtype, q, heads * seq * dim, seq * dim, dim, cos, sin, out,
                                      heads * seq * dim, seq * dim, dim, batch, heads, seq, dim,
                                      backward);
}

// kind: 0 = SwiGLU (silu), 1 = GeGLU (gelu, tanh approximation).
int sakura_blocks_glu_forward(int dtype, int kind, const void* gate, const void* up, void* out,
                              int64_t n) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    if (dtype == 0)
        SAKURA_PATH(glu_forward)(static_cast<const float*>(gate), static_cast<const float*>(up),
                    static_cast<float*>(out), n, kind);
    else if (dtype == 1)
        SAKURA_PATH(glu_forward)(static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up),
                    static_cast<uint16_t*>(out), n, kind);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_blocks_glu_backward(int dtype, int kind, const void* grad, const void* gate,
                               const void* up, void* dgate, void* dup, int64_t n) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    if (dtype == 0)
        SAKURA_PATH(glu_backward)(static_cast<const float*>(grad), static_cast<const float*>(gate),
                     static_cast<const float*>(up), static_cast<float*>(dgate),
                     static_cast<float*>(dup), n, kind);
    else if (dtype == 1)
        SAKURA_PATH(glu_backward)(static_cast<const uint16_t*>(grad), static_cast<const uint16_t*>(gate),
                     static_cast<const uint16_t*>(up), static_cast<uint16_t*>(dgate),
                     static_cast<uint16_t*>(dup), n, kind);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_attn_softmax_forward(int dtype, void* s, int64_t outer, int64_t inner, int64_t q_len,
                                int64_t k, const float* mask, int64_t per_batch,
                                int64_t mask_stride, int causal, float scale) {
    if (outer < 0 || inner < 0 || q_len <= 0 || inner % q_len != 0 || k <= 0 || per_batch <= 0 ||
        mask_stride < 0 || (causal && q_len > k))
        return BAD_ARGUMENTS;
    if (dtype == 0)
        SAKURA_PATH(attn_softmax_forward)(static_cast<float*>(s), outer, inner, q_len, k, mask, per_batch,
                             mask_stride, causal, scale);
    else if (dtype == 1)
        SAKURA_PATH(attn_softmax_forward)(static_cast<uint16_t*>(s), outer, inner, q_len, k, mask, per_batch,
                             mask_stride, causal, scale);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_attn_softmax_backward(int dtype, const void* p, void* dp, int64_t rows, int64_t k,
                                 float scale) {
    if (rows < 0 || k <= 0) return BAD_ARGUMENTS;
    return softmax_backward_entry(dtype, p, dp, rows, k, scale, 0);
}

// The backward of a causal forward over q_len query positions (rows a multiple of q_len, row
// r at position r % q_len): the zero probabilities past each row's causal limit are neither
// read nor multiplied, their gradient is written as 0 (ABI 3).
int sakura_attn_softmax_backward_causal(int dtype, const void* p, void* dp, int64_t rows,
                                        int64_t q_len, int64_t k, float scale) {
    if (rows < 0 || k <= 0 || q_len <= 0 || q_len > k || rows % q_len != 0) return BAD_ARGUMENTS;
    return softmax_backward_entry(dtype, p, dp, rows, k, scale, q_len);
}

// logits: (rows, v) fp32 (dtype 0) or bf16 (1), contiguous, overwritten by the gradient when
// write_grad; targets in [0, v) or negative (ignored).
int sakura_xent_rows(int dtype, void* logits, int64_t rows, int64_t v, const int64_t* targets,
                     float* lse, float* picked, int write_grad) {
    if (rows < 0 || v <= 0) return BAD_ARGUMENTS;
    for (int64_t r = 0; r < rows; ++r)
        if (targets[r] >= v) return BAD_ARGUMENTS;
    if (dtype == 0)
        SAKURA_PATH(xent_rows)(static_cast<float*>(logits), rows, v, targets, lse, picked, write_grad != 0);
    else if (dtype == 1)
        SAKURA_PATH(xent_rows)(static_cast<uint16_t*>(logits), rows, v, targets, lse, picked, write_grad != 0);
    else
        return BAD_ARGUMENTS;
    return 0;
}

}  // extern "C"
