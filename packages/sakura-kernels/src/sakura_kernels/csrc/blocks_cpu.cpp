// Fused decoder-block kernels for the CPU (sakura_kernels.blocks): RMSNorm forward and
// backward, rotary embedding forward and backward, SwiGLU / GeGLU (gelu tanh) forward and
// backward; and the softmax cross-entropy of rows of logits (sakura_kernels.losses: the
// log-sum-exp, the picked logit and the gradient written over the logits).  Plain C ABI, no torch headers (sakura_torch.native.NativeLibrary).
//
// Every element is computed in fp32 and rounded once to its storage type (fp32 or bf16,
// round to nearest even).  The loops are written for the compiler's vectoriser: the build
// uses -march=native, so they run as AVX-512 where the CPU has it, AVX2 otherwise, scalar
// elsewhere; bf16 rounding uses AVX-512-BF16's vcvtneps2bf16 where the CPU has it.
// The activations need exp: on AVX-512 a 16-lane exp of our own (exp_ps below, within 2 ulps
// of expf); glibc's vector expf (libmvec) is only used by the compiler under -ffast-math,
// which this build does not use, so a plain `omp simd` loop over std::exp stays scalar (it
// made SwiGLU several times slower than torch's).  Elsewhere the scalar std::exp.
// -ffp-contract=off keeps the compiler from fusing a*b+c: each product rounds as torch's.
//
// The RMSNorm weight gradient is summed in a fixed order: rows in fixed blocks of
// RMS_BLOCK (each block in row order), then the blocks' partial sums in block order, in
// double.  The same bits every run, whatever the thread count.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
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

// q: (batch, heads, seq, dim) contiguous; cos/sin: (batch, seq, dim) contiguous.
template <typename T>
void rope(const T* q, const T* cos, const T* sin, T* out, int64_t batch, int64_t heads,
          int64_t seq, int64_t dim, bool backward) {
    const int64_t half = dim / 2;
    const int64_t rows = batch * heads * seq;
#pragma omp parallel
    {
        std::vector<float> qr(dim), cr(dim), sr(dim), o(dim);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t b = r / (heads * seq), s = r % seq;
            load_row(q + r * dim, qr.data(), dim);
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
            store_row(o.data(), out + r * dim, dim);
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
inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)), _mm512_set1_ps(88.8f));
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
// query position = inner row % q_len.  mask: (batch, q_len, k) fp32 additive, batch = outer /
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

// Its backward, in place: dp (rows, k) -> scale * p * (dp - sum_j p_j dp_j).
template <typename T>
void attn_softmax_backward(const T* p, T* dp, int64_t rows, int64_t k, float scale) {
#pragma omp parallel
    {
        std::vector<float> pr(k), gr(k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            load_row(p + r * k, pr.data(), k);
            load_row(dp + r * k, gr.data(), k);
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < k; ++j) dot += pr[j] * gr[j];
#pragma omp simd
            for (int64_t j = 0; j < k; ++j) gr[j] = scale * (pr[j] * (gr[j] - dot));
            store_row(gr.data(), dp + r * k, k);
        }
    }
}

}  // namespace

