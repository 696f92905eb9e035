// One-row GEMV for 1-byte weights (int8 or FP8 E4M3, one scale per output channel) and 16-bit
// activations: y[m, n] = scale[n] * sum_k w[n, k] x[m, k], optionally normalized (the RMSNorm
// whose weight is folded into w's columns) and with a residual added. Built and called by
// `llmopt.engines.native.cuda_gemv`, which explains why this kernel is CUDA C++ and not Triton.
//
// Layout of the work: a block owns ROWS consecutive output rows over the whole of K; its threads
// take K in 16-byte pieces (one 128-bit load per row), thread t the pieces t, t + THREADS, ...,
// so that a warp reads 512 contiguous bytes of each row per step. Each step issues UNROLL x ROWS
// weight loads at once and the next step's before the current step's products, so that a
// thread keeps 2 x UNROLL x ROWS x 16 bytes in flight whatever the occupancy.
//
// LLMOPT_WO8_KERNELS_ONLY compiles the kernels alone, without PyTorch's headers (a CPU-only
// PyTorch has no CUDA headers): tests/unit/engines/native/test_cuda_gemv.py checks with it that
// this file builds for sm_90 wherever nvcc is, and counts its registers and instructions.
#ifndef LLMOPT_WO8_KERNELS_ONLY
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "gemv_common.cuh"

namespace {

using namespace llmopt_gemv;

// Two 16-bit activations of one 32-bit word as floats (element 2i in the low half).
template <typename T>
__device__ __forceinline__ float2 pair_as_floats(uint32_t word);

template <>
__device__ __forceinline__ float2 pair_as_floats<__nv_bfloat16>(uint32_t word) {
  // bf16 is the top half of an fp32: a shift or a mask, no conversion instruction
  return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
}

template <>
__device__ __forceinline__ float2 pair_as_floats<__half>(uint32_t word) {
  __half2 h = *reinterpret_cast<__half2*>(&word);
  return __half22float2(h);
}

// Four weights of one 32-bit word (byte i is k = 4j + i) as floats.
// int8: the byte, offset by 128 to be unsigned, is placed in the low mantissa byte of 2^23 by
// one byte permute, and one subtraction of 2^23 + 128 leaves the exact signed value: a permute
// and an add per weight on the integer and fp32 pipes, where the conversion instruction (I2F)
// runs at a quarter of their rate and would bound the kernel below memory bandwidth.
// FP8 E4M3: the hardware converts pairs to f16 (sm_89+), then f16 to fp32.
template <bool FP8>
__device__ __forceinline__ void word_as_floats(uint32_t word, float (&f)[4]) {
  if constexpr (FP8) {
    __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(word & 0xffffu), __NV_E4M3);
    __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3);
    float2 a = __half22float2(*reinterpret_cast<__half2*>(&lo));
    float2 b = __half22float2(*reinterpret_cast<__half2*>(&hi));
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
  } else {
    const uint32_t u = word ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[i] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540u | i)) - 8388736.0f;
    }
  }
}

