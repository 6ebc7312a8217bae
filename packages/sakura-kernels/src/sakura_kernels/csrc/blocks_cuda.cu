// Fused decoder-block kernels for CUDA (sakura_kernels.blocks): RMSNorm forward/backward,
// rotary embedding forward/backward, SwiGLU / GeGLU forward/backward.  Plain C ABI, raw
// device pointers and a cudaStream_t, no torch headers (sakura_torch.native_cuda).
//
// Every element is computed in fp32 (row sums in double) and rounded once to its storage
// type, with the formulas of csrc/blocks_cpu.cpp.  A row sum is THREADS strided partial
// sums combined by a fixed tree; the RMSNorm weight gradient sums rows in fixed blocks of
// RMS_BLOCK, then the blocks in order: the same bits every run.
//
// sakura_blocks_*_emulate run the very same element and reduction functions on the host in
// the device's order, so the arithmetic is tested on machines without a GPU.
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define HD __host__ __device__ inline

namespace {

constexpr int THREADS = 256;
constexpr int64_t RMS_BLOCK = 32;
constexpr int BAD_ARGUMENTS = -1;
constexpr float GELU_C = 0.7978845608028654f;
constexpr float GELU_K = 0.044715f;

HD float load(const float* p, int64_t i) { return p[i]; }
HD float load(const uint16_t* p, int64_t i) {
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}
HD void store(float* p, int64_t i, float v) { p[i] = v; }
HD void store(uint16_t* p, int64_t i, float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        p[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    p[i] = static_cast<uint16_t>(bits >> 16);
}

// --- element functions, shared by the kernels and the host emulation ----------------------

template <typename T>
HD double square_partial(const T* x, int64_t h, int t) {
    double s = 0.0;
    for (int64_t i = t; i < h; i += THREADS) {
        const float v = load(x, i);
        s += static_cast<double>(v) * v;
    }
    return s;
}

template <typename T>
HD double dot_partial(const T* dy, const T* x, const T* w, float inv, int64_t h, int t) {
    double s = 0.0;
    for (int64_t i = t; i < h; i += THREADS)
        s += static_cast<double>(load(dy, i) * load(w, i)) * (load(x, i) * inv);
    return s;
}


template <typename T>
HD void rms_out(const T* x, const T* w, T* y, float inv, int64_t h, int t) {
    for (int64_t i = t; i < h; i += THREADS) store(y, i, load(w, i) * (load(x, i) * inv));
}

template <typename T>
HD void rms_dx(const T* dy, const T* x, const T* w, T* dx, float inv, float mean, int64_t h,
               int t) {
    for (int64_t i = t; i < h; i += THREADS)
        store(dx, i, inv * (load(dy, i) * load(w, i) - (load(x, i) * inv) * mean));
}

template <typename T>
HD float rms_dw_block(const T* dy, const T* x, const float* rstd, int64_t rows, int64_t h,
                      int64_t block, int64_t col) {
    float acc = 0.0f;
    const int64_t end = (block + 1) * RMS_BLOCK < rows ? (block + 1) * RMS_BLOCK : rows;
    for (int64_t r = block * RMS_BLOCK; r < end; ++r)
        acc += load(dy, r * h + col) * (load(x, r * h + col) * rstd[r]);
    return acc;
}

HD float rms_dw_total(const float* partial, int64_t blocks, int64_t h, int64_t col) {
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) total += partial[b * h + col];
    return static_cast<float>(total);
}

template <typename T>
HD void rope_row(const T* q, const T* c, const T* s, T* out, int64_t dim, bool backward,
                 int64_t i) {
    const int64_t half = dim / 2;
    const float q1 = load(q, i), q2 = load(q, i + half);
    if (!backward) {
        store(out, i, q1 * load(c, i) + (-q2) * load(s, i));
        store(out, i + half, q2 * load(c, i + half) + q1 * load(s, i + half));
    } else {
        store(out, i, q1 * load(c, i) + q2 * load(s, i + half));
        store(out, i + half, q2 * load(c, i + half) - q1 * load(s, i));
    }
}

HD float act(float g, int kind) {
    if (kind == 0) return g / (1.0f + expf(-g));
    const float t = tanhf(GELU_C * (g + GELU_K * g * g * g));
    return 0.5f * g * (1.0f + t);
}

HD float act_grad(float g, int kind) {
    if (kind == 0) {
        const float sig = 1.0f / (1.0f + expf(-g));
        return sig * (1.0f + g * (1.0f - sig));
    }
    const float t = tanhf(GELU_C * (g + GELU_K * g * g * g));
    return 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * GELU_C * (1.0f + 3.0f * GELU_K * g * g);
}

template <typename T>
HD void glu_fwd_element(const T* g, const T* u, T* o, int kind, int64_t i) {
    store(o, i, act(load(g, i), kind) * load(u, i));
}

template <typename T>
HD void glu_bwd_element(const T* d, const T* g, const T* u, T* dg, T* du, int kind, int64_t i) {
    const float gv = load(g, i), dv = load(d, i);
    store(dg, i, dv * load(u, i) * act_grad(gv, kind));
    store(du, i, dv * act(gv, kind));
}

// Reduce THREADS partial sums in a fixed tree (host and device alike).
HD double tree_sum(double* parts) {
    for (int stride = THREADS / 2; stride > 0; stride /= 2)
        for (int t = 0; t < stride; ++t) parts[t] += parts[t + stride];
    return parts[0];
}

// --- device kernels -----------------------------------------------------------------------

__device__ double block_tree_sum(double* shared, double mine) {
    const int t = threadIdx.x;
    shared[t] = mine;
    __syncthreads();
    for (int stride = THREADS / 2; stride > 0; stride /= 2) {
        if (t < stride) shared[t] += shared[t + stride];
        __syncthreads();
    }
    const double total = shared[0];
    __syncthreads();
    return total;
}

template <typename T>
__global__ void rms_forward_kernel(const T* x, const T* w, T* y, float* rstd, int64_t h,
                                   float eps) {
    __shared__ double shared[THREADS];
    const int64_t r = blockIdx.x;
    const T* xr = x + r * h;
    const double sum = block_tree_sum(shared, square_partial(xr, h, threadIdx.x));
    const float inv = static_cast<float>(1.0 / sqrt(sum / h + eps));
    if (threadIdx.x == 0) rstd[r] = inv;
    rms_out(xr, w, y + r * h, inv, h, threadIdx.x);
}

template <typename T>
__global__ void rms_backward_kernel(const T* dy, const T* x, const T* w, const float* rstd,
                                    T* dx, int64_t h) {
    __shared__ double shared[THREADS];
    const int64_t r = blockIdx.x;
    const float inv = rstd[r];
    const double dot =
        block_tree_sum(shared, dot_partial(dy + r * h, x + r * h, w, inv, h, threadIdx.x));
    rms_dx(dy + r * h, x + r * h, w, dx + r * h, inv, static_cast<float>(dot / h), h,
           threadIdx.x);
}

template <typename T>
__global__ void rms_dw_partial_kernel(const T* dy, const T* x, const float* rstd,
                                      float* partial, int64_t rows, int64_t h) {
    const int64_t b = blockIdx.y;
    for (int64_t col = blockIdx.x * THREADS + threadIdx.x; col < h; col += gridDim.x * THREADS)
        partial[b * h + col] = rms_dw_block(dy, x, rstd, rows, h, b, col);
}

__global__ void rms_dw_total_kernel(const float* partial, float* dw, int64_t blocks,
                                    int64_t h) {
    const int64_t col = blockIdx.x * static_cast<int64_t>(THREADS) + threadIdx.x;
    if (col < h) dw[col] = rms_dw_total(partial, blocks, h, col);
}

template <typename T>
__global__ void rope_kernel(const T* q, const T* c, const T* s, T* out, int64_t heads,
                            int64_t seq, int64_t dim, int backward) {
    const int64_t r = blockIdx.x;
    const int64_t b = r / (heads * seq), p = r % seq;
    const int64_t cs = (b * seq + p) * dim;
    for (int64_t i = threadIdx.x; i < dim / 2; i += THREADS)
        rope_row(q + r * dim, c + cs, s + cs, out + r * dim, dim, backward != 0, i);
}

template <typename T>
__global__ void glu_forward_kernel(const T* g, const T* u, T* o, int kind, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(THREADS) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * THREADS)
        glu_fwd_element(g, u, o, kind, i);
}