extern "C" {

int sakura_kernels_blocks_abi_version(void) { return 2; }

// dtype: 0 = fp32, 1 = bf16.  Returns 0, or -1 when an argument is out of range.
int sakura_blocks_rmsnorm_forward(int dtype, const void* x, const void* w, void* y, float* rstd,
                                  int64_t rows, int64_t h, float eps) {
    if (rows < 0 || h <= 0 || !(eps >= 0.0f)) return BAD_ARGUMENTS;
    if (dtype == 0)
        rmsnorm_forward(static_cast<const float*>(x), static_cast<const float*>(w),
                        static_cast<float*>(y), rstd, rows, h, eps);
    else if (dtype == 1)
        rmsnorm_forward(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
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
        rmsnorm_backward(static_cast<const float*>(dy), static_cast<const float*>(x),
                         static_cast<const float*>(w), rstd, static_cast<float*>(dx), dw, rows,
                         h);
    else if (dtype == 1)
        rmsnorm_backward(static_cast<const uint16_t*>(dy), static_cast<const uint16_t*>(x),
                         static_cast<const uint16_t*>(w), rstd, static_cast<uint16_t*>(dx), dw,
                         rows, h);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_blocks_rope(int dtype, const void* q, const void* cos, const void* sin, void* out,
                       int64_t batch, int64_t heads, int64_t seq, int64_t dim, int backward) {
    if (batch < 0 || heads < 0 || seq < 0 || dim <= 0 || dim % 2 != 0) return BAD_ARGUMENTS;
    if (dtype == 0)
        rope(static_cast<const float*>(q), static_cast<const float*>(cos),
             static_cast<const float*>(sin), static_cast<float*>(out), batch, heads, seq, dim,
             backward != 0);
    else if (dtype == 1)
        rope(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(cos),
             static_cast<const uint16_t*>(sin), static_cast<uint16_t*>(out), batch, heads, seq,
             dim, backward != 0);
    else
        return BAD_ARGUMENTS;
    return 0;
}

// kind: 0 = SwiGLU (silu), 1 = GeGLU (gelu, tanh approximation).
int sakura_blocks_glu_forward(int dtype, int kind, const void* gate, const void* up, void* out,
                              int64_t n) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    if (dtype == 0)
        glu_forward(static_cast<const float*>(gate), static_cast<const float*>(up),
                    static_cast<float*>(out), n, kind);
    else if (dtype == 1)
        glu_forward(static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up),
                    static_cast<uint16_t*>(out), n, kind);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_blocks_glu_backward(int dtype, int kind, const void* grad, const void* gate,
                               const void* up, void* dgate, void* dup, int64_t n) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    if (dtype == 0)
        glu_backward(static_cast<const float*>(grad), static_cast<const float*>(gate),
                     static_cast<const float*>(up), static_cast<float*>(dgate),
                     static_cast<float*>(dup), n, kind);
    else if (dtype == 1)
        glu_backward(static_cast<const uint16_t*>(grad), static_cast<const uint16_t*>(gate),
                     static_cast<const uint16_t*>(up), static_cast<uint16_t*>(dgate),
                     static_cast<uint16_t*>(dup), n, kind);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_attn_softmax_forward(int dtype, void* s, int64_t outer, int64_t inner, int64_t q_len,
                                int64_t k, const float* mask, int64_t per_batch,
                                int64_t mask_stride, int causal, float scale) {
    if (outer < 0 || inner < 0 || q_len <= 0 || k <= 0 || per_batch <= 0 || mask_stride < 0 ||
        (causal && q_len > k))
        return BAD_ARGUMENTS;
    if (dtype == 0)
        attn_softmax_forward(static_cast<float*>(s), outer, inner, q_len, k, mask, per_batch,
                             mask_stride, causal, scale);
    else if (dtype == 1)
        attn_softmax_forward(static_cast<uint16_t*>(s), outer, inner, q_len, k, mask, per_batch,
                             mask_stride, causal, scale);
    else
        return BAD_ARGUMENTS;
    return 0;
}

int sakura_attn_softmax_backward(int dtype, const void* p, void* dp, int64_t rows, int64_t k,
                                 float scale) {
    if (rows < 0 || k <= 0) return BAD_ARGUMENTS;
    if (dtype == 0)
        attn_softmax_backward(static_cast<const float*>(p), static_cast<float*>(dp), rows, k,
                              scale);
    else if (dtype == 1)
        attn_softmax_backward(static_cast<const uint16_t*>(p), static_cast<uint16_t*>(dp), rows,
                              k, scale);
    else
        return BAD_ARGUMENTS;
    return 0;
}

// logits: (rows, v) fp32 (dtype 0) or bf16 (1), contiguous, overwritten by the gradient when
// write_grad; targets in [0, v) or negative (ignored).
int sakura_xent_rows(int dtype, void* logits, int64_t rows, int64_t v, const int64_t* targets,
                     float* lse, float* picked, int write_grad) {
    if (rows < 0 || v <= 0) return BAD_ARGUMENTS;
    for (int64_t r = 0; r < rows; ++r)
        if (targets[r] >= v) return BAD_ARGUMENTS;
    if (dtype == 0)
        xent_rows(static_cast<float*>(logits), rows, v, targets, lse, picked, write_grad != 0);
    else if (dtype == 1)
        xent_rows(static_cast<uint16_t*>(logits), rows, v, targets, lse, picked, write_grad != 0);
    else
        return BAD_ARGUMENTS;
    return 0;
}

}  // extern "C"
