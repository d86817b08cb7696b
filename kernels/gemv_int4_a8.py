"""Batch-1 decode GEMV for int4 weights (kernels/int4_matmul.py's layout) with the activations rounded to int8: CUDA
C++ compiled at first use by NVRTC (`torch.cuda._compile_kernel`), so no CUDA toolkit is needed beyond PyTorch's.

The half-precision GEMV (kernels/gemv_int4.py) spends ~13 instructions on each word of eight nibbles. Here each
thread takes 32 consecutive activations at a time and rounds each run of RUN = 16 of them to int8 against the run's
absolute maximum (scale = max |x| / 127); a word then costs two masks and two DP4A: the nibbles of even and odd
positions, as bytes, dotted with the matching activation bytes into an exact int32. Scale and zero point apply once
per run: s * x_scale * (sum q x_q - z * sum x_q). On an H200 a Llama-3-8B decode step in int4 runs ~10-13% faster
than with the half-precision GEMV (BENCHMARKS.md).

What rounding the activations costs (`python -m bench.quantization_quality --modes int4 int4_a8`): SmolLM2-135M's
int4 perplexity 43.18 -> 43.22 with runs of 16 (top-1 agreement with the unquantized model 65.1% -> 65.1%; an
earlier version of the bench read +0.35%, and +0.69% / +0.22% for runs of 32 / 8), and on random layers ~0.4-0.5%
of the output against dequantize-then-matmul in float32 where a run holds an outlier channel 15x its neighbours. A
run holding an outlier rounds its other values coarsely; shorter runs confine that to fewer neighbours.

A block of THREADS threads owns ROWS weight rows and walks K in 16-byte chunks (32 weights), each thread issuing
its rows' loads before any arithmetic. The fusions of kernels/gemv_rows.py are here too: NORM multiplies x by the
norm's weight before rounding it and scales the outputs by 1 / rms(x); RESIDUAL adds the residual row; GATED reads
ROWS / 2 gate rows and the matching up rows and writes silu(gate) * up (gate and up rounded to bf16 first). On
Hopper it launches with programmatic dependent launch like the Triton kernels of a decode step (kernels/pdl.py,
kernels/cuda_launch.py): int4 decode 601 -> 616 tok/s.

Its time follows the SM clock more than a pure memory-bound kernel would (Nsight Compute: gate_up 23.3 us at 1.42
GHz, 20.2 us at 1.94 GHz), so instructions a chunk count: rounding by adding 1.5 * 2^23 rather than by a
float-to-int conversion, odd nibbles dotted in place (16 times their value) rather than shifted, the run's maximum
taken on bf16 pairs, the scale multiplied rather than divided, and the shape compiled in took a chunk's loop from 528
to 440 instructions at gate_up; with a warp reduction that halves the rows a lane holds at each exchange (9 shuffles
for 8 rows instead of 40), batch-1 int4 decode of Llama-3-8B went from 2.46x to 2.545x of bf16 (BENCHMARKS.md).

kernels.int4_linear takes it by default; int8_activations=False there (EngineConfig.int4_int8_activations) keeps
every int4 GEMV on the half-precision kernel (bf16 activations)."""

from __future__ import annotations

import functools
import logging

import torch

from kernels import cuda_launch, pdl

ROWS = 8  # weight rows a block owns: the best of 4 / 8 / 16 / 32 at every Llama-3-8B shape on an H200
CHUNK = 32  # weights a thread reads per row at a time (16 bytes)
RUN = 16  # activations rounded against one scale: 8, 16 or 32