template <typename T>
__global__ void glu_backward_kernel(const T* d, const T* g, const T* u, T* dg, T* du, int kind,
                                    int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(THREADS) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * THREADS)
        glu_bwd_element(d, g, u, dg, du, kind, i);
}

unsigned grid_for(int64_t n) {
    const int64_t blocks = (n + THREADS - 1) / THREADS;
    return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

// --- host emulation (the device's order, sequentially) -------------------------------------

template <typename T>
void rms_forward_host(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t h,
                      float eps) {
    double parts[THREADS];
    for (int64_t r = 0; r < rows; ++r) {
        for (int t = 0; t < THREADS; ++t) parts[t] = square_partial(x + r * h, h, t);
        const float inv = static_cast<float>(1.0 / sqrt(tree_sum(parts) / h + eps));
        rstd[r] = inv;
        for (int t = 0; t < THREADS; ++t) rms_out(x + r * h, w, y + r * h, inv, h, t);
    }
}

template <typename T>
void rms_backward_host(const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                       float* dw, float* partial, int64_t rows, int64_t h) {
    double parts[THREADS];
    for (int64_t r = 0; r < rows; ++r) {
        for (int t = 0; t < THREADS; ++t)
            parts[t] = dot_partial(dy + r * h, x + r * h, w, rstd[r], h, t);
        const float mean = static_cast<float>(tree_sum(parts) / h);
        for (int t = 0; t < THREADS; ++t)
            rms_dx(dy + r * h, x + r * h, w, dx + r * h, rstd[r], mean, h, t);
    }
    const int64_t blocks = (rows + RMS_BLOCK - 1) / RMS_BLOCK;
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t col = 0; col < h; ++col)
            partial[b * h + col] = rms_dw_block(dy, x, rstd, rows, h, b, col);
    for (int64_t col = 0; col < h; ++col) dw[col] = rms_dw_total(partial, blocks, h, col);
}

}  // namespace

