"""A linear layer's product with one or two rows (a decode step of one or two sequences) in bf16 on x86 CPUs as one
hand-written kernel (docs/graph-mode.md §10).

At batch 1 every linear layer of an eager decode step multiplies its weight by one row, so the step is bound by
reading the weights. torch's bf16 `F.linear` for that shape (oneDNN) read cold weights at 11-16 GB/s on one thread of
this project's machines, and at 15-28 GB/s on two, against ~38 GB/s for a plain streaming read: eager decode spent
~17 ms of a ~22 ms step (4k context, the benchmark shape) in those products. This kernel streams the weight once, four
rows at a time, with AVX512-BF16 dot products of element pairs (`vdpbf16ps`: fp32 sums of exact bf16 products, as a
bf16 GEMM accumulates), adds the bias and rounds once: 2.3-6.5x `F.linear` on one thread and 1.3-3.9x on two for the
benchmark's shapes, from 384 x 1024 to the 32000 x 1024 lm_head (ad-hoc microbenchmark, cold weights).

`modeling_kdsa.linear.linear` calls it for a bf16 product of one or two rows where it applies, eagerly and in a
compiled step, where it is one opaque op: there it also beat inductor's fused multiply-and-sum (docs/graph-mode.md
§9), by 1.13x / 1.16x for the whole compiled step at 4k / 64k, although inductor fuses that sum with the ops around it.

`cpu_extension` builds and loads the C++ source below, which implements the CPU kernel of the `torch.library` op
`kdsa::row_linear` (schema and fake implementation registered here). Where it cannot run (no AVX512-BF16, no
compiler, another dtype, more than two rows, more than `cpu_extension.MAX_THREADS` threads) `F.linear` runs.
"""

import torch
from torch import nn

from .cpu_extension import PRELUDE, compiler, cpu_supports_kernels, few_threads, load

_SOURCE = (
    PRELUDE
    + r"""
namespace {



// out[n] = bias[n] + sum_k w[n, k] x[k]: 4 rows of w at a time, 32 elements per step (vdpbf16ps: fp32 sums of exact
// bf16 products of element pairs), a masked last step; the sum rounded to bf16 once.
void gemv(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t k, const uint16_t* bias, uint16_t* out) {
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
  int64_t n = 0;
  for (; n + 4 <= rows; n += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const uint16_t* row = w + n * k;
    for (int64_t i = 0; i < full; i += 32) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
      for (int r = 0; r < 4; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(row + r * k + i), xv);
    }
    if (tail) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
      for (int r = 0; r < 4; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, row + r * k + full), xv);
    }
    for (int r = 0; r < 4; ++r) {
      float sum = _mm512_reduce_add_ps(acc[r]);
      if (bias) sum += bf16_to_float(bias[n + r]);
      out[n + r] = float_to_bf16(sum);
    }
  }
  for (; n < rows; ++n) {
    __m512 acc = _mm512_setzero_ps();
    const uint16_t* row = w + n * k;
    for (int64_t i = 0; i < full; i += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(row + i), (__m512bh)_mm512_loadu_si512(x + i));
    if (tail)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, row + full),
                             (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full));
    float sum = _mm512_reduce_add_ps(acc);
    if (bias) sum += bf16_to_float(bias[n]);
    out[n] = float_to_bf16(sum);
  }
}


// The same for two rows x0, x1 (a decode step of two sequences): each weight vector is read once for both.
void gemv2(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t k, const uint16_t* bias, uint16_t* out) {
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
  const uint16_t* x1 = x + k;
  auto store = [&](__m512 acc, int64_t m, int64_t n) {
    float sum = _mm512_reduce_add_ps(acc);
    if (bias) sum += bf16_to_float(bias[n]);
    out[m * rows + n] = float_to_bf16(sum);
  };
  int64_t n = 0;
  for (; n + 4 <= rows; n += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const uint16_t* row = w + n * k;
    for (int64_t i = 0; i < full; i += 32) {
      const __m512bh u = (__m512bh)_mm512_loadu_si512(x + i), v = (__m512bh)_mm512_loadu_si512(x1 + i);
      __m512bh wv = (__m512bh)_mm512_loadu_si512(row + i);
      a0 = _mm512_dpbf16_ps(a0, wv, u), b0 = _mm512_dpbf16_ps(b0, wv, v);
      wv = (__m512bh)_mm512_loadu_si512(row + k + i);
      a1 = _mm512_dpbf16_ps(a1, wv, u), b1 = _mm512_dpbf16_ps(b1, wv, v);
      wv = (__m512bh)_mm512_loadu_si512(row + 2 * k + i);
      a2 = _mm512_dpbf16_ps(a2, wv, u), b2 = _mm512_dpbf16_ps(b2, wv, v);
      wv = (__m512bh)_mm512_loadu_si512(row + 3 * k + i);
      a3 = _mm512_dpbf16_ps(a3, wv, u), b3 = _mm512_dpbf16_ps(b3, wv, v);
    }
    if (tail) {
      const __m512bh u = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
      const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(tail, x1 + full);
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + full);
      a0 = _mm512_dpbf16_ps(a0, wv, u), b0 = _mm512_dpbf16_ps(b0, wv, v);
      wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + k + full);
      a1 = _mm512_dpbf16_ps(a1, wv, u), b1 = _mm512_dpbf16_ps(b1, wv, v);
      wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + 2 * k + full);
      a2 = _mm512_dpbf16_ps(a2, wv, u), b2 = _mm512_dpbf16_ps(b2, wv, v);
      wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + 3 * k + full);
      a3 = _mm512_dpbf16_ps(a3, wv, u), b3 = _mm512_dpbf16_ps(b3, wv, v);
    }
    store(a0, 0, n), store(a1, 0, n + 1), store(a2, 0, n + 2), store(a3, 0, n + 3);
    store(b0, 1, n), store(b1, 1, n + 1), store(b2, 1, n + 2), store(b3, 1, n + 3);
  }
  for (; n < rows; ++n) {  // the last rows of w, one at a time
    __m512 a0 = _mm512_setzero_ps(), b0 = a0;
    const uint16_t* row = w + n * k;
    for (int64_t i = 0; i < full; i += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + i);
      a0 = _mm512_dpbf16_ps(a0, wv, (__m512bh)_mm512_loadu_si512(x + i));
      b0 = _mm512_dpbf16_ps(b0, wv, (__m512bh)_mm512_loadu_si512(x1 + i));
    }
    if (tail) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + full);
      a0 = _mm512_dpbf16_ps(a0, wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full));
      b0 = _mm512_dpbf16_ps(b0, wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, x1 + full));
    }
    store(a0, 0, n), store(b0, 1, n);
  }
}

// kdsa::row_linear (schema in Python): x [..., K] holding one or two rows, weight [N, K], bias [N] or none, all
// contiguous bf16; returns [..., N]. Checks what the pointer arithmetic relies on: bad input is a ValueError.
at::Tensor row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  auto fits = [](const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 && t.is_contiguous(); };
  bool ok = fits(x) && fits(weight) && x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) &&
            (x.numel() == x.size(-1) || x.numel() == 2 * x.size(-1)) &&
            (!bias || (fits(*bias) && bias->dim() == 1 && bias->size(0) == weight.size(0)));
  TORCH_CHECK_VALUE(ok,
      "row_linear takes contiguous bf16 x [..., K] holding one or two rows, weight [N, K] and bias [N] or None; got x ",
      describe(x), ", weight ", describe(weight), ", bias ", bias ? describe(*bias) : std::string("None"));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  at::Tensor out = at::empty(shape, x.options());
  const auto kernel = x.numel() == x.size(-1) ? gemv : gemv2;
  kernel((const uint16_t*)x.data_ptr(), (const uint16_t*)weight.data_ptr(), weight.size(0), weight.size(1),
         bias ? (const uint16_t*)bias->data_ptr() : nullptr, (uint16_t*)out.data_ptr());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdsa, CPU, m) { m.impl("row_linear", TORCH_FN(row_linear)); }
"""
)


