// One-row GEMV for int4 weights in `linear.pack_int4_planar`'s layout (symmetric codes, one
// scale per group of G along K) and 16-bit activations: y[m, n] = sum_k q[n, k] scale[n, k / G]
// x[m, k]. Built and called by `llmopt.engines.native.cuda_gemv` (the int4 half of it).
//
// The layout: in each tile of 256 codes, nibble i of word j holds the code of k = 32 i + j. One
// 32-bit word thus holds the codes of k = j, 32 + j, ..., 224 + j, and Marlin's dequantization
// applies to it unchanged: masking nibbles 0 and 4 (bits 0-3 and 16-19) into the mantissas of
// an f16 pair 1024 + u gives the codes of k = j and 128 + j in one instruction, nibbles 1 and 5
// (scaled by 16) those of 32 + j and 160 + j, and after one shift by 8 the other four. The
// activations are staged once per block in shared memory as the matching f16 pairs
// (x[k], x[k + 128]), so each pair of codes costs one f16x2 multiply-add; a thread's products
// within a tile are summed in f16 per scale group (at most 16 products), then scaled in fp32.
// The f16 sums bound what may be staged (see word_as_pairs): a block notes the largest |x| as it
// stages the row and, above kStageMax, stages it again as x / 2^e (e the smallest power that
// brings it under; exact in f16 but for entries 2^e below its subnormals) and multiplies its
// sums back by 2^e in fp32, so that any finite row fits, a real model's massive activations
// included, at no cost to a row that needs no scaling.
//
// NORM: x is an RMSNorm's input and g its weight. The block sums x^2 over the row first and
// stages x g / rms, the normalized activations (the norm's own output, to f16 rounding), so
// that a large residual stream (real models carry entries in the thousands) is brought into
// f16's range before it is staged. RESID: r is added to y in the epilogue.
//
// The work layout is csrc/wo8_gemv.cu's: a block owns ROWS output rows over the whole of K, a
// thread reads 16-byte pieces (a quarter of a tile row) t, t + THREADS, ..., each loop step
// issues UNROLL x ROWS 128-bit weight loads and the next step's before the current products.
// With CHUNKS > 1 a block owns CHUNKS such groups of ROWS rows, one after the other, and its
// loads run ahead across the groups: the activations are staged (and normalized) once per
// CHUNKS x ROWS rows instead of once per ROWS, which is most of a block's own work where K is
// short (4,096: one loop step per group at 128 threads). A config with variant bit kFit takes
// its count of groups per block at launch instead (fit_chunks): as few as let every block of
// the launch be resident at once, so that no last partial wave runs on a mostly idle GPU.
// With SPLIT > 1 the block's warps form SPLIT teams, team t taking groups t, t + SPLIT, ...
// side by side: at K = 4,096 a row is 128 pieces, so in a block of 256 threads working one group
// at a time half the threads had nothing to load, while the team split keeps them all
// streaming and still stages the activations once for the whole block.
//
// With EARLY the block's second loop step is requested with its first, before the dependency
// wait, so that two steps of weights are in flight while the block waits for the kernel before
// and stages its activations (a team with two steps, as at K = 4,096 with two groups per team,
// then has all its weights requested before it reads x); later steps as without it.
#ifndef LLMOPT_INT4_KERNELS_ONLY
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemv_common.cuh"