_SOURCE = r"""
#define RUN_WORDS (RUN / 8)
struct __align__(16) u32x4 { unsigned a, b, c, d; };

__device__ __forceinline__ u32x4 load_weights(const u32x4* p) {
  u32x4 v;  // volatile: issued where written, all of a thread's rows before any arithmetic
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  return v;
}
// Programmatic dependent launch (kernels/pdl.py): a no-op where the kernel was launched without it.
__device__ __forceinline__ void wait_for_earlier_kernels() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ int dp4a(unsigned a, unsigned b, int c) {
  int d;
  asm volatile("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ unsigned short to_bf16(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float from_bf16(unsigned short h) { return __int_as_float((unsigned)h << 16); }
__device__ __forceinline__ void unpack_bf16(u32x4 v, float* f) {
  f[0] = __int_as_float(v.a << 16); f[1] = __int_as_float(v.a & 0xFFFF0000u);
  f[2] = __int_as_float(v.b << 16); f[3] = __int_as_float(v.b & 0xFFFF0000u);
  f[4] = __int_as_float(v.c << 16); f[5] = __int_as_float(v.c & 0xFFFF0000u);
  f[6] = __int_as_float(v.d << 16); f[7] = __int_as_float(v.d & 0xFFFF0000u);
}
// v * inv (rounded to float) rounded to the nearest integer, ties to even, as cvt.rni would, for |v * inv| <= 127:
// adding 1.5 * 2^23 leaves the integer in the low mantissa bits, its two's complement byte lowest (two full-rate
// float instructions instead of a conversion on the slower XU pipe).
__device__ __forceinline__ unsigned rounded(float v, float inv) {
  return __float_as_uint(__fadd_rn(__fmul_rn(v, inv), 12582912.f));
}
// The low bytes of a, b, c, d as one word, a's lowest.
__device__ __forceinline__ unsigned pack_bytes(unsigned a, unsigned b, unsigned c, unsigned d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}
// The largest |x| of RUN bf16 activations, from their words two at a time (max.xorsign.abs: the larger magnitude of
// each half, its sign the xor of the signs, so only the magnitudes are read).
__device__ __forceinline__ float run_amax(const unsigned* words, const float* values) {
#if __CUDA_ARCH__ >= 860
  unsigned m = words[0];
#pragma unroll
  for (int i = 1; i < RUN / 2; i++) asm("max.xorsign.abs.bf16x2 %0, %0, %1;" : "+r"(m) : "r"(words[i]));
  return fmaxf(fabsf(__int_as_float(m << 16)), fabsf(__int_as_float(m & 0xFFFF0000u)));
#else
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < RUN; i++) amax = fmaxf(amax, fabsf(values[i]));
  return amax;
#endif
}
__device__ __forceinline__ long weight_row(int r) {
#if GATED
  const long channel = (long)blockIdx.x * (ROWS / 2) + r % (ROWS / 2);
#if N_FIXED
  return r < ROWS / 2 ? channel : channel + N_FIXED / 2;
#else
  return r < ROWS / 2 ? channel : channel + gridDim.x * (ROWS / 2);
#endif
#else
  return (long)blockIdx.x * ROWS + r;
#endif
}

// x and residual are written by the kernel before this one: not __restrict__, so that no load of them is treated as
// invariant and moved above the wait for that kernel.
extern "C" __global__ void __launch_bounds__(THREADS) gemv_int4_a8(
    const u32x4* x, const u32x4* __restrict__ qweight, const float* __restrict__ scales,
    const unsigned char* __restrict__ zeros, const unsigned short* __restrict__ bias,
    const u32x4* __restrict__ norm_weight, const unsigned short* residual,
    unsigned short* __restrict__ out, int k_argument, double eps) {
  __shared__ float partial[THREADS / 32][ROWS + 1];
  __shared__ float result[ROWS];
  wait_for_earlier_kernels();
  // A shape compiled in (K_FIXED, N_FIXED) turns the rows' offsets into immediates: fewer instructions a chunk.
#if K_FIXED
  const int K = K_FIXED, channels = GATED ? N_FIXED / 2 : N_FIXED;
#else
  const int K = k_argument, channels = GATED ? gridDim.x * (ROWS / 2) : gridDim.x * ROWS;
#endif
  const int chunks = K / 32, groups = K / GROUP;
  const long m = blockIdx.y;
  const u32x4* x_row = x + m * (K / 8);
  float acc[ROWS], squares = 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; r++) acc[r] = 0.f;
  for (int c = threadIdx.x; c < chunks; c += THREADS) {
    u32x4 w[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) w[r] = load_weights(qweight + weight_row(r) * chunks + c);
    float s[ROWS];
    int z[ROWS];
    const int g = c * 32 / GROUP;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
      s[r] = scales[weight_row(r) * groups + g];
      z[r] = zeros[weight_row(r) * groups + g];
    }
    float f[32];
    u32x4 x_words[4];
#pragma unroll
    for (int j = 0; j < 4; j++) x_words[j] = x_row[4 * c + j];
#pragma unroll
    for (int j = 0; j < 4; j++) unpack_bf16(x_words[j], f + 8 * j);
#if NORM
    float nw[32];
#pragma unroll
    for (int j = 0; j < 4; j++) unpack_bf16(norm_weight[4 * c + j], nw + 8 * j);
#pragma unroll
    for (int i = 0; i < 32; i++) {
      squares = fmaf(f[i], f[i], squares);
      f[i] *= nw[i];
    }
#endif
    // RUN consecutive activations share a scale: each run rounded to int8 against its own absolute maximum.
    // Word j of a row holds weights 8j..8j+7, nibble i at bits 4i: its even nibbles (the low half of each byte) and
    // odd ones (the high half, so 16 times their value) are bytes lining up with activations 8j, 8j+2, 8j+4, 8j+6
    // and 8j+1, ..., 8j+7. Sums, scale and zero-point term are kept at 16 times their value to match (exact: a run's
    // integers stay below 2^24, and scaling a float by 16 or 1/16 is exact).
    float x_scale16[4 / RUN_WORDS];
    int x_sum16[4 / RUN_WORDS];
    unsigned xq[8];
#pragma unroll
    for (int t = 0; t < 4 / RUN_WORDS; t++) {
#if NORM
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < RUN; i++) amax = fmaxf(amax, fabsf(f[RUN * t + i]));
#else
      float amax = run_amax(reinterpret_cast<const unsigned*>(x_words) + t * (RUN / 2), f + RUN * t);
#endif
      amax = fmaxf(amax, 1e-30f);
      const float inv = 127.f / amax;
      x_scale16[t] = amax * (1.f / 2032.f);  // amax * (1 / 127) / 16, exactly
      int x_sum = 0;
#pragma unroll
      for (int j = t * RUN_WORDS; j < (t + 1) * RUN_WORDS; j++) {
        xq[2 * j] = pack_bytes(rounded(f[8 * j], inv), rounded(f[8 * j + 2], inv), rounded(f[8 * j + 4], inv),
                               rounded(f[8 * j + 6], inv));
        xq[2 * j + 1] = pack_bytes(rounded(f[8 * j + 1], inv), rounded(f[8 * j + 3], inv),
                                   rounded(f[8 * j + 5], inv), rounded(f[8 * j + 7], inv));
        x_sum = dp4a(0x01010101u, xq[2 * j], dp4a(0x01010101u, xq[2 * j + 1], x_sum));
      }
      x_sum16[t] = x_sum * 16;
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
      const unsigned words[4] = {w[r].a, w[r].b, w[r].c, w[r].d};
      float chunk = 0.f;
#pragma unroll
      for (int t = 0; t < 4 / RUN_WORDS; t++) {
        int even = 0, odd16 = 0;
#pragma unroll
        for (int j = t * RUN_WORDS; j < (t + 1) * RUN_WORDS; j++) {
          even = dp4a(words[j] & 0x0F0F0F0Fu, xq[2 * j], even);
          odd16 = dp4a(words[j] & 0xF0F0F0F0u, xq[2 * j + 1], odd16);
        }
        chunk = fmaf(x_scale16[t], (float)(even * 16 + odd16 - z[r] * x_sum16[t]), chunk);
      }
      acc[r] = fmaf(s[r], chunk, acc[r]);
    }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // A warp's sums of the ROWS rows: each exchange halves the rows a lane holds (it keeps the half its lane bit picks
  // and adds its partner's copy of that half), then the last offsets add one row across the lanes left.
  int row = 0, o = 16;
#pragma unroll
  for (int half = ROWS / 2; half >= 1; half /= 2, o /= 2) {
    const bool upper = lane & o;
#pragma unroll
    for (int i = 0; i < half; i++) {
      const float send = upper ? acc[i] : acc[i + half];
      const float keep = upper ? acc[i + half] : acc[i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    row += upper ? half : 0;
  }
#pragma unroll
  for (; o > 0; o /= 2) acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
  if (lane % (32 / ROWS) == 0) partial[warp][row] = acc[0];
#if NORM
#pragma unroll
  for (int s = 16; s > 0; s /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, s);
  if (lane == 0) partial[warp][ROWS] = squares;
#endif
  __syncthreads();
  if (threadIdx.x < ROWS) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; i++) t += partial[i][threadIdx.x];
#if NORM
    float sum_squares = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; i++) sum_squares += partial[i][ROWS];
    t *= rsqrtf(sum_squares / K + (float)eps);
#endif
#if HAS_BIAS
    t += from_bf16(bias[weight_row(threadIdx.x)]);
#endif
    result[threadIdx.x] = t;
  }
  __syncthreads();
#if GATED
  if (threadIdx.x < ROWS / 2) {
    const float gate = from_bf16(to_bf16(result[threadIdx.x]));
    const float up = from_bf16(to_bf16(result[threadIdx.x + ROWS / 2]));
    out[m * channels + weight_row(threadIdx.x)] = to_bf16(gate / (1.f + expf(-gate)) * up);
  }
#else
  if (threadIdx.x < ROWS) {
    const long channel = m * channels + weight_row(threadIdx.x);
    float t = result[threadIdx.x];
#if RESIDUAL
    t += from_bf16(residual[channel]);
#endif
    out[channel] = to_bf16(t);
  }
#endif
}
"""


