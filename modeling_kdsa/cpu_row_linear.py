"""A linear layer's product with 1 to 16 rows (a decode step of up to 16 sequences, or a verification of up to 16
drafted tokens) in bf16 on x86 CPUs as one hand-written kernel (docs/graph-mode.md §10).

At batch 1 every linear layer of an eager decode step multiplies its weight by one row, so the step is bound by
reading the weights. torch's bf16 `F.linear` for that shape (oneDNN) read cold weights at 11-16 GB/s on one thread of
this project's machines, and at 15-28 GB/s on two, against ~38 GB/s for a plain streaming read: eager decode spent
~17 ms of a ~22 ms step (4k context, the benchmark shape) in those products. This kernel streams the weight once, row
after row (one sequential stream; with two threads, one block of rows each), with AVX512-BF16 dot products of element
pairs (`vdpbf16ps`: fp32 sums of exact bf16 products, as a bf16 GEMM accumulates), adds the bias and rounds once.

The `cpu` backend's `row_linear` (`cpu_row_linear` below, kernels.py) calls it for a bf16 product of up to `MAX_ROWS`
rows where it applies, eagerly and in a compiled step, where it is one opaque op: there it also beat inductor's fused
multiply-and-sum for the whole compiled step (docs/graph-mode.md §9, §10), although inductor fuses that sum with the
ops around it.

`cpu_extension` builds and loads the C++ source below, which implements the CPU kernel of the `torch.library` op
`kdsa::row_linear` (schema and fake implementation registered here), or on a CPU without AVX512-BF16 its AVX2 build
(`GEMV_AVX2_SOURCE`, docs/graph-mode.md §13). Where it cannot run (no AVX2, no compiler, another dtype, more than
`MAX_ROWS` rows, more than `cpu_extension.MAX_THREADS` threads) the torch reference runs (`linear_ops.linear`).
"""

import torch

from .cpu_extension import PRELUDE, few_threads, kernel_availability, kernels_traceable, plain_tensor
from .linear_ops import linear

# The product of 1 to 16 rows with a block of weight rows, shared with `cpu_head_products`, `cpu_expert_linear` and
# `cpu_fp8_dequantize` (after PRELUDE).
GEMV_SOURCE = r"""
namespace {

// Rows of the weight are read one after the other, so the whole weight is one sequential stream that the hardware
// prefetchers follow from its first lines (reading 4 rows side by side, as an earlier version did, made 4 short
// streams per 4 rows and read cold weights 1.2-1.3x slower: docs/graph-mode.md §10). Each row's dot product runs on 4
// accumulators (128 elements per step, 32 per `vdpbf16ps`: fp32 sums of exact bf16 products of element pairs), then
// steps of 32 and a masked last step; the sum rounded to bf16 once. The `Rows` x vectors (1 to 4 sequences) share
// each weight vector read. `weights(n)` gives row n's reader, whose `(i, mask)` are the 32 bf16 weights from column i
// (`mask`: the columns that exist, the others 0): loaded, or made in registers (`cpu_fp8_dequantize`'s FP8 rows), so
// every caller adds in this one order. Computes out[m * out_stride + n] for weight rows n in [begin, end), x rows m at
// x + m * x_stride.
template <int Rows, typename Weights>
void gemv_of(const uint16_t* x, int64_t x_stride, const Weights& weights, int64_t k, const uint16_t* bias,
             uint16_t* out, int64_t out_stride, int64_t begin, int64_t end) {
  const int64_t full = k / 32 * 32, unrolled = k / 128 * 128;
  const __mmask32 all = (__mmask32)0xffffffff, tail = (__mmask32)((1ull << (k - full)) - 1);
  auto load = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (int64_t n = begin; n < end; ++n) {
    const auto row = weights(n);
    __m512 acc[Rows][4];
    for (int m = 0; m < Rows; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < unrolled; i += 128)
      for (int j = 0; j < 4; ++j) {
        const __m512bh wv = row(i + 32 * j, all);
        for (int m = 0; m < Rows; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv, load(x + m * x_stride + i + 32 * j));
      }
    for (; i < full; i += 32) {
      const __m512bh wv = row(i, all);
      for (int m = 0; m < Rows; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, load(x + m * x_stride + i));
    }
    if (tail) {
      const __m512bh wv = row(full, tail);
      for (int m = 0; m < Rows; ++m)
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * x_stride + full));
    }
    for (int m = 0; m < Rows; ++m) {
      float sum = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
      if (bias) sum += bf16_to_float(bias[n]);
      out[m * out_stride + n] = float_to_bf16(sum);
    }
  }
}

// Weight rows per block when x has more than 4 rows: ~16 KiB of bf16 weights, which stay in L1 while each group of
// up to 4 x rows passes over them (`weight_block_rows`).
inline int64_t weight_block_rows(int64_t k) { return std::max<int64_t>(1, (16 << 10) / (2 * k)); }

// `gemv_of` for `rows` (1 to 16) x rows: the instantiation chosen at run time, once per call. More than 4 rows (a
// verification of several tokens) go in groups of up to 4 over blocks of weight rows: the block is read from memory
// by the first group and from L1 by the others, so the weight is still streamed once. Each output is the same sum in
// the same order whatever the number of rows (the accumulators do not depend on `Rows`).
template <typename Weights>
void gemv_rows(int64_t rows, const uint16_t* x, int64_t x_stride, const Weights& weights, int64_t k,
               const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t begin, int64_t end) {
  auto group = [&](int64_t count, const uint16_t* gx, uint16_t* gout, int64_t b, int64_t e) {
    switch (count) {
      case 1: gemv_of<1>(gx, x_stride, weights, k, bias, gout, out_stride, b, e); break;
      case 2: gemv_of<2>(gx, x_stride, weights, k, bias, gout, out_stride, b, e); break;
      case 3: gemv_of<3>(gx, x_stride, weights, k, bias, gout, out_stride, b, e); break;
      default: gemv_of<4>(gx, x_stride, weights, k, bias, gout, out_stride, b, e);
    }
  };
  if (rows <= 4) return group(rows, x, out, begin, end);
  const int64_t block = weight_block_rows(k);
  for (int64_t b = begin; b < end; b += block)
    for (int64_t m = 0; m < rows; m += 4)
      group(std::min<int64_t>(4, rows - m), x + m * x_stride, out + m * out_stride, b, std::min(end, b + block));
}

// `gemv_rows` over a bf16 weight whose row n starts at w + n * k.
inline void gemv(int64_t rows, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t k,
                 const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t begin, int64_t end) {
  auto weights = [w, k](int64_t n) {
    return [row = w + n * k](int64_t i, __mmask32 mask) {
      return mask == (__mmask32)0xffffffff ? (__m512bh)_mm512_loadu_si512(row + i)
                                           : (__m512bh)_mm512_maskz_loadu_epi16(mask, row + i);
    };
  };
  gemv_rows(rows, x, x_stride, weights, k, bias, out, out_stride, begin, end);
}

}  // namespace
"""