namespace {

using namespace llmopt_gemv;

// The largest staged |x|: products (codes as q / 16) at most 2,048, f16 sums of 16 at most 32,768.
constexpr float kStageMax = 4096.0f;

// Variant bits of a config (its V): the activations staged with 16-byte loads (stage_row_vec),
// one block barrier per group of rows instead of two (partial sums double-buffered), and the
// groups of rows per block fitted to the GPU at launch (kFit: see fit_chunks) instead of CHUNKS.
constexpr int kVecStage = 1, kOneBarrier = 2, kFit = 4;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ half2 as_half2(uint32_t v) {
  return *reinterpret_cast<half2*>(&v);
}

// (a & b) ^ c in one instruction (LUT 0x6A): written out, the compiler builds the offset, the
// mask and the exponent of each pair with two.
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// The eight codes of one word as four f16 pairs, each code q as q / 16: pair s holds the codes
// of nibbles s and s + 4 (k = 32 s + j and 32 s + 128 + j). A masked nibble u (two's
// complement) is flipped in its top bit (u ^ 8 = q + 8, in 0..15) and given the exponent of
// 1024 in the same instruction (the mask's bits and the exponent's do not overlap); one f16x2
// multiply-add then makes it exactly q / 16: (1024 + q + 8) / 16 - 64.5, or (1024 + 16 (q + 8))
// / 256 - 4.5. As q / 16 (at most 1/2 in size) a product is at most |x| / 2, so the f16 sums of
// up to 16 products cannot overflow below |x| = 8,192 (the Triton kernel's own bound is 16,384);
// the 16 is restored in fp32 at the end.
__device__ __forceinline__ void word_as_pairs(uint32_t word, half2 (&q)[4]) {
  const uint32_t w8 = word >> 8;
  const half2 lo_mul = __float2half2_rn(1.0f / 16.0f), lo_add = __float2half2_rn(-64.5f);
  const half2 hi_mul = __float2half2_rn(1.0f / 256.0f), hi_add = __float2half2_rn(-4.5f);
  q[0] = __hfma2(as_half2(and_xor(word, 0x000f000fu, 0x64086408u)), lo_mul, lo_add);
  q[1] = __hfma2(as_half2(and_xor(word, 0x00f000f0u, 0x64806480u)), hi_mul, hi_add);
  q[2] = __hfma2(as_half2(and_xor(w8, 0x000f000fu, 0x64086408u)), lo_mul, lo_add);
  q[3] = __hfma2(as_half2(and_xor(w8, 0x00f000f0u, 0x64806480u)), hi_mul, hi_add);
}

// Stages the activations x_r (K,) once per block as xs' f16 pairs (x[k0], x[k0 + 128]) (tile t,
// nibble position s, word j), with `norm` first normalized (see NORM above); returns `up`, the
// power of two the staged row was divided by (1 unless its largest |value| is above kStageMax).
// Ends with a block barrier.
template <typename T, int WARPS>
__device__ __forceinline__ float stage_row(const T* __restrict__ xr, const T* __restrict__ g,
                                           float eps, int k, bool norm, half2* xs) {
  constexpr int THREADS = WARPS * 32;
  __shared__ float red[WARPS];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float inv_rms = 1.0f;
  if (norm) {  // the row's sum of squares, before anything is staged
    float sq = 0.0f;
    for (int idx = threadIdx.x; idx < k; idx += THREADS) {
      const float v = to_float<T>(xr[idx]);
      sq = fmaf(v, v, sq);
    }
    sq = warp_sum(sq);
    if (lane == 0) red[warp] = sq;
    __syncthreads();
    sq = 0.0f;
#pragma unroll
    for (int j = 0; j < WARPS; ++j) sq += red[j];
    inv_rms = rsqrtf(sq / k + eps);
  }
  // The value staged at position k0 (before any scaling down): x, or the norm's output.
  auto value = [&](int k0) {
    const float v = to_float<T>(xr[k0]);
    return norm ? v * inv_rms * to_float<T>(g[k0]) : v;
  };
  auto pair_k0 = [](int idx) { return 256 * (idx >> 7) + 32 * ((idx >> 5) & 3) + (idx & 31); };
  // Staged as it is, the row's largest |value| found on the way; a row above kStageMax (rare:
  // a few massive activations) is staged again, scaled down (each thread rewrites its own).
  __shared__ float peak[WARPS];
  float amax = 0.0f;
  for (int idx = threadIdx.x; idx < k / 2; idx += THREADS) {
    const int k0 = pair_k0(idx);
    const float lo = value(k0), hi = value(k0 + 128);
    amax = fmaxf(amax, fmaxf(fabsf(lo), fabsf(hi)));
    xs[idx] = __floats2half2_rn(lo, hi);
  }
  amax = warp_max(amax);
  if (lane == 0) peak[warp] = amax;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < WARPS; ++j) amax = fmaxf(amax, peak[j]);
  float up = 1.0f;
  // (a NaN or infinite row stays as it is: the output is then not finite, as the reference's)
  if (amax > kStageMax && amax <= 3.0e38f) {  // (the same on every thread of the block)
    up = exp2f(ceilf(log2f(amax / kStageMax)));
    const float down = 1.0f / up;  // (a power of two: exact)
    for (int idx = threadIdx.x; idx < k / 2; idx += THREADS) {
      const int k0 = pair_k0(idx);
      xs[idx] = __floats2half2_rn(value(k0) * down, value(k0 + 128) * down);
    }
  }
  __syncthreads();
  return up;
}

