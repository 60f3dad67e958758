"""A linear layer's product with one or two rows (a decode step of one or two sequences) in bf16 on x86 CPUs as one
hand-written kernel (docs/graph-mode.md §10).

At batch 1 every linear layer of an eager decode step multiplies its weight by one row, so the step is bound by
reading the weights. torch's bf16 `F.linear` for that shape (oneDNN) read cold weights at 11-16 GB/s on one thread of
this project's machines, and at 15-28 GB/s on two, against ~38 GB/s for a plain streaming read: eager decode spent
~17 ms of a ~22 ms step (4k context, the benchmark shape) in those products. This kernel streams the weight once,
row after row (one sequential stream), with AVX512-BF16 dot products of element pairs (`vdpbf16ps`: fp32 sums of exact
bf16 products, as a bf16 GEMM accumulates), adds the bias and rounds once: 2.3-6.5x `F.linear` on one thread and
1.3-3.9x on two for the benchmark's shapes, from 384 x 1024 to the 32000 x 1024 lm_head (ad-hoc microbenchmark, cold
weights, an earlier version that read 4 rows side by side; reading row after row is 1.2x faster again).

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



// Rows of w are read one after the other, so the whole weight is one sequential stream that the hardware
// prefetchers follow from its first lines (reading 4 rows side by side, as an earlier version did, made 4 short
// streams per 4 rows and read cold weights 1.2-1.3x slower: docs/graph-mode.md §10). Each row's dot product runs on 4
// accumulators (128 elements per step, 32 per `vdpbf16ps`: fp32 sums of exact bf16 products of element pairs), then
// steps of 32 and a masked last step; the sum rounded to bf16 once. `Rows` x vectors (one or two sequences) share
// each weight vector read.
template <int Rows>
void gemv(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t k, const uint16_t* bias, uint16_t* out) {
  const int64_t full = k / 32 * 32, unrolled = k / 128 * 128;
  const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
  auto load = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (int64_t n = 0; n < rows; ++n) {
    const uint16_t* row = w + n * k;
    __m512 acc[Rows][4];
    for (int m = 0; m < Rows; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < unrolled; i += 128)
      for (int j = 0; j < 4; ++j) {
        const __m512bh wv = load(row + i + 32 * j);
        for (int m = 0; m < Rows; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv, load(x + m * k + i + 32 * j));
      }
    for (; i < full; i += 32) {
      const __m512bh wv = load(row + i);
      for (int m = 0; m < Rows; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, load(x + m * k + i));
    }
    if (tail) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + full);
      for (int m = 0; m < Rows; ++m)
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * k + full));
    }
    for (int m = 0; m < Rows; ++m) {
      float sum = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
      if (bias) sum += bf16_to_float(bias[n]);
      out[m * rows + n] = float_to_bf16(sum);
    }
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
  const auto kernel = x.numel() == x.size(-1) ? gemv<1> : gemv<2>;
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
# weights; the 4-rows-side-by-side version, row after row is faster). With 3 or 4 rows that version became
# compute-bound (one `vdpbf16ps` per row and 64 bytes of weight: 0.95-1.56x), so it stops at 2.
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