def available() -> bool:
    """Whether PyTorch's NVRTC wrapper, which compiles this kernel, exists."""
    return hasattr(torch.cuda, "_compile_kernel")


def threads_for(rows: int, k: int) -> int:
    """Threads a block: 64 on layers of many rows (qkv, gate_up) and on short K, 128 otherwise (o_proj, down)."""
    return 64 if rows > 4096 or k // CHUNK <= 64 else 128


@functools.lru_cache(maxsize=None)
def _kernel(device: int, threads: int, group: int, run: int, norm: bool, residual: bool, gated: bool, bias: bool,
            n_fixed: int, k_fixed: int):
    """One variant compiled for the device on first use, or None where NVRTC refuses it (logged; `takes` then
    declines and the half-precision GEMV runs). k_fixed / n_fixed: the weight's shape compiled in (0: read at run
    time)."""
    defines = {"ROWS": ROWS, "THREADS": threads, "GROUP": group, "RUN": run, "NORM": int(norm),
               "RESIDUAL": int(residual), "GATED": int(gated), "HAS_BIAS": int(bias), "N_FIXED": n_fixed,
               "K_FIXED": k_fixed}
    source = "".join(f"#define {name} {value}\n" for name, value in defines.items()) + _SOURCE
    try:
        with torch.cuda.device(device):
            return torch.cuda._compile_kernel(source, "gemv_int4_a8")
    except Exception as exc:  # NVRTC missing or refusing: the caller falls back
        logging.getLogger(__name__).warning("int4 GEMV with int8 activations unavailable (%s); using the half-"
                                            "precision GEMV", exc)
        return None