// stage_row with 16-byte loads (variant kVecStage): a unit is 8 consecutive values at k0 and
// the 8 at k0 + 128, whose pairs are xs[8 u .. 8 u + 7] (u = k0's unit index: tile, position
// s and word j0 give 128 t + 32 s + j0 = 8 u), written as two 16-byte stores. A thread holds
// up to kHeld units (x, and g with `norm`) in registers, requested together before any is used:
// where the row fits (K <= 16 kHeld THREADS) x is read once, the row's sum of squares and its
// largest |x g| (or |x|) are reduced together behind one barrier, and the row is staged from
// the registers already scaled, instead of the 2-byte loads used one after the other, a second
// pass over x for the norm and a third barrier for the peak. A longer row reads its units
// again for the second pass, a batch of kHeld at a time.
template <typename T, int WARPS>
__device__ __forceinline__ float stage_row_vec(const T* __restrict__ xr, const T* __restrict__ g,
                                               float eps, int k, bool norm, half2* xs) {
  constexpr int THREADS = WARPS * 32;
  // (the whole of a 4,096 row at 4 warps or more, in 32 registers with `norm` at 4 warps: more
  // units per thread cost registers, and registers cost blocks per SM)
  constexpr int kHeld = WARPS >= 8 ? 1 : 8 / WARPS;
  __shared__ float2 red[WARPS];  // (sum of squares, largest |value|) per warp
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int units = k / 16;
  auto unit_k0 = [](int u) { return 256 * (u >> 4) + 32 * ((u >> 2) & 3) + 8 * (u & 3); };
  uint4 xv[kHeld][2], gv[kHeld][2];
  auto load = [&](int u0) {
#pragma unroll
    for (int v = 0; v < kHeld; ++v) {
      const int u = u0 + v * THREADS;
      if (u < units) {
        const int k0 = unit_k0(u);
        xv[v][0] = *reinterpret_cast<const uint4*>(xr + k0);
        xv[v][1] = *reinterpret_cast<const uint4*>(xr + k0 + 128);
        if (norm) {
          gv[v][0] = *reinterpret_cast<const uint4*>(g + k0);
          gv[v][1] = *reinterpret_cast<const uint4*>(g + k0 + 128);
        }
      }
    }
  };
  // element e of half h (0: k0 + e, 1: k0 + 128 + e) of unit v held: x, and x g with `norm`
  auto raw = [&](int v, int h, int e) {
    return to_float<T>(reinterpret_cast<const T*>(&xv[v][h])[e]);
  };
  auto value = [&](int v, int h, int e) {
    const float x0 = raw(v, h, e);
    return norm ? x0 * to_float<T>(reinterpret_cast<const T*>(&gv[v][h])[e]) : x0;
  };
  const int stride = kHeld * THREADS;
  float sq = 0.0f, amax = 0.0f;
  for (int u0 = threadIdx.x; u0 < units; u0 += stride) {
    load(u0);
#pragma unroll
    for (int v = 0; v < kHeld; ++v) {
      if (u0 + v * THREADS >= units) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float x0 = raw(v, h, e);
          sq = fmaf(x0, x0, sq);
          amax = fmaxf(amax, fabsf(value(v, h, e)));
        }
      }
    }
  }
  sq = warp_sum(sq);
  amax = warp_max(amax);
  if (lane == 0) red[warp] = make_float2(sq, amax);
  __syncthreads();
  sq = 0.0f, amax = 0.0f;
#pragma unroll
  for (int j = 0; j < WARPS; ++j) sq += red[j].x, amax = fmaxf(amax, red[j].y);
  const float inv_rms = norm ? rsqrtf(sq / k + eps) : 1.0f;
  amax *= inv_rms;
  float up = 1.0f;
  // (a NaN or infinite row stays as it is: the output is then not finite, as the reference's)
  if (amax > kStageMax && amax <= 3.0e38f) up = exp2f(ceilf(log2f(amax / kStageMax)));
  const float mul = inv_rms / up;  // (up a power of two: dividing by it is exact)
  const bool held = units <= stride;  // (then the loop above left the one batch in registers)
  for (int u0 = threadIdx.x; u0 < units; u0 += stride) {
    if (!held) load(u0);
#pragma unroll
    for (int v = 0; v < kHeld; ++v) {
      const int u = u0 + v * THREADS;
      if (u >= units) break;
      uint32_t pr[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const half2 h = __floats2half2_rn(value(v, 0, e) * mul, value(v, 1, e) * mul);
        pr[e] = *reinterpret_cast<const uint32_t*>(&h);
      }
      uint4* dst = reinterpret_cast<uint4*>(xs + 8 * u);
      dst[0] = make_uint4(pr[0], pr[1], pr[2], pr[3]);
      dst[1] = make_uint4(pr[4], pr[5], pr[6], pr[7]);
    }
  }
  __syncthreads();
  return up;
}

