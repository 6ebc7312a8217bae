// NF4 dequantize on a CUDA device (sakura-quant).
//
// A plain C ABI with no torch headers: compiled with nvcc by sakura.native_cuda (no CUDA
// build of torch needed), called through ctypes with tensor.data_ptr() and
// torch.cuda.current_stream().cuda_stream.  Compiled with --fmad=false, and every product
// and sum written with an explicitly rounded intrinsic, so each value has the bits of the
// CPU kernel (csrc/nf4_cpu.cpp) and of the pure-torch path:
//   byte i/2 holds value i: the even index in the high nibble, the odd one in the low
//   scale  = absmax[b]                                   (fp32 scales), or, double-quantized,
//          = scale_code_values[scale_codes[b]] * scale_absmax[b / 256] + *scale_offset
//   value  = code[nibble] * scale (fp32), then rounded to nearest even for bf16
//
// Every entry point is given the element count of each buffer it reads and checks them (and
// the block size) first: sizes that disagree return SAKURA_QUANT_BAD_ARGUMENTS (-1) and
// nothing is read or launched.  The sizes come from a model file in the end.
//
// sakura_nf4_dequantize_emulate_* run the very same element function on the host, one
// value after another: the test that holds this file to the CPU path runs them on a
// machine without a GPU.
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#define SAKURA_QUANT_CUDA_ABI 2
#define SAKURA_QUANT_BAD_ARGUMENTS (-1)
#define SCALE_BLOCK 256  // scales per fp32 absmax under double quantization

namespace {

struct Scales {
    const float* absmax;             // fp32 scale per block, or nullptr when double-quantized
    const uint8_t* codes;            // one byte per block (double quantization)
    const float* code_values;        // the 256 values of the dynamic map
    const float* code_absmax;        // one fp32 per SCALE_BLOCK block scales
    const float* offset;             // one fp32, the mean of the block scales
};

__host__ __device__ inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

__host__ __device__ inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

__host__ __device__ inline float block_scale(const Scales& s, int64_t b) {
    if (s.absmax != nullptr) return s.absmax[b];
    return add_rn(mul_rn(s.code_values[s.codes[b]], s.code_absmax[b / SCALE_BLOCK]), *s.offset);
}

__host__ __device__ inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__host__ __device__ inline void store(float* out, int64_t i, float v) { out[i] = v; }
__host__ __device__ inline void store(uint16_t* out, int64_t i, float v) { out[i] = f32_to_bf16(v); }

// The two values of byte k (one of them when the count is odd and k is the last byte).
template <typename Out>
__host__ __device__ inline void dequantize_byte(const uint8_t* data, const Scales& s, int64_t n,
                                                int64_t block, const float* code, Out* out,
                                                int64_t k) {
    const uint8_t byte = data[k];
    const int64_t i = 2 * k;
    // block is even, so both values of a byte share one block.
    const float scale = block_scale(s, i / block);
    store(out, i, mul_rn(code[byte >> 4], scale));
    if (i + 1 < n) store(out, i + 1, mul_rn(code[byte & 15], scale));
}

template <typename Out>
__global__ void dequantize_kernel(const uint8_t* data, Scales s, int64_t n, int64_t block,
                                  const float* code, Out* out) {
    const int64_t bytes = (n + 1) / 2;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < bytes; k += stride)
        dequantize_byte(data, s, n, block, code, out, k);
}

Scales make_scales(const float* absmax, const uint8_t* codes, const float* code_values,
                   const float* code_absmax, const float* offset) {
    // Double-quantized scales when their codes are given; the fp32 absmax otherwise.
    return codes != nullptr ? Scales{nullptr, codes, code_values, code_absmax, offset}
                            : Scales{absmax, nullptr, nullptr, nullptr, nullptr};
}

// The element counts of the buffers against n and block: packed codes (n + 1) / 2, one
// scale (or scale code) per block, one code_absmax per SCALE_BLOCK of them, n outputs.
bool sizes_ok(int64_t data_len, const float* absmax, int64_t absmax_len, const uint8_t* codes,
              int64_t codes_len, const float* code_values, const float* code_absmax,
              int64_t code_absmax_len, const float* offset, int64_t n, int64_t block,
              int64_t out_len) {
    if (n < 0 || n > (((int64_t)1) << 62) || out_len != n || data_len != (n + 1) / 2) return false;
    if (block < 2 || block > (((int64_t)1) << 31) || (block & 1)) return false;
    const int64_t blocks = (n + block - 1) / block;
    if (codes == nullptr) return absmax != nullptr && absmax_len == blocks;
    return codes_len == blocks && code_values != nullptr && code_absmax != nullptr &&
           offset != nullptr && code_absmax_len == (blocks + SCALE_BLOCK - 1) / SCALE_BLOCK;
}