# `gemv` for CPUs with AVX2 and FMA but no AVX512-BF16 (`cpu_extension.kernel_isa`), same arguments and result up to the
# order of the fp32 sums: there torch's bf16 `F.linear` has no native bf16 instructions to use and read one row's
# weight at ~5 GB/s on one thread (AMD EPYC of the first Zen generation), its fp32 product at ~10-23 GB/s.
GEMV_AVX2_SOURCE = r"""
namespace {

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// As GEMV_SOURCE's `gemv_of`: the weight's rows one after the other (one sequential stream), the `Rows` x rows (1 to 3,
// already widened to fp32, row m at x + m * k) sharing each weight vector read; each dot product on 4 accumulators of
// 8 (FMAs of widened weights: exact products, fp32 sums; 4 chains hide the FMA latency, and 3 rows of them fit the 16
// registers with the weight vector), then steps of 8 and the last columns one by one; rounded to bf16 once. The order
// does not depend on `Rows`, so an output has the same bits whatever rows share the call (a verification of drafted
// tokens gives each the bits of its one-token step). `weights(n)` gives row n's reader: `vec(i)`, the 8 weights from
// column i as fp32, `at(t)` column t's (loaded and widened, `Bf16Row`, or made in registers, `cpu_fp8_dequantize`'s
// FP8 rows), so every caller adds in this one order.
template <int Rows, typename Weights>
void gemv_avx2_of(const float* x, const Weights& weights, int64_t k, const uint16_t* bias, uint16_t* out,
                  int64_t out_stride, int64_t begin, int64_t end) {
  constexpr int Chains = 4;
  const int64_t unrolled = k / (8 * Chains) * (8 * Chains), full = k / 8 * 8;
  for (int64_t n = begin; n < end; ++n) {
    const auto row = weights(n);
    __m256 acc[Rows][Chains];
    for (int m = 0; m < Rows; ++m)
      for (int j = 0; j < Chains; ++j) acc[m][j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i < unrolled; i += 8 * Chains)
#pragma GCC unroll 4  // whole: the accumulators then stay in registers (GCC keeps three of them on the stack otherwise)
      for (int j = 0; j < Chains; ++j) {
        const __m256 wv = row.vec(i + 8 * j);
#pragma GCC unroll 4
        for (int m = 0; m < Rows; ++m)
          acc[m][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i + 8 * j), acc[m][j]);
      }
    for (; i < full; i += 8) {
      const __m256 wv = row.vec(i);
      for (int m = 0; m < Rows; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i), acc[m][0]);
    }
    for (int m = 0; m < Rows; ++m) {
      __m256 total = acc[m][0];
      for (int j = 1; j < Chains; ++j) total = _mm256_add_ps(total, acc[m][j]);
      float sum = sum_lanes(total);
      for (int64_t t = full; t < k; ++t) sum += row.at(t) * x[m * k + t];
      if (bias) sum += bf16_to_float(bias[n]);
      out[m * out_stride + n] = float_to_bf16(sum);
    }
  }
}

// GEMV_SOURCE's `gemv_rows` (same arguments, the AVX2 readers above): the x rows widened once per call, then
// `gemv_avx2_of` for their count; more than 3 rows in groups of up to 3 over blocks of weight rows, as there (the
// block is read from memory once and from L1 by the other groups).
template <typename Weights>
void gemv_rows(int64_t rows, const uint16_t* x, int64_t x_stride, const Weights& weights, int64_t k,
               const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t begin, int64_t end) {
  std::vector<float> wide(rows * k);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; ++i) wide[m * k + i] = bf16_to_float(x[m * x_stride + i]);
  auto group = [&](int64_t count, const float* gx, uint16_t* gout, int64_t b, int64_t e) {
    switch (count) {
      case 1: gemv_avx2_of<1>(gx, weights, k, bias, gout, out_stride, b, e); break;
      case 2: gemv_avx2_of<2>(gx, weights, k, bias, gout, out_stride, b, e); break;
      default: gemv_avx2_of<3>(gx, weights, k, bias, gout, out_stride, b, e);
    }
  };
  if (rows <= 3) return group(rows, wide.data(), out, begin, end);
  const int64_t block = std::max<int64_t>(1, (16 << 10) / (2 * k));  // ~16 KiB of bf16 weights, kept in L1
  for (int64_t b = begin; b < end; b += block)
    for (int64_t m = 0; m < rows; m += 3)
      group(std::min<int64_t>(3, rows - m), wide.data() + m * k, out + m * out_stride, b, std::min(end, b + block));
}

// How far ahead of its reads a weight row's reader asks for the cache line it will need. The weight is one sequential
// stream (its rows are contiguous), but with the hardware prefetchers alone the loads still waited on memory between
// the FMAs; asked for 4 KiB ahead, the lines are there when needed (figures: docs/benchmarks.md §7).
constexpr int64_t kPrefetchBytes = 4096;

// A bf16 weight row's reader for `gemv_avx2_of`; asks for each cache line (32 values) kPrefetchBytes ahead.
struct Bf16Row {
  const uint16_t* p;
  __m256 vec(int64_t i) const {
    if ((i & 31) == 0) _mm_prefetch((const char*)(p + i) + kPrefetchBytes, _MM_HINT_T0);
    return widen_bf16x8(p + i);
  }
  float at(int64_t t) const { return bf16_to_float(p[t]); }
};

// GEMV_SOURCE's `gemv` (same arguments): `gemv_rows` over a bf16 weight whose row n starts at w + n * k.
inline void gemv(int64_t rows, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t k,
                 const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t begin, int64_t end) {
  gemv_rows(rows, x, x_stride, [w, k](int64_t n) { return Bf16Row{w + n * k}; }, k, bias, out, out_stride, begin, end);
}

}  // namespace
"""