// One piece (16 bytes: 32 codes of four words) of ROWS rows against the staged activations:
// acc[i] += the piece's products with row i's codes, scaled per group. `wp(i)` is row i's
// piece, `scr` the rows' scales (ROWS, groups) as fp32.
template <int ROWS, int GS, typename Piece>
__device__ __forceinline__ void piece_products(const half2* xs, int p, Piece wp,
                                               const float* scr, int groups, int group_shift,
                                               float (&acc)[ROWS]) {
  const int t = p >> 3, j0 = (p & 7) * 4;  // the tile and the piece's first word in it
  half2 xp[4][4];                             // [s][word]: x pairs of this piece
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint4 v = *reinterpret_cast<const uint4*>(xs + t * 128 + s * 32 + j0);
    xp[s][0] = as_half2(v.x);
    xp[s][1] = as_half2(v.y);
    xp[s][2] = as_half2(v.z);
    xp[s][3] = as_half2(v.w);
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const uint4 piece = wp(i);
    const uint32_t ww[4] = {piece.x, piece.y, piece.z, piece.w};
    half2 part[GS];
#pragma unroll
    for (int a = 0; a < GS; ++a) part[a] = __float2half2_rn(0.0f);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      half2 q[4];
      word_as_pairs(ww[b], q);
#pragma unroll
      for (int s = 0; s < 4; ++s) part[s * GS / 4] = __hfma2(q[s], xp[s][b], part[s * GS / 4]);
    }
#pragma unroll
    for (int a = 0; a < GS; ++a) {
      const float2 f = __half22float2(part[a]);
      const int kx = 256 * t + 32 * (a * 4 / GS);  // the first code of the pair's low half
      acc[i] = fmaf(f.x, scr[i * groups + (kx >> group_shift)], acc[i]);
      acc[i] = fmaf(f.y, scr[i * groups + ((kx + 128) >> group_shift)], acc[i]);
    }
  }
}

// The end of a step of SPLIT groups of ROWS rows (group t of team t, rows first, first + ROWS,
// ...): each team's sums to y (times 16 up: codes as q / 16, x staged as x / up), the residual
// added with `resid`, and acc cleared. Starts with a block barrier; with `again` ends with one
// (`partial` read before the next step writes it).
template <typename T, int ROWS, int WARPS, int SPLIT>
__device__ __forceinline__ void write_rows(float (&acc)[ROWS], float (*partial)[ROWS],
                                           int first, float up, const T* __restrict__ r,
                                           T* __restrict__ y, int m, int n, bool resid,
                                           bool again) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) acc[i] = warp_sum(acc[i]);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) partial[warp][i] = acc[i];
  }
  __syncthreads();
  constexpr int TEAM_WARPS = WARPS / SPLIT;
  const int ot = threadIdx.x / ROWS, oi = threadIdx.x % ROWS;  // output: team, row in its group
  const int row = first + ot * ROWS + oi;
  if (threadIdx.x < SPLIT * ROWS && row < n) {
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < TEAM_WARPS; ++j) v += partial[ot * TEAM_WARPS + j][oi];
    v *= 16.0f * up;
    if (resid) v += to_float<T>(r[static_cast<size_t>(m) * n + row]);
    y[static_cast<size_t>(m) * n + row] = from_float<T>(v);
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;
  if (again) __syncthreads();
}

// GS: f16 accumulators per pair position, 128 / min(G, 128) (each sums the pairs s of one
// scale group: G = 32 -> 4, 64 -> 2, 128 or more -> 1). G is a power of two (group_shift =
// log2 G), so that the scale index is a shift.
template <typename T, int ROWS, int WARPS, int UNROLL, int CHUNKS, int SPLIT, bool EARLY, int V,
          int GS>