template <typename Out>
int launch(const uint8_t* data, const float* absmax, const uint8_t* codes,
           const float* code_values, const float* code_absmax, const float* offset, int64_t n,
           int64_t block, const float* code, Out* out, cudaStream_t stream) {
    const int64_t bytes = (n + 1) / 2;
    if (bytes == 0) return 0;
    const int threads = 256;
    int64_t grid = (bytes + threads - 1) / threads;
    if (grid > 65535 * 8) grid = 65535 * 8;  // the grid-stride loop covers the rest
    dequantize_kernel<Out><<<(unsigned)grid, threads, 0, stream>>>(
        data, make_scales(absmax, codes, code_values, code_absmax, offset), n, block, code, out);
    return (int)cudaGetLastError();
}

template <typename Out>
void emulate(const uint8_t* data, const float* absmax, const uint8_t* codes,
             const float* code_values, const float* code_absmax, const float* offset, int64_t n,
             int64_t block, const float* code, Out* out) {
    const Scales s = make_scales(absmax, codes, code_values, code_absmax, offset);
    for (int64_t k = 0; k < (n + 1) / 2; ++k) dequantize_byte(data, s, n, block, code, out, k);
}

}  // namespace

extern "C" {

int sakura_quant_cuda_abi_version(void) { return SAKURA_QUANT_CUDA_ABI; }

// cudaSuccess (0) when a device can be used by this library's runtime.
int sakura_quant_cuda_probe(void) {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) return (int)status;
    return count > 0 ? 0 : (int)cudaErrorNoDevice;
}

// All pointers are device pointers except where emulated; scale_codes == NULL means the
// fp32 absmax is used (the other double-quantization pointers may then be NULL too).
// *_len are element counts (see sizes_ok).  Returns the cudaError_t of the launch, or
// SAKURA_QUANT_BAD_ARGUMENTS (nothing launched) when the sizes disagree.
#define SAKURA_NF4_ARGS(Out)                                                                   \
    const uint8_t *data, int64_t data_len, const float *absmax, int64_t absmax_len,            \
        const uint8_t *scale_codes, int64_t scale_codes_len, const float *scale_code_values,   \
        const float *scale_absmax, int64_t scale_absmax_len, const float *scale_offset,        \
        int64_t n, int64_t block, const float *code, Out *out, int64_t out_len
#define SAKURA_NF4_CHECK                                                                        \
    if (!sizes_ok(data_len, absmax, absmax_len, scale_codes, scale_codes_len,                   \
                  scale_code_values, scale_absmax, scale_absmax_len, scale_offset, n, block,     \
                  out_len))                                                                      \
        return SAKURA_QUANT_BAD_ARGUMENTS;

int sakura_nf4_dequantize_cuda_f32(SAKURA_NF4_ARGS(float), cudaStream_t stream) {
    SAKURA_NF4_CHECK
    return launch(data, absmax, scale_codes, scale_code_values, scale_absmax, scale_offset, n,
                  block, code, out, stream);
}

int sakura_nf4_dequantize_cuda_bf16(SAKURA_NF4_ARGS(uint16_t), cudaStream_t stream) {
    SAKURA_NF4_CHECK
    return launch(data, absmax, scale_codes, scale_code_values, scale_absmax, scale_offset, n,
                  block, code, out, stream);
}

int sakura_nf4_dequantize_emulate_f32(SAKURA_NF4_ARGS(float)) {
    SAKURA_NF4_CHECK
    emulate(data, absmax, scale_codes, scale_code_values, scale_absmax, scale_offset, n, block,
            code, out);
    return 0;
}

int sakura_nf4_dequantize_emulate_bf16(SAKURA_NF4_ARGS(uint16_t)) {
    SAKURA_NF4_CHECK
    emulate(data, absmax, scale_codes, scale_code_values, scale_absmax, scale_offset, n, block,
            code, out);
    return 0;
}

}  // extern "C"