#define SAKURA_DISPATCH(dtype, CALL_F32, CALL_BF16) \
    do {                                            \
        if ((dtype) == 0) {                         \
            CALL_F32;                               \
        } else if ((dtype) == 1) {                  \
            CALL_BF16;                              \
        } else {                                    \
            return BAD_ARGUMENTS;                   \
        }                                           \
    } while (0)

#define F(p) static_cast<const float*>(p)
#define FM(p) static_cast<float*>(p)
#define B(p) static_cast<const uint16_t*>(p)
#define BM(p) static_cast<uint16_t*>(p)

extern "C" {

int sakura_kernels_blocks_cuda_abi_version(void) { return 1; }

int sakura_kernels_blocks_cuda_probe(void) {
    int count = 0;
    return static_cast<int>(cudaGetDeviceCount(&count));
}

// dtype: 0 = fp32, 1 = bf16; kind: 0 = silu, 1 = gelu-tanh.  0 on success, -1 for bad
// arguments, else a cudaError_t.  `partial` is a (ceil(rows / 32), h) fp32 scratch buffer.
int sakura_blocks_rmsnorm_forward_cuda(int dtype, const void* x, const void* w, void* y,
                                       float* rstd, int64_t rows, int64_t h, float eps,
                                       cudaStream_t stream) {
    if (rows < 0 || h <= 0 || !(eps >= 0.0f) || rows > 2147483647) return BAD_ARGUMENTS;
    if (rows == 0) return 0;
    SAKURA_DISPATCH(
        dtype,
        (rms_forward_kernel<<<rows, THREADS, 0, stream>>>(F(x), F(w), FM(y), rstd, h, eps)),
        (rms_forward_kernel<<<rows, THREADS, 0, stream>>>(B(x), B(w), BM(y), rstd, h, eps)));
    return static_cast<int>(cudaGetLastError());
}

int sakura_blocks_rmsnorm_backward_cuda(int dtype, const void* dy, const void* x,
                                        const void* w, const float* rstd, void* dx, float* dw,
                                        float* partial, int64_t rows, int64_t h,
                                        cudaStream_t stream) {
    if (rows < 0 || h <= 0 || rows > 2147483647) return BAD_ARGUMENTS;
    const int64_t blocks = (rows + RMS_BLOCK - 1) / RMS_BLOCK;
    const dim3 grid(grid_for(h), static_cast<unsigned>(blocks > 0 ? blocks : 1));
    if (rows > 0) {
        SAKURA_DISPATCH(
            dtype,
            (rms_backward_kernel<<<rows, THREADS, 0, stream>>>(F(dy), F(x), F(w), rstd, FM(dx), h),
             rms_dw_partial_kernel<<<grid, THREADS, 0, stream>>>(F(dy), F(x), rstd, partial,
                                                                   rows, h)),
            (rms_backward_kernel<<<rows, THREADS, 0, stream>>>(B(dy), B(x), B(w), rstd, BM(dx), h),
             rms_dw_partial_kernel<<<grid, THREADS, 0, stream>>>(B(dy), B(x), rstd, partial,
                                                                   rows, h)));
    }
    rms_dw_total_kernel<<<grid_for(h), THREADS, 0, stream>>>(partial, dw, blocks, h);
    return static_cast<int>(cudaGetLastError());
}

int sakura_blocks_rope_cuda(int dtype, const void* q, const void* c, const void* s, void* out,
                            int64_t batch, int64_t heads, int64_t seq, int64_t dim,
                            int backward, cudaStream_t stream) {
    if (batch < 0 || heads < 0 || seq < 0 || dim <= 0 || dim % 2) return BAD_ARGUMENTS;
    const int64_t rows = batch * heads * seq;
    if (rows == 0) return 0;
    if (rows > 2147483647) return BAD_ARGUMENTS;
    SAKURA_DISPATCH(dtype,
                    (rope_kernel<<<rows, THREADS, 0, stream>>>(F(q), F(c), F(s), FM(out), heads,
                                                               seq, dim, backward)),
                    (rope_kernel<<<rows, THREADS, 0, stream>>>(B(q), B(c), B(s), BM(out), heads,
                                                               seq, dim, backward)));
    return static_cast<int>(cudaGetLastError());
}

int sakura_blocks_glu_forward_cuda(int dtype, int kind, const void* g, const void* u, void* o,
                                   int64_t n, cudaStream_t stream) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    if (n == 0) return 0;
    SAKURA_DISPATCH(
        dtype,
        (glu_forward_kernel<<<grid_for(n), THREADS, 0, stream>>>(F(g), F(u), FM(o), kind, n)),
        (glu_forward_kernel<<<grid_for(n), THREADS, 0, stream>>>(B(g), B(u), BM(o), kind, n)));
    return static_cast<int>(cudaGetLastError());
}