__global__ void __launch_bounds__(WARPS * 32) int4_gemv_kernel(
    const T* __restrict__ x, const uint32_t* __restrict__ w, const T* __restrict__ scale,
    const T* __restrict__ g, const T* __restrict__ r, float eps, T* __restrict__ y, int n, int k,
    int group_shift, bool norm, bool resid, int fit_chunks) {
  static_assert(WARPS % SPLIT == 0 && CHUNKS % SPLIT == 0, "teams of whole warps and groups");
  constexpr int THREADS = WARPS * 32;
  constexpr int TEAM = THREADS / SPLIT;      // threads per team
  constexpr int STEP = TEAM * UNROLL;
  // groups of ROWS rows per block (a multiple of SPLIT) and per team, one after the other: a
  // constant but with kFit
  const int chunks = (V & kFit) ? fit_chunks : CHUNKS;
  const int team_chunks = (V & kFit) ? fit_chunks / SPLIT : CHUNKS / SPLIT;
  extern __shared__ __align__(16) unsigned char smem[];
  half2* xs = reinterpret_cast<half2*>(smem);                  // (k / 256, 4, 32) pairs
  float* sc = reinterpret_cast<float*>(smem + 2 * static_cast<size_t>(k));  // (chunks ROWS, k / G)
  const int m = blockIdx.y;
  const int n0 = blockIdx.x * ROWS * chunks;
  const int words = k / 8;  // per row
  const int pieces = words / 4;
  const int groups = k >> group_shift;  // (G a power of two: no integer division in the loop)

  // A loop step is (the team's chunk c, first piece b + tid); b is the same for the whole block.
  const int team = threadIdx.x / TEAM, tid = threadIdx.x % TEAM;
  uint4 cur[UNROLL][ROWS];
  auto load_step = [&](uint4 (&dst)[UNROLL][ROWS], int c, int b) {
    const int first = n0 + (c * SPLIT + team) * ROWS;  // the chunk's first row
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const uint32_t* row = w + static_cast<size_t>(min(first + i, n - 1)) * words;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int p = b + tid + u * TEAM;
        dst[u][i] = c < team_chunks && p < pieces
                        ? load_weights(row + static_cast<size_t>(p) * 4)
                        : make_uint4(0, 0, 0, 0);
      }
    }
  };
  // (c, b) -> the next step: the next STEP pieces, or the next chunk's first
  auto advance = [&](int& c, int& b) {
    b += STEP;
    if (b >= pieces) c += 1, b = 0;
  };
  // Weights and scales do not depend on the kernel before (a programmatic dependent launch
  // may start this block while it drains): the first step's weights (two steps' with EARLY)
  // and every scale of the block's rows are requested before waiting, the activations after.
  load_step(cur, 0, 0);
  uint4 nxt[UNROLL][ROWS];  // the step after `cur`'s, once requested
  if constexpr (EARLY) {
    int c1 = 0, b1 = 0;
    advance(c1, b1);
    load_step(nxt, c1, b1);
  }
  for (int idx = threadIdx.x; idx < chunks * ROWS * groups; idx += THREADS) {
    const int i = idx / groups, g = idx % groups;
    sc[idx] = to_float<T>(scale[static_cast<size_t>(min(n0 + i, n - 1)) * groups + g]);
  }
  grid_dependency_wait();
  const T* xr = x + static_cast<size_t>(m) * k;
  // with kOneBarrier, chunk c's sums go to partial[c % 2]: the next chunk's writes cannot
  // reach a slot still being read, so write_rows needs no barrier at its end
  constexpr bool kOne = (V & kOneBarrier) != 0;
  __shared__ float partial[kOne ? 2 : 1][WARPS][ROWS];
  const float up = (V & kVecStage) ? stage_row_vec<T, WARPS>(xr, g, eps, k, norm, xs)
                                   : stage_row<T, WARPS>(xr, g, eps, k, norm, xs);

  float acc[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;
  // (every team runs the same steps: the block's barriers below are reached by all threads)
  for (int c = 0, b = 0; c < team_chunks;) {
    int nc = c, nb = b;  // the next step
    advance(nc, nb);
    if constexpr (!EARLY) load_step(nxt, nc, nb);
    const float* scr = sc + (c * SPLIT + team) * ROWS * groups;  // this chunk's scales
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int p = b + tid + u * TEAM;
      if (p >= pieces) break;
      piece_products<ROWS, GS>(xs, p, [&](int i) { return cur[u][i]; }, scr, groups,
                               group_shift, acc);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int i = 0; i < ROWS; ++i) cur[u][i] = nxt[u][i];
    }
    if constexpr (EARLY) {  // the step after the next one
      int nnc = nc, nnb = nb;
      advance(nnc, nnb);
      load_step(nxt, nnc, nnb);
    }
    if (nc != c) {  // the chunk's rows are done (each team's): their sums to y
      if (nc == team_chunks) launch_dependents();
      write_rows<T, ROWS, WARPS, SPLIT>(acc, partial[kOne ? c & 1 : 0], n0 + c * SPLIT * ROWS,
                                        up, r, y, m, n, resid, team_chunks > 1 && !kOne);
    }
    c = nc, b = nb;
  }
}