@torch.compiler.assume_constant_result  # a compiled step takes the answer as a constant instead of tracing a build
def kernel_available() -> bool:
    """The CPU supports the kernel and it is built and loaded (`cpu_extension.load`)."""
    return cpu_supports_kernels() and load("row_linear", _SOURCE, "kdsa::row_linear", compiler())


def row_linear_applies(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel computes `F.linear(hidden_states, weight, bias)`: not under `torch.export`, no autocast, no autograd,
    one or two bf16 rows on a CPU that supports it, a plain contiguous bf16 weight (no tensor subclass such as a
    quantized weight) and bias, at most `cpu_extension.MAX_THREADS` threads — and it is built and loaded."""
    return (
        not torch.compiler.is_exporting()  # an exported program may run where the op is not registered
        and hidden_states.device.type == "cpu"
        and hidden_states.dtype == torch.bfloat16
        and 0 < hidden_states.numel() <= MAX_ROWS * hidden_states.shape[-1]
        and type(weight) in (torch.Tensor, nn.Parameter)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        and not torch.is_autocast_enabled("cpu")
        and not torch.is_grad_enabled()
        and few_threads()
        and kernel_available()
    )


_SCHEMA = "row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"

# One or two rows (a decode step of one or two sequences; two read each weight once for both). oneDNN's bf16 product
# of 2 or 4 rows read cold weights no faster than of one (~14 GB/s). The kernel for 2 rows: 2.1x / 1.6x `F.linear` for
# a 4096 x 1024 weight / the 32000 x 1024 lm_head (one row: 3.0x / 2.3x in the same ad-hoc run, one thread, cold
# weights). A version for up to 4 rows became compute-bound at 3 and 4 (one `vdpbf16ps` per row and 64 bytes of
# weight: 0.95-1.56x) and, written as a template over the row count, slowed the one-row case 1.5x; not kept.
MAX_ROWS = 2


def _fake_row_linear(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Registered as `cpu_indexer` registers its op: the schema and the fake here, the CPU kernel by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "row_linear"):
    _LIBRARY.define(_SCHEMA)
    torch.library.register_fake("kdsa::row_linear", _fake_row_linear, lib=_LIBRARY)
row_linear = torch.ops.kdsa.row_linear

__all__ = ["kernel_available", "row_linear", "row_linear_applies"]
