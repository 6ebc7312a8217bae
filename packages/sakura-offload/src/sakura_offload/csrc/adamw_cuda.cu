// sakura-offload: the AdamW update of csrc/host_adamw.cpp on a CUDA device, for fp32, bf16
// (stochastic rounding) and blockwise 8-bit moments, in the same formats.
//
// A plain C ABI with no torch headers: compiled with nvcc by sakura_torch.native_cuda (no CUDA
// build of torch needed), called through ctypes with tensor.data_ptr() and
// torch.cuda.current_stream().cuda_stream; every launch function returns its cudaError_t.
// Every pointer must be readable and writable by the device: device memory, or page-locked
// host memory (under unified addressing its host pointer is a device pointer).
//
// The element arithmetic is host_adamw.cpp's own (adamw_math.h, __host__ __device__
// here); compiled with --fmad=false so no multiply-add is fused, and sqrt and division
// are IEEE (nvcc's defaults).  The random bits are the same counter-based hashes (of the
// element index for bf16, of the pair of values j, j + 128 of a block for int8), so the
// stochastic rounding draws the same numbers as the CPU kernel and the pure-torch path.
// For int8 moments one thread block of 256 threads handles one block of 256 values (the
// reduction is a max, exact in any order) and writes all 256 codes (zeros past the end, as
// the other implementations).
//
// sakura_adamw_*_emulate run the same element functions on the host, sequentially: the
// test that holds this file to the CPU kernel runs them on a machine without a GPU.

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "adamw_math.h"  // the element arithmetic, shared with host_adamw.cpp

namespace {

constexpr int kThreads = 256;

// --- one element (fp32, bf16) ------------------------------------------------------------

__host__ __device__ inline void fp32_element(const Hyper& h, float* p, const float* g, float* m,
                                             float* v, int64_t i) {
  float mi = m[i], vi = v[i], s;
  p[i] = adam_element(h, p[i], g[i], mi, vi, s);
  m[i] = mi;
  v[i] = vi;
}

__host__ __device__ inline void bf16_element(const Hyper& h, float* p, const float* g,
                                             uint16_t* m, uint16_t* v, uint32_t key, int64_t i) {
  float mi = bf16_decode(m[i]), vi = bf16_decode(v[i]), s;
  p[i] = adam_element(h, p[i], g[i], mi, vi, s);
  const uint32_t r = element_bits(key, i);
  m[i] = bf16_encode_stochastic(mi, r & 0xFFFFU);
  v[i] = bf16_encode_stochastic(vi, r >> 16);
}

// --- int8: the two halves of a block's update, around the block's max ----------------------

// Value j of block b: the new parameter, and the new m and sqrt(v) in m_new / s_new.
__host__ __device__ inline void int8_update(const Hyper& h, float* p, const float* g,
                                            const uint8_t* m_codes, const uint8_t* s_codes,
                                            float m_scale, float s_scale, int64_t i,
                                            float& m_new, float& s_new) {
  float mi = signed_decode(m_codes[i]) * m_scale;
  const float so = unsigned_decode(s_codes[i]) * s_scale;
  float vi = so * so, s;
  p[i] = adam_element(h, p[i], g[i], mi, vi, s);
  m_new = finite_or_zero(mi);  // an Inf / NaN moment stays local (adamw_math.h)
  s_new = s;                   // a non-finite one saturates at the largest code
}

// Value j of block b, index i: its two codes from the new m and sqrt(v) (zeros past the
// end of the tensor) and the block's encode scales.
__host__ __device__ inline void int8_encode(uint8_t* m_codes, uint8_t* s_codes, float m_new,
                                            float s_new, EncodeScale m_sc, EncodeScale s_sc,
                                            uint32_t key, int64_t b, int j) {
  const int64_t i = b * kBlock + j;
  m_codes[i] = signed_encode_nearest(m_new * m_sc.first * m_sc.second);
  s_codes[i] = unsigned_encode_stochastic(s_new * s_sc.first * s_sc.second, pair_bits(key, b, j));
}

// --- kernels -----------------------------------------------------------------------------

__global__ void fp32_kernel(Hyper h, float* p, const float* g, float* m, float* v, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    fp32_element(h, p, g, m, v, i);
}

__global__ void bf16_kernel(Hyper h, float* p, const float* g, uint16_t* m, uint16_t* v,
                            int64_t n, uint32_t key) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    bf16_element(h, p, g, m, v, key, i);
}

// One thread block per 256-value block (blockDim.x == kBlock).
__global__ void int8_kernel(Hyper h, float* p, const float* g, uint8_t* m_codes,
                            float* m_absmax, uint8_t* s_codes, float* s_absmax, int64_t n,
                            uint32_t key) {
  __shared__ float m_max[kBlock];
  __shared__ float s_max[kBlock];
  const int64_t b = blockIdx.x;
  const int j = threadIdx.x;
  const int64_t i = b * kBlock + j;
  const bool live = i < n;
  const float m_scale = m_absmax[b] / kSignedMax;
  const float s_scale = s_absmax[b] / kUnsignedMax;
  float m_new = 0.0f, s_new = 0.0f;
  if (live) int8_update(h, p, g, m_codes, s_codes, m_scale, s_scale, i, m_new, s_new);
  m_max[j] = fabsf(m_new);
  s_max[j] = finite_or_zero(s_new);
  __syncthreads();  // also orders every read of m_absmax[b] before its write below
  for (int width = kBlock / 2; width > 0; width /= 2) {
    if (j < width) {
      m_max[j] = m_max[j] > m_max[j + width] ? m_max[j] : m_max[j + width];
      s_max[j] = s_max[j] > s_max[j + width] ? s_max[j] : s_max[j + width];
    }
    __syncthreads();
  }
  const float m_top = m_max[0], s_top = s_max[0];
  int8_encode(m_codes, s_codes, m_new, s_new, encode_scale(m_top, kSignedMax),
              encode_scale(s_top, kUnsignedMax), key, b, j);
  if (j == 0) {
    m_absmax[b] = m_top;
    s_absmax[b] = s_top;
  }
}