def _variant(x: torch.Tensor, qweight: torch.Tensor, group_size: int, bias: torch.Tensor | None, gated: bool,
             norm: tuple[torch.Tensor, float] | None, residual: torch.Tensor | None):
    """_kernel's arguments for a call. The shape is compiled in except with the norm fusion, where it measured slower
    (qkv 5.47 -> 5.72 us; o_proj 4.47 -> 4.25, gate_up 17.00 -> 16.50, down 9.40 -> 9.07 without it: BENCHMARKS.md)."""
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    n, k = qweight.shape[0], qweight.shape[1] * 8
    fixed = (0, 0) if norm is not None else (n, k)
    return (device, threads_for(n, k), group_size, RUN, norm is not None, residual is not None, gated,
            bias is not None, *fixed)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def problem(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            bias: torch.Tensor | None, gated: bool, norm: tuple[torch.Tensor, float] | None,
            residual: torch.Tensor | None) -> str | None:
    """Why this kernel cannot take these tensors as they are, or None."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32 or not qweight.is_contiguous() or not _aligned(qweight):
        return f"qweight: a contiguous, 16-byte aligned int32 [N, K/8] expected, got {qweight.dtype} {tuple(qweight.shape)}"
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if group_size <= 0 or group_size % CHUNK or k % group_size:
        return f"group_size: a multiple of {CHUNK} dividing K = {k} expected, got {group_size}"
    groups = k // group_size
    for name, t, dtype in (("scales", scales, torch.float32), ("zeros", zeros, torch.uint8)):
        if t.shape != (n, groups) or t.dtype != dtype or not t.is_contiguous():
            return f"{name}: contiguous {dtype} [{n}, {groups}] expected, got {t.dtype} {tuple(t.shape)}"
    if x.dtype != torch.bfloat16 or x.shape[-1] != k or not x.is_contiguous() or not _aligned(x):
        return f"x: contiguous, 16-byte aligned bfloat16 [..., {k}] expected, got {x.dtype} {tuple(x.shape)}"
    channels = n // 2 if gated else n
    if (channels % (ROWS // 2) if gated else n % ROWS) or (gated and n % 2):
        return f"qweight: {'an even number of rows, half of them' if gated else 'rows'} a multiple of " \
               f"{ROWS // 2 if gated else ROWS} expected, got {n}"
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return f"bias: contiguous bfloat16 [{n}] expected, got {bias.dtype} {tuple(bias.shape)}"
    if norm is not None:
        weight = norm[0]
        if weight.shape != (k,) or weight.dtype != torch.bfloat16 or not weight.is_contiguous() or not _aligned(weight):
            return f"norm: a contiguous, 16-byte aligned bfloat16 weight [{k}] expected, got " \
                   f"{weight.dtype} {tuple(weight.shape)}"
    if residual is not None:
        if gated:
            return "residual: a gated GEMV takes no residual"
        rows = x.numel() // k
        if residual.dtype != torch.bfloat16 or residual.numel() != rows * n or residual.shape[-1] != n \
                or not residual.is_contiguous():
            return f"residual: contiguous bfloat16 [{rows}, {n}] expected, got {residual.dtype} " \
                   f"{tuple(residual.shape)}"
    return None


def takes(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
          bias: torch.Tensor | None = None, gated: bool = False, norm: tuple[torch.Tensor, float] | None = None,
          residual: torch.Tensor | None = None) -> bool:
    """Whether gemv_int4_a8 runs this call: CUDA tensors it reads as they are, on a device where its variant compiled
    (compiled here on first use)."""
    if not (x.is_cuda and available()) or problem(x, qweight, scales, zeros, group_size, bias, gated, norm, residual):
        return False
    return _kernel(*_variant(x, qweight, group_size, bias, gated, norm, residual)) is not None


def gemv_int4_a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, *, gated: bool = False,
                 norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """bf16 rows x [..., K] @ dequantized(qweight [N, K/8], scales [N, K/G], zeros [N, K/G])^T + bias -> [..., N],
    x rounded to int8 per RUN values (kernels/reference.py `int4_linear_a8` computes the same); gated: silu of the
    first N / 2 outputs times the last N / 2; norm = (bf16 weight [K], eps): of rms_norm(x, weight, eps);
    residual [..., N]: added to the outputs."""
    reason = problem(x, qweight, scales, zeros, group_size, bias, gated, norm, residual)
    if reason:
        raise ValueError(f"gemv_int4_a8: {reason}")
    if not x.is_cuda:
        raise ValueError(f"gemv_int4_a8: CUDA tensors expected, got x on {x.device}")
    return launch_taken(x, qweight, scales, zeros, group_size, bias, gated=gated, norm=norm, residual=residual)


def launch_taken(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, *, gated: bool = False,
                 norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """gemv_int4_a8 without its checks, for a call that `takes` has accepted with the same arguments."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    rows = x.numel() // k
    channels = n // 2 if gated else n
    out = torch.empty(*x.shape[:-1], channels, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    kernel = _kernel(*_variant(x, qweight, group_size, bias, gated, norm, residual))
    if kernel is None:
        raise RuntimeError("gemv_int4_a8: the kernel did not compile on this device (see the warning logged)")
    threads = threads_for(n, k)
    placeholder = scales
    grid = (channels // (ROWS // 2) if gated else n // ROWS, rows, 1)
    cuda_launch.launch(kernel, grid, (threads, 1, 1),
                       [x, qweight, scales, zeros, bias if bias is not None else placeholder,
                        norm[0] if norm is not None else placeholder,
                        residual if residual is not None else placeholder, out, k,
                        float(norm[1]) if norm is not None else 0.0], pdl=pdl.enabled(x))
    return out