// (ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V): `cuda_gemv.INT4_CONFIGS`, same order.
#define LLMOPT_INT4_CONFIGS(X)\
  X(0, 2, 4, 2, 1, 1, 0, 0)   \
  X(1, 4, 4, 1, 1, 1, 0, 0)   \
  X(2, 4, 4, 2, 1, 1, 0, 0)   \
  X(3, 8, 4, 1, 1, 1, 0, 0)   \
  X(4, 2, 8, 1, 1, 1, 0, 0)   \
  X(5, 2, 8, 2, 1, 1, 0, 0)   \
  X(6, 4, 4, 1, 4, 1, 0, 0)   \
  X(7, 8, 4, 1, 4, 1, 0, 0)   \
  X(8, 4, 8, 1, 4, 1, 0, 0)   \
  X(9, 4, 4, 1, 8, 1, 0, 0)   \
  X(10, 4, 8, 1, 8, 1, 0, 0)  \
  X(11, 4, 8, 1, 4, 2, 0, 0)  \
  X(12, 4, 8, 1, 8, 2, 0, 0)  \
  X(13, 8, 8, 1, 4, 2, 0, 0)  \
  X(14, 4, 16, 1, 8, 4, 0, 0) \
  X(15, 4, 4, 1, 4, 1, 1, 0)  \
  X(16, 4, 8, 1, 4, 1, 1, 0)  \
  X(17, 4, 8, 1, 4, 2, 1, 0)  \
  X(18, 4, 8, 1, 8, 2, 1, 0)  \
  X(19, 4, 16, 1, 8, 4, 1, 0) \
  X(20, 4, 4, 1, 8, 1, 0, 1)  \
  X(21, 4, 8, 1, 4, 2, 0, 1)  \
  X(22, 4, 16, 1, 8, 4, 0, 1) \
  X(23, 4, 4, 1, 8, 1, 0, 3)  \
  X(24, 4, 8, 1, 4, 2, 0, 3)  \
  X(25, 4, 16, 1, 8, 4, 0, 3) \
  X(26, 4, 8, 1, 4, 2, 1, 3)  \
  X(27, 4, 16, 1, 8, 4, 1, 3) \
  X(28, 4, 4, 1, 8, 1, 0, 4)  \
  X(29, 4, 4, 1, 8, 1, 0, 5)  \
  X(30, 4, 4, 1, 8, 1, 0, 7)  \
  X(31, 4, 4, 1, 4, 1, 1, 7)

constexpr int kConfigs = 32;

#ifdef LLMOPT_INT4_KERNELS_ONLY
#define LLMOPT_INSTANTIATE_GS(ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V, GS)    \
  template __global__ void                                                            \
  int4_gemv_kernel<__nv_bfloat16, ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V, GS>(  \
      const __nv_bfloat16*, const uint32_t*, const __nv_bfloat16*, const __nv_bfloat16*,   \
      const __nv_bfloat16*, float, __nv_bfloat16*, int, int, int, bool, bool, int);
#define LLMOPT_INSTANTIATE(I, ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V) \
  LLMOPT_INSTANTIATE_GS(ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V, 1)    \
  LLMOPT_INSTANTIATE_GS(ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V, 2)    \
  LLMOPT_INSTANTIATE_GS(ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V, 4)
LLMOPT_INT4_CONFIGS(LLMOPT_INSTANTIATE)
#undef LLMOPT_INSTANTIATE
#undef LLMOPT_INSTANTIATE_GS
}  // namespace
#else

// The fused work's operands: the norm's weight g (K,), the residual r (M, N), each read only
// with its flag (else any tensor).
struct Fused {
  const at::Tensor& g;
  const at::Tensor& r;
  float eps;
  bool norm, resid;
};

// Dynamic shared memory of a config at K and G: the staged activations (2 K bytes) and the
// block's scales as fp32.
size_t smem_for(int rows, int chunks, int64_t k, int64_t group) {
  return static_cast<size_t>(2 * k + static_cast<int64_t>(sizeof(float)) * chunks * rows * (k / group));
}

// A bound on the kernel's static shared memory (the partial sums, the reductions' slots: under
// 1 KB in every config). A launch whose dynamic and static shared memory together pass 48 KB
// must opt in first, however little of it is static.
constexpr size_t kStaticSmem = 2048;

// GS, accumulators per pair position: 4 for groups of 32, 2 for 64, 1 for 128 and more.
template <typename F>
void with_gs(int64_t group, F&& f) {
  if (group == 32) f(std::integral_constant<int, 4>{});
  else if (group == 64) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device));
  return v;
}