template <typename T, bool FP8, int ROWS, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32) wo8_gemv_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ w, const void* __restrict__ scale,
    bool scale_f32, T* __restrict__ y, const T* __restrict__ r, float eps, int n, int k,
    bool norm, bool resid) {
  constexpr int THREADS = WARPS * 32;
  constexpr int STEP = THREADS * UNROLL;  // 16-byte pieces per row per loop step
  const int m = blockIdx.y;
  const int n0 = blockIdx.x * ROWS;
  const int pieces = k / 16;
  const uint8_t* rows[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    // rows past n read row n - 1 again (their sums are not stored): no masks in the loop
    rows[i] = w + static_cast<size_t>(min(n0 + i, n - 1)) * k;
  }
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * k);

  uint4 cur[UNROLL][ROWS];
  auto load_step = [&](uint4 (&dst)[UNROLL][ROWS], int p0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int p = p0 + u * THREADS;
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        dst[u][i] = p < pieces ? load_weights(rows[i] + static_cast<size_t>(p) * 16)
                               : make_uint4(0, 0, 0, 0);
      }
    }
  };

  float acc[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;
  float xsq = 0.0f;

  // Launched as a programmatic dependent, this block may start while the kernel before it
  // drains: the weights do not depend on it, so the first step's are requested before waiting;
  // the activations and the residual only after.
  load_step(cur, threadIdx.x);
  grid_dependency_wait();
  for (int p0 = threadIdx.x; p0 < pieces; p0 += STEP) {
    uint4 nxt[UNROLL][ROWS];
    load_step(nxt, p0 + STEP);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int p = p0 + u * THREADS;
      if (p >= pieces) break;
      // 16 activations: two 128-bit loads (they stay in L1/L2: every block reads them)
      const uint4 xa = xr[2 * p], xb = xr[2 * p + 1];
      const uint32_t xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      float xf[16];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 f = pair_as_floats<T>(xw[j]);
        xf[2 * j] = f.x;
        xf[2 * j + 1] = f.y;
      }
      if (norm) {
#pragma unroll
        for (int j = 0; j < 16; ++j) xsq = fmaf(xf[j], xf[j], xsq);
      }
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        const uint32_t ww[4] = {cur[u][i].x, cur[u][i].y, cur[u][i].z, cur[u][i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float f[4];
          word_as_floats<FP8>(ww[j], f);
#pragma unroll
          for (int b = 0; b < 4; ++b) acc[i] = fmaf(f[b], xf[4 * j + b], acc[i]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int i = 0; i < ROWS; ++i) cur[u][i] = nxt[u][i];
    }
  }
  // every weight load issued: the next dependent kernel may start loading its own
  launch_dependents();

  __shared__ float partial[WARPS][ROWS + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) acc[i] = warp_sum(acc[i]);
  if (norm) xsq = warp_sum(xsq);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) partial[warp][i] = acc[i];
    partial[warp][ROWS] = xsq;
  }
  __syncthreads();
  if (threadIdx.x < ROWS && n0 + static_cast<int>(threadIdx.x) < n) {
    const int i = threadIdx.x, row = n0 + i;
    float v = 0.0f, sq = 0.0f;
#pragma unroll
    for (int j = 0; j < WARPS; ++j) {
      v += partial[j][i];
      sq += partial[j][ROWS];
    }
    const float s = scale_f32 ? static_cast<const float*>(scale)[row]
                              : to_float<T>(static_cast<const T*>(scale)[row]);
    v *= s;
    if (norm) v *= rsqrtf(sq / k + eps);
    if (resid) v += to_float<T>(r[static_cast<size_t>(m) * n + row]);
    y[static_cast<size_t>(m) * n + row] = from_float<T>(v);
  }
}

// The configurations the Python side times per shape (`cuda_gemv.CONFIGS`, same order):
// (ROWS, WARPS, UNROLL).
#define LLMOPT_WO8_CONFIGS(X) \
  X(0, 2, 4, 2)               \
  X(1, 4, 4, 1)               \
  X(2, 4, 4, 2)               \
  X(3, 8, 4, 1)               \
  X(4, 2, 8, 1)               \
  X(5, 4, 8, 1)               \
  X(6, 1, 8, 2)               \
  X(7, 2, 4, 4)

constexpr int kConfigs = 8;

#ifdef LLMOPT_WO8_KERNELS_ONLY
#define LLMOPT_INSTANTIATE(I, ROWS, WARPS, UNROLL)                                         \
  template __global__ void wo8_gemv_kernel<__nv_bfloat16, false, ROWS, WARPS, UNROLL>(    \
      const __nv_bfloat16*, const uint8_t*, const void*, bool, __nv_bfloat16*,            \
      const __nv_bfloat16*, float, int, int, bool, bool);                                 \
  template __global__ void wo8_gemv_kernel<__nv_bfloat16, true, ROWS, WARPS, UNROLL>(     \
      const __nv_bfloat16*, const uint8_t*, const void*, bool, __nv_bfloat16*,            \
      const __nv_bfloat16*, float, int, int, bool, bool);