# The op over either build's `gemv` (after PRELUDE and GEMV_SOURCE or GEMV_AVX2_SOURCE).
_OP_SOURCE = r"""
#include <ATen/Parallel.h>

namespace {

// kdsa::row_linear (schema in Python): x [..., K] holding 1 to 16 rows, weight [N, K], bias [N] or none, all
// contiguous bf16; returns [..., N]. Checks what the pointer arithmetic relies on: bad input is a ValueError.
constexpr int64_t kMaxRows = 16;  // `MAX_ROWS` in Python

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  auto fits = [](const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 && t.is_contiguous(); };
  bool ok = fits(x) && fits(weight) && x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) &&
            x.size(-1) > 0 && 1 <= x.numel() / x.size(-1) && x.numel() / x.size(-1) <= kMaxRows &&
            (!bias || (fits(*bias) && bias->dim() == 1 && bias->size(0) == weight.size(0)));
  TORCH_CHECK_VALUE(ok,
      "row_linear takes contiguous bf16 x [..., K] holding 1 to ", kMaxRows,
      " rows, weight [N, K] and bias [N] or None; got x ", describe(x), ", weight ", describe(weight), ", bias ",
      bias ? describe(*bias) : std::string("None"));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = weight.size(0), k = weight.size(1), x_rows = x.numel() / k;
  // With 2 threads each reads its own contiguous block of weight rows (still one stream each); a weight under
  // ~512 KiB per thread stays on one thread (a fork costs a few microseconds).
  const int64_t grain = std::max<int64_t>(1, (512 << 10) / (2 * k));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    gemv(x_rows, (const uint16_t*)x.data_ptr(), k, (const uint16_t*)weight.data_ptr(), k,
         bias ? (const uint16_t*)bias->data_ptr() : nullptr, (uint16_t*)out.data_ptr(), rows, begin, end);
  });
  return out;
}

}  // namespace

"""