int sakura_blocks_glu_backward_cuda(int dtype, int kind, const void* d, const void* g,
                                    const void* u, void* dg, void* du, int64_t n,
                                    cudaStream_t stream) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    if (n == 0) return 0;
    SAKURA_DISPATCH(dtype,
                    (glu_backward_kernel<<<grid_for(n), THREADS, 0, stream>>>(
                        F(d), F(g), F(u), FM(dg), FM(du), kind, n)),
                    (glu_backward_kernel<<<grid_for(n), THREADS, 0, stream>>>(
                        B(d), B(g), B(u), BM(dg), BM(du), kind, n)));
    return static_cast<int>(cudaGetLastError());
}

// Host emulation: host pointers, the device's arithmetic and order.
int sakura_blocks_rmsnorm_forward_emulate(int dtype, const void* x, const void* w, void* y,
                                          float* rstd, int64_t rows, int64_t h, float eps) {
    if (rows < 0 || h <= 0 || !(eps >= 0.0f)) return BAD_ARGUMENTS;
    SAKURA_DISPATCH(dtype, rms_forward_host(F(x), F(w), FM(y), rstd, rows, h, eps),
                    rms_forward_host(B(x), B(w), BM(y), rstd, rows, h, eps));
    return 0;
}

int sakura_blocks_rmsnorm_backward_emulate(int dtype, const void* dy, const void* x,
                                           const void* w, const float* rstd, void* dx,
                                           float* dw, float* partial, int64_t rows,
                                           int64_t h) {
    if (rows < 0 || h <= 0) return BAD_ARGUMENTS;
    SAKURA_DISPATCH(dtype,
                    rms_backward_host(F(dy), F(x), F(w), rstd, FM(dx), dw, partial, rows, h),
                    rms_backward_host(B(dy), B(x), B(w), rstd, BM(dx), dw, partial, rows, h));
    return 0;
}

int sakura_blocks_rope_emulate(int dtype, const void* q, const void* c, const void* s,
                               void* out, int64_t batch, int64_t heads, int64_t seq,
                               int64_t dim, int backward) {
    if (batch < 0 || heads < 0 || seq < 0 || dim <= 0 || dim % 2) return BAD_ARGUMENTS;
    for (int64_t r = 0; r < batch * heads * seq; ++r) {
        const int64_t cs = ((r / (heads * seq)) * seq + r % seq) * dim;
        for (int64_t i = 0; i < dim / 2; ++i) {
            SAKURA_DISPATCH(
                dtype,
                rope_row(F(q) + r * dim, F(c) + cs, F(s) + cs, FM(out) + r * dim, dim,
                         backward != 0, i),
                rope_row(B(q) + r * dim, B(c) + cs, B(s) + cs, BM(out) + r * dim, dim,
                         backward != 0, i));
        }
    }
    return 0;
}

int sakura_blocks_glu_forward_emulate(int dtype, int kind, const void* g, const void* u,
                                      void* o, int64_t n) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    for (int64_t i = 0; i < n; ++i)
        SAKURA_DISPATCH(dtype, glu_fwd_element(F(g), F(u), FM(o), kind, i),
                        glu_fwd_element(B(g), B(u), BM(o), kind, i));
    return 0;
}

int sakura_blocks_glu_backward_emulate(int dtype, int kind, const void* d, const void* g,
                                       const void* u, void* dg, void* du, int64_t n) {
    if (n < 0 || kind < 0 || kind > 1) return BAD_ARGUMENTS;
    for (int64_t i = 0; i < n; ++i)
        SAKURA_DISPATCH(dtype, glu_bwd_element(F(d), F(g), F(u), FM(dg), FM(du), kind, i),
                        glu_bwd_element(B(d), B(g), B(u), BM(dg), BM(du), kind, i));
    return 0;
}

}  // extern "C"