unsigned grid_for(int64_t n) {
  int64_t grid = (n + kThreads - 1) / kThreads;
  if (grid > 65535 * 8) grid = 65535 * 8;  // the grid-stride loops cover the rest
  return static_cast<unsigned>(grid);
}

}  // namespace

extern "C" {

int sakura_offload_cuda_abi_version(void) { return 3; }

// cudaSuccess (0) when a device can be used by this library's runtime.
int sakura_offload_cuda_probe(void) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) return static_cast<int>(status);
  return count > 0 ? 0 : static_cast<int>(cudaErrorNoDevice);
}

// cudaSuccess (0) when the device can read and write p directly: device or managed memory,
// or page-locked host memory whose device address is its host address (unified
// addressing); another error code otherwise, so the caller raises instead of launching a
// kernel that would fault.
int sakura_offload_cuda_reachable(const void* p) {
  cudaPointerAttributes attributes;
  const cudaError_t status = cudaPointerGetAttributes(&attributes, p);
  if (status != cudaSuccess) return static_cast<int>(status);
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged)
    return 0;
  if (attributes.type == cudaMemoryTypeHost && attributes.devicePointer == p) return 0;
  return static_cast<int>(cudaErrorInvalidValue);
}

int sakura_adamw_fp32_cuda(float* p, const float* g, float* m, float* v, int64_t n,
                           float decay, float w1, float beta2, float c2, float eps,
                           float neg_step, float bc2_sqrt, float grad_scale,
                           cudaStream_t stream) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  if (n > 0) fp32_kernel<<<grid_for(n), kThreads, 0, stream>>>(h, p, g, m, v, n);
  return static_cast<int>(cudaGetLastError());
}

int sakura_adamw_bf16_cuda(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                           float decay, float w1, float beta2, float c2, float eps,
                           float neg_step, float bc2_sqrt, float grad_scale, uint32_t key,
                           cudaStream_t stream) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  if (n > 0) bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(h, p, g, m, v, n, key);
  return static_cast<int>(cudaGetLastError());
}

// m_codes / s_codes hold ceil(n / 256) * 256 bytes; m_absmax / s_absmax one float per block.
int sakura_adamw_int8_cuda(float* p, const float* g, uint8_t* m_codes, float* m_absmax,
                           uint8_t* s_codes, float* s_absmax, int64_t n, float decay, float w1,
                           float beta2, float c2, float eps, float neg_step, float bc2_sqrt,
                           float grad_scale, uint32_t key, cudaStream_t stream) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks > 0x7FFFFFFF) return static_cast<int>(cudaErrorInvalidValue);
  if (blocks > 0)
    int8_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
        h, p, g, m_codes, m_absmax, s_codes, s_absmax, n, key);
  return static_cast<int>(cudaGetLastError());
}

// --- the same element functions on the host, for the test without a GPU -----------------

void sakura_adamw_fp32_emulate(float* p, const float* g, float* m, float* v, int64_t n,
                               float decay, float w1, float beta2, float c2, float eps,
                               float neg_step, float bc2_sqrt, float grad_scale) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  for (int64_t i = 0; i < n; ++i) fp32_element(h, p, g, m, v, i);
}

void sakura_adamw_bf16_emulate(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                               float decay, float w1, float beta2, float c2, float eps,
                               float neg_step, float bc2_sqrt, float grad_scale, uint32_t key) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  for (int64_t i = 0; i < n; ++i) bf16_element(h, p, g, m, v, key, i);
}

void sakura_adamw_int8_emulate(float* p, const float* g, uint8_t* m_codes, float* m_absmax,
                               uint8_t* s_codes, float* s_absmax, int64_t n, float decay,
                               float w1, float beta2, float c2, float eps, float neg_step,
                               float bc2_sqrt, float grad_scale, uint32_t key) {
  const Hyper h{decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale};
  float m_new[kBlock], s_new[kBlock];
  for (int64_t b = 0; b * kBlock < n; ++b) {
    const int64_t begin = b * kBlock;
    const int64_t len = n - begin < kBlock ? n - begin : kBlock;
    const float m_scale = m_absmax[b] / kSignedMax;
    const float s_scale = s_absmax[b] / kUnsignedMax;
    float m_top = 0.0f, s_top = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) {
      m_new[j] = s_new[j] = 0.0f;
      if (j < len)
        int8_update(h, p, g, m_codes, s_codes, m_scale, s_scale, begin + j, m_new[j], s_new[j]);
      const float am = fabsf(m_new[j]);
      const float sf = finite_or_zero(s_new[j]);
      m_top = m_top > am ? m_top : am;
      s_top = s_top > sf ? s_top : sf;
    }
    const EncodeScale m_sc = encode_scale(m_top, kSignedMax);
    const EncodeScale s_sc = encode_scale(s_top, kUnsignedMax);
    for (int j = 0; j < kBlock; ++j)
      int8_encode(m_codes, s_codes, m_new[j], s_new[j], m_sc, s_sc, key, b, j);
    m_absmax[b] = m_top;
    s_absmax[b] = s_top;
  }
}

}  // extern "C"