def gemv_kernel_availability(name: str, ops: tuple[str, ...], op_source: str, avx512_helpers="", avx2_helpers=""):
    """`cpu_extension.kernel_availability` of a kernel built over `gemv` (this module's, `cpu_head_products`,
    `cpu_expert_linear`, `cpu_fp8_dequantize`): PRELUDE, the build's `gemv` (GEMV_SOURCE, or GEMV_AVX2_SOURCE in the
    AVX2 build) and the module's helpers for that build, then `op_source` (the C++ functions, in an anonymous
    namespace), registered as the CPU kernels of the `kdsa::` ops `ops` (each op's function has its name); `name`
    names the build, the first op is the one checked."""
    registration = "".join(f'  m.impl("{op}", TORCH_FN({op}));\n' for op in ops)
    op_source += f"\nTORCH_LIBRARY_IMPL(kdsa, CPU, m) {{\n{registration}}}\n"
    source = PRELUDE + GEMV_SOURCE + avx512_helpers + op_source
    avx2_source = PRELUDE + GEMV_AVX2_SOURCE + avx2_helpers + op_source
    return kernel_availability(name, f"kdsa::{ops[0]}", source, avx2_source)


kernel_available = gemv_kernel_availability("row_linear", ("row_linear",), _OP_SOURCE)


def bf16_kernel_input(x: torch.Tensor) -> bool:
    """What every bf16 CPU kernel of a decode step (this one, `cpu_head_products`, `cpu_expert_linear`,
    `cpu_fp8_dequantize`'s fused product) needs of its activations `x`: bf16 on CPU, not under `torch.export` (an
    exported program may run where the ops are not registered) unless `kernels_in_export()`, no autocast, no autograd,
    at most `cpu_extension.MAX_THREADS` threads."""
    return (
        kernels_traceable()
        and x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and not torch.is_autocast_enabled("cpu")
        and not torch.is_grad_enabled()
        and few_threads()
    )


def few_bf16_rows(x: torch.Tensor, row_width: int) -> bool:
    """`bf16_kernel_input` holding 1 to `MAX_ROWS` rows of `row_width` values: what the row kernels (this one,
    `cpu_head_products`, `cpu_fp8_dequantize`'s fused product) take."""
    return bf16_kernel_input(x) and 0 < x.numel() <= MAX_ROWS * row_width


def row_linear_applies(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel computes `F.linear(hidden_states, weight, bias)`: `few_bf16_rows`, a plain contiguous bf16 weight
    (no tensor subclass such as a quantized weight) and bias, on a CPU that supports it — and it is built and
    loaded."""
    return (
        few_bf16_rows(hidden_states, hidden_states.shape[-1])
        and plain_tensor(weight)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        and kernel_available()
    )


_SCHEMA = "row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"

# Up to 16 rows (a decode step of several sequences, a verification of up to 15 drafted tokens and the anchor): a group
# of rows (up to 4; 3 in the AVX2 build) shares each read of a weight vector, and more rows go in groups over blocks of
# weight rows that stay in L1, so the weight is still read from memory once (figures against oneDNN's product:
# docs/benchmarks.md §7), where the fp32 GEMM that more rows fall back to on a CPU without native bf16 products first
# widens the whole weight (`linear_ops.widens_to_fp32`). More rows: `F.linear` (a GEMM, no longer one read).
MAX_ROWS = 16


def _fake_row_linear(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Registered as `cpu_indexer` registers its op: the schema and the fake here, the CPU kernel by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "row_linear"):
    _LIBRARY.define(_SCHEMA)
    torch.library.register_fake("kdsa::row_linear", _fake_row_linear, lib=_LIBRARY)
row_linear = torch.ops.kdsa.row_linear


def cpu_row_linear(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The `cpu` backend's `row_linear` (kernels.py): the kernel where `row_linear_applies`, else the torch
    reference `linear_ops.linear` (same arguments and result)."""
    if row_linear_applies(hidden_states, weight, bias):
        return row_linear(hidden_states.contiguous(), weight, bias)  # a batch's last-token slice is strided
    return linear(hidden_states, weight, bias)


__all__ = [
    "bf16_kernel_input",
    "cpu_row_linear",
    "few_bf16_rows",
    "gemv_kernel_availability",
    "kernel_available",
    "row_linear",
    "row_linear_applies",
]