// Lets `kernel` take `smem` bytes of dynamic shared memory (past 48 KB a launch must opt in
// first, however little of the rest is static).
template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem, int64_t k, int device) {
  if (smem + kStaticSmem <= 48 * 1024) return;
  const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  TORCH_CHECK(smem + kStaticSmem <= static_cast<size_t>(limit), "int4_gemv: this config needs ",
              smem + kStaticSmem, " bytes of shared memory at K = ", k, ", the GPU allows ",
              limit, " (cuda_gemv.int4_runnable leaves it out)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
}

// A kFit config's groups of `rows` rows per block: the fewest with which every block of the
// launch is resident at once (the blocks each multiprocessor holds, by the occupancy
// calculator, times the multiprocessors), a multiple of `split`. A fixed CHUNKS leaves a last
// partial wave: gate/up at 8 groups of 4 rows is 896 blocks where an H100 holds 792 of them at
// once at 80 registers a thread, and the last 104 run on with most of the GPU idle. More groups per block mean more scales
// in shared memory, which may lower the occupancy: recomputed until it holds (it only grows).
// Capped where the shared memory would pass what a block may have. Cached per kernel, shape
// and GPU: the launch sits on the eager path.
template <typename Kernel>
int fit_chunks(Kernel kernel, int threads, int rows, int split, int64_t m, int64_t n, int64_t k,
               int64_t group, int device) {
  using Key = std::tuple<const void*, int64_t, int64_t, int64_t, int64_t, int>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  const Key key{reinterpret_cast<const void*>(kernel), m, n, k, group, device};
  const std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  const int64_t limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  const int64_t work = (n + rows - 1) / rows * m;  // groups of rows in the launch
  int chunks = split;
  for (;;) {
    const size_t smem = smem_for(rows, chunks, k, group);
    allow_smem(kernel, smem, k, device);
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    const int64_t resident = sms * std::max(per_sm, 1);
    int want = static_cast<int>((work + resident - 1) / resident);
    want = (want + split - 1) / split * split;
    while (want > chunks &&
           static_cast<int64_t>(smem_for(rows, want, k, group) + kStaticSmem) > limit) {
      want -= split;
    }
    if (want <= chunks) break;
    chunks = want;
  }
  cache.emplace(key, chunks);
  return chunks;
}

// One launch: a block of `warps` warps per `chunks` groups of `rows` output rows of each x row.
template <typename T, typename Kernel>
void launch(Kernel kernel, int warps, int rows, int chunks, const at::Tensor& x,
            const at::Tensor& w, const at::Tensor& scale, const Fused& f, at::Tensor& y,
            int64_t group, bool pdl) {
  const int m = x.size(0), k = x.size(1), n = w.size(0);
  const size_t smem = smem_for(rows, chunks, k, group);
  allow_smem(kernel, smem, k, x.device().index());
  const int block_rows = rows * chunks;
  Launch l(dim3((n + block_rows - 1) / block_rows, m), dim3(warps * 32), smem, pdl);
  C10_CUDA_CHECK(cudaLaunchKernelEx(
      &l.cfg, kernel, reinterpret_cast<const T*>(x.data_ptr()),
      reinterpret_cast<const uint32_t*>(w.data_ptr()),
      reinterpret_cast<const T*>(scale.data_ptr()), reinterpret_cast<const T*>(f.g.data_ptr()),
      reinterpret_cast<const T*>(f.r.data_ptr()), f.eps, reinterpret_cast<T*>(y.data_ptr()), n, k,
      __builtin_ctzll(group), f.norm, f.resid, chunks));
}

// A config's shape, as LLMOPT_INT4_CONFIGS gives it.
struct Shape {
  int rows, warps, chunks, split, variant;
};

// f(kernel, shape) for config `config`'s kernel at activations T and group G.
template <typename T, typename F>
void with_kernel(int64_t config, int64_t group, F&& f) {
  switch (config) {
#define LLMOPT_CASE(I, ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V)                          \
  case I:                                                                                     \
    with_gs(group, [&](auto gs) {                                                             \
      f(int4_gemv_kernel<T, ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V, gs.value>,          \
        Shape{ROWS, WARPS, CHUNKS, SPLIT, V});                                                \
    });                                                                                       \
    break;
    LLMOPT_INT4_CONFIGS(LLMOPT_CASE)
#undef LLMOPT_CASE
    default:
      TORCH_CHECK(false, "int4_gemv: config ", config, " out of range 0..", kConfigs - 1);
  }
}

// The groups of rows a block of `shape` takes for x (M, K) and w (N, K / 8): CHUNKS, or with
// kFit as many as fit the launch in one wave.
template <typename Kernel>
int block_chunks(Kernel kernel, const Shape& shape, const at::Tensor& x, const at::Tensor& w,
                 int64_t group) {
  if (!(shape.variant & kFit)) return shape.chunks;
  return fit_chunks(kernel, shape.warps * 32, shape.rows, shape.split, x.size(0), w.size(0),
                    x.size(1), group, x.device().index());
}

template <typename T>
void dispatch(int64_t config, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
              const Fused& f, at::Tensor& y, int64_t group, bool pdl) {
  with_kernel<T>(config, group, [&](auto kernel, const Shape& shape) {
    const int chunks = block_chunks(kernel, shape, x, w, group);
    launch<T>(kernel, shape.warps, shape.rows, chunks, x, w, scale, f, y, group, pdl);
  });
}

// The dynamic shared memory of config `config` at K and G (a kFit config's least: fit_chunks
// stays within what the GPU gives a block).
size_t dynamic_smem(int64_t config, int64_t k, int64_t group) {
  switch (config) {
#define LLMOPT_CASE(I, ROWS, WARPS, UNROLL, CHUNKS, SPLIT, EARLY, V) \
  case I:                                                            \
    return smem_for(ROWS, (V & kFit) ? SPLIT : CHUNKS, k, group);
    LLMOPT_INT4_CONFIGS(LLMOPT_CASE)
#undef LLMOPT_CASE
    default:
      TORCH_CHECK(false, "int4_smem: config ", config, " out of range 0..", kConfigs - 1);
  }
}

// The shared memory config `config` needs at K and G, static included (`cuda_gemv.int4_runnable`
// leaves out what the GPU cannot give one block).
int64_t int4_smem(int64_t config, int64_t k, int64_t group) {
  return static_cast<int64_t>(kStaticSmem + dynamic_smem(config, k, group));
}

}  // namespace