LLMOPT_WO8_CONFIGS(LLMOPT_INSTANTIATE)
#undef LLMOPT_INSTANTIATE
}  // namespace
#else

template <typename T, bool FP8, int ROWS, int WARPS, int UNROLL>
void launch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor& y,
            const at::Tensor& r, double eps, bool norm, bool resid, bool pdl) {
  const int m = x.size(0), k = x.size(1), n = w.size(0);
  Launch l(dim3((n + ROWS - 1) / ROWS, m), dim3(WARPS * 32), 0, pdl);
  C10_CUDA_CHECK(cudaLaunchKernelEx(
      &l.cfg, wo8_gemv_kernel<T, FP8, ROWS, WARPS, UNROLL>,
      reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const uint8_t*>(w.data_ptr()),
      static_cast<const void*>(scale.data_ptr()), scale.scalar_type() == at::kFloat,
      reinterpret_cast<T*>(y.data_ptr()), reinterpret_cast<const T*>(r.data_ptr()),
      static_cast<float>(eps), n, k, norm, resid));
}

template <typename T, bool FP8>
void dispatch(int64_t config, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
              at::Tensor& y, const at::Tensor& r, double eps, bool norm, bool resid, bool pdl) {
  switch (config) {
#define LLMOPT_CASE(I, ROWS, WARPS, UNROLL)                                          \
  case I:                                                                            \
    launch<T, FP8, ROWS, WARPS, UNROLL>(x, w, scale, y, r, eps, norm, resid, pdl); \
    break;
    LLMOPT_WO8_CONFIGS(LLMOPT_CASE)
#undef LLMOPT_CASE
    default:
      TORCH_CHECK(false, "wo8_gemv: config ", config, " out of range 0..", kConfigs - 1);
  }
}

}  // namespace

// x (M, K) bf16/fp16 contiguous; w (N, K) int8 or float8_e4m3fn contiguous, K a multiple of 16;
// scale (N,) fp32 or x's dtype; r (M, N) x's dtype when `resid` (else any tensor, unread).
at::Tensor wo8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                    const at::Tensor& r, double eps, bool norm, bool resid, int64_t config,
                    bool pdl) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && scale.is_cuda(), "wo8_gemv: CUDA tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "wo8_gemv: x (M, K) and w (N, K) expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous(),
              "wo8_gemv: contiguous tensors expected");
  TORCH_CHECK(w.size(1) % 16 == 0, "wo8_gemv: K must be a multiple of 16");
  TORCH_CHECK(scale.numel() == w.size(0), "wo8_gemv: one scale per output channel expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == x.scalar_type(),
              "wo8_gemv: scale must be fp32 or the activations' dtype");
  if (resid) {
    TORCH_CHECK(r.is_contiguous() && r.scalar_type() == x.scalar_type() &&
                    r.numel() == x.size(0) * w.size(0),
                "wo8_gemv: residual (M, N) in the activations' dtype expected");
  }
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || w.scalar_type() == at::kChar, "wo8_gemv: int8 or float8_e4m3fn weights");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    if (fp8) dispatch<__nv_bfloat16, true>(config, x, w, scale, y, r, eps, norm, resid, pdl);
    else dispatch<__nv_bfloat16, false>(config, x, w, scale, y, r, eps, norm, resid, pdl);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kHalf, "wo8_gemv: bf16 or fp16 activations");
    if (fp8) dispatch<__half, true>(config, x, w, scale, y, r, eps, norm, resid, pdl);
    else dispatch<__half, false>(config, x, w, scale, y, r, eps, norm, resid, pdl);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("wo8_gemv", &wo8_gemv, "One-row GEMV, 1-byte weights (see wo8_gemv.cu)");
  mod.attr("configs") = kConfigs;
}
#endif  // LLMOPT_WO8_KERNELS_ONLY