// x (M, K) bf16/fp16, K a multiple of 256; w (N, K / 8) int32 (`pack_int4_planar`); scale
// (N, K / G) in x's dtype; G a power of two, 32 or more. With `norm`, g (K,) the RMSNorm's
// weight in x's dtype; with `resid`, r (M, N) in x's dtype (else each any tensor, unread).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const at::Tensor& g, const at::Tensor& r, int64_t group, double eps,
                     bool norm, bool resid, int64_t config, bool pdl) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && scale.is_cuda(), "int4_gemv: CUDA tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kInt,
              "int4_gemv: x (M, K) and packed int32 w (N, K / 8) expected");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 256 == 0 && w.size(1) * 8 == k, "int4_gemv: K a multiple of 256, w (N, K / 8)");
  TORCH_CHECK(group >= 32 && (group & (group - 1)) == 0, "int4_gemv: G a power of two >= 32");
  TORCH_CHECK(k % group == 0 && scale.numel() == w.size(0) * (k / group) &&
                  scale.scalar_type() == x.scalar_type(),
              "int4_gemv: scale (N, K / G) in the activations' dtype expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous(),
              "int4_gemv: contiguous tensors expected");
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  TORCH_CHECK(aligned(x) && aligned(w), "int4_gemv: x and w must start on 16 bytes (copy a view)");
  if (norm) {
    TORCH_CHECK(g.is_cuda() && g.is_contiguous() && g.numel() == k &&
                    g.scalar_type() == x.scalar_type() && aligned(g),
                "int4_gemv: norm weight (K,) in the activations' dtype, on 16 bytes, expected");
  }
  if (resid) {
    TORCH_CHECK(r.is_cuda() && r.is_contiguous() && r.numel() == x.size(0) * w.size(0) &&
                    r.scalar_type() == x.scalar_type(),
                "int4_gemv: residual (M, N) in the activations' dtype expected");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  const Fused f{g, r, static_cast<float>(eps), norm, resid};
  if (x.scalar_type() == at::kBFloat16) {
    dispatch<__nv_bfloat16>(config, x, w, scale, f, y, group, pdl);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kHalf, "int4_gemv: bf16 or fp16 activations");
    dispatch<__half>(config, x, w, scale, f, y, group, pdl);
  }
  return y;
}

// The groups of rows per block config `config` launches with for x (M, K), w (N, K / 8) and
// group G (CHUNKS, or with kFit what fit_chunks chose on x's GPU).
int64_t int4_chunks(const at::Tensor& x, const at::Tensor& w, int64_t group, int64_t config) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && w.dim() == 2, "int4_chunks: x (M, K), w (N, K / 8)");
  const c10::cuda::CUDAGuard guard(x.device());
  int chunks = 0;
  auto f = [&](auto kernel, const Shape& shape) {
    chunks = block_chunks(kernel, shape, x, w, group);
  };
  if (x.scalar_type() == at::kBFloat16) with_kernel<__nv_bfloat16>(config, group, f);
  else with_kernel<__half>(config, group, f);
  return chunks;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("int4_gemv", &int4_gemv, "One-row GEMV, int4 planar weights (see int4_gemv.cu)");
  mod.def("int4_chunks", &int4_chunks, "Groups of rows per block of a config at this shape");
  mod.def("int4_smem", &int4_smem, "Shared memory (bytes) of a config at K and G");
  mod.attr("configs") = kConfigs;
}
#endif  // LLMOPT_INT4_KERNELS_ONLY
