"""MLA's per-head products with `kv_b_proj`'s weight for 1 to 16 query rows (a decode step of up to 16 sequences,
or a verification of up to 16 tokens) in bf16 on x86 CPUs, as two hand-written kernels that read the weight in place
(docs/dsa.md §13).

An absorbed MLA layer (docs/dsa.md §3) multiplies each head's query by `W_UK[h]` `[Dn, C]` and each head's latent
output by `W_UV[h]ᵀ` (`W_UV[h]`: `[Dv, C]`), both slices of `kv_b_proj.weight` viewed `[H, Dn + Dv, C]`. torch's bf16
einsum is ~100x slower on those strided views, so the layer used to copy both slices every forward and then run two
batched products of one row per head: at the benchmark shape (H = 16, Dn = Dv = 128, C = 512) ~0.5 ms per layer and
decode step for 4 MiB of weight, ~8 GB/s. Here each product reads its slice once, head after head:

- `kdsa::head_matmul(x [..., H, N], weight [H, N, K]) -> [..., H, K]`: `x[.., h] @ weight[h]` (the query's
  absorption, `N = Dn`, `K = C`): weight row n scaled by `x[.., h, n]` and added to fp32 sums of the K outputs,
  rounded to bf16 once;
- `kdsa::head_linear(x [..., H, K], weight [H, N, K]) -> [..., H, N]`: `x[.., h] @ weight[h]ᵀ` (the latent output's
  expansion, `N = Dv`): per head, the row kernel's dot products (`cpu_row_linear`).

The weight may have any head stride (a slice of the heads' `[Dn + Dv, C]` blocks); its rows must be contiguous. Both sum
exact bf16 products in fp32 and round once, as a bf16 GEMM does (the summation order differs: results may differ from
torch's in the last bit). `cpu_extension` builds and loads the C++ source, for AVX512-BF16 or, on CPUs without it, for
AVX2 (`cpu_extension.kernel_isa`, docs/graph-mode.md §13); where the kernels cannot run (no AVX2, no compiler, not bf16,
more than `MAX_ROWS` rows, autograd, export, more than `cpu_extension.MAX_THREADS` threads) the torch reference runs
(`linear_ops.per_head_matmul` / `per_head_linear`: einsums on contiguous copies). `cpu_head_matmul` and
`cpu_head_linear` below are the `cpu` backend's `head_matmul` and `head_linear` (kernels.py).
"""

import torch

from .cpu_extension import plain_tensor
from .cpu_row_linear import few_bf16_rows, gemv_kernel_availability
from .linear_ops import per_head_linear, per_head_matmul

# The AVX512-BF16 build's two steps of `row_times_matrix` (in _OP_SOURCE), after GEMV_SOURCE.
_MATRIX_SOURCE = r"""
namespace {

// 16 bf16 values widened to fp32 (exact).
inline __m512 widen_bf16(__m256i values) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(values), 16));
}

// acc[m * k + j] += x[m * x_stride] * row[j] for j < k and m < Rows: one weight row scaled by each row's value and
// added to the fp32 sums. Whole vectors unmasked: masked stores are slow on some CPUs (AMD Zen 4: 4.6 GB/s instead of
// 23 with them).
template <int Rows>
inline void add_scaled_row(const uint16_t* x, int64_t x_stride, const uint16_t* row, int64_t k, float* acc) {
  __m512 scale[Rows];
  for (int m = 0; m < Rows; ++m) scale[m] = _mm512_set1_ps(bf16_to_float(x[m * x_stride]));
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512 wv = widen_bf16(_mm256_loadu_si256((const __m256i*)(row + j)));
    for (int m = 0; m < Rows; ++m) {
      float* sums = acc + m * k + j;
      _mm512_storeu_ps(sums, _mm512_fmadd_ps(wv, scale[m], _mm512_loadu_ps(sums)));
    }
  }
  if (j < k) {
    const __mmask16 mask = (__mmask16)((1u << (k - j)) - 1);
    const __m512 wv = widen_bf16(_mm256_maskz_loadu_epi16(mask, row + j));
    for (int m = 0; m < Rows; ++m) {
      float* sums = acc + m * k + j;
      _mm512_mask_storeu_ps(sums, mask, _mm512_fmadd_ps(wv, scale[m], _mm512_maskz_loadu_ps(mask, sums)));
    }
  }
}

// out[j] = acc[j] rounded to bf16 for j < k.
inline void round_sums(const float* acc, int64_t k, uint16_t* out) {
  for (int64_t j = 0; j < k; j += 16) {
    const __mmask16 mask = k - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - j)) - 1);
    _mm256_mask_storeu_epi16(out + j, mask, float_to_bf16_x16(_mm512_maskz_loadu_ps(mask, acc + j)));
  }
}

}  // namespace
"""

# The same two steps in the AVX2 build: the same sums in the same order, 8 columns at a time and the last ones one by
# one, so both builds give the same bits.
_MATRIX_AVX2_SOURCE = r"""
namespace {

template <int Rows>
inline void add_scaled_row(const uint16_t* x, int64_t x_stride, const uint16_t* row, int64_t k, float* acc) {
  float value[Rows];
  __m256 scale[Rows];
  for (int m = 0; m < Rows; ++m) scale[m] = _mm256_set1_ps(value[m] = bf16_to_float(x[m * x_stride]));
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m256 wv = widen_bf16x8(row + j);
#pragma GCC unroll 4
    for (int m = 0; m < Rows; ++m) {
      float* sums = acc + m * k + j;
      _mm256_storeu_ps(sums, _mm256_fmadd_ps(wv, scale[m], _mm256_loadu_ps(sums)));
    }
  }
  for (; j < k; ++j)
    for (int m = 0; m < Rows; ++m) acc[m * k + j] += bf16_to_float(row[j]) * value[m];  // exact product
}

inline void round_sums(const float* acc, int64_t k, uint16_t* out) {
  for (int64_t j = 0; j < k; ++j) out[j] = float_to_bf16(acc[j]);
}

}  // namespace
"""

# `row_times_matrix` over either build's `add_scaled_row` and `round_sums`, and the ops over it and the build's `gemv`.
_OP_SOURCE = r"""
#include <ATen/Parallel.h>

namespace {

constexpr int64_t kMaxRows = 16;  // `MAX_ROWS` in Python

// out[m * out_stride + j] = sum_n x[m * x_stride + n] * w[n * k + j] for j < k: the weight's n rows read in order
// (one sequential stream; adding 4 rows per pass over the sums, i.e. reading 4 rows side by side, was 1.4x slower),
// each scaled and added to the fp32 sums `acc` (Rows x k, in L1), which are rounded to bf16 at the end.
template <int Rows>
void row_times_matrix(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t n, int64_t k, uint16_t* out,
                      int64_t out_stride, float* acc) {
  std::fill(acc, acc + Rows * k, 0.0f);
  for (int64_t r = 0; r < n; ++r) add_scaled_row<Rows>(x + r, x_stride, w + r * k, k, acc);
  for (int m = 0; m < Rows; ++m) round_sums(acc + m * k, k, out + m * out_stride);
}

// The checks both ops share: x [..., H, width] contiguous bf16 holding 1 to 16 rows, weight [H, N, K] bf16 with
// contiguous rows (stride(2) = 1, stride(1) = K) and any head stride. Bad input is a ValueError. Returns the rows.
int64_t check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight, int64_t width_dim) {
  bool ok = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
            x.dim() >= 2 && weight.dim() == 3 && weight.size(1) > 0 && weight.size(2) > 0 && weight.stride(2) == 1 &&
            weight.stride(1) == weight.size(2) && weight.stride(0) >= weight.size(1) * weight.size(2) &&
            x.size(-2) == weight.size(0) && x.size(-1) == weight.size(width_dim);
  const int64_t rows = ok && x.size(-2) > 0 ? x.numel() / (x.size(-2) * x.size(-1)) : 0;
  TORCH_CHECK_VALUE(ok && rows >= 1 && rows <= kMaxRows, op, " takes contiguous bf16 x [..., H, ",
      width_dim == 1 ? "N" : "K", "] holding 1 to ", kMaxRows,
      " rows and bf16 weight [H, N, K] whose rows are contiguous; got x ", describe(x), " strides ", x.strides(),
      ", weight ", describe(weight), " strides ", weight.strides());
  return rows;
}

// The op's bf16 result: x's shape with the last dim `width`, uninitialised.
at::Tensor empty_output(const at::Tensor& x, int64_t width) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = width;
  return at::empty(shape, x.options());
}

// Heads split over threads: ~512 KiB of weight per thread at least (a fork costs a few microseconds).
int64_t head_grain(const at::Tensor& weight) {
  return std::max<int64_t>(1, (512 << 10) / (2 * weight.size(1) * weight.size(2)));
}

at::Tensor head_matmul(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t rows = check_inputs("head_matmul", x, weight, 1);
  const int64_t heads = weight.size(0), n = weight.size(1), k = weight.size(2);
  at::Tensor out = empty_output(x, k);
  auto kernel = [](int64_t count) {
    return count == 1 ? row_times_matrix<1> : count == 2 ? row_times_matrix<2> : count == 3 ? row_times_matrix<3>
                                                                                            : row_times_matrix<4>;
  };
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wp = (const uint16_t*)weight.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  // More than 4 rows in groups of up to 4, each a pass over the head's matrix (read from memory by the first group,
  // from cache by the others); every output the same sums in the same order whatever the number of rows.
  at::parallel_for(0, heads, head_grain(weight), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min<int64_t>(rows, 4) * k);
    for (int64_t h = begin; h < end; ++h)
      for (int64_t m = 0; m < rows; m += 4)
        kernel(std::min<int64_t>(4, rows - m))(xp + m * heads * n + h * n, heads * n, wp + h * weight.stride(0), n, k,
                                              op + m * heads * k + h * k, heads * k, acc.data());
  });
  return out;
}

at::Tensor head_linear(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t rows = check_inputs("head_linear", x, weight, 2);
  const int64_t heads = weight.size(0), n = weight.size(1), k = weight.size(2);
  at::Tensor out = empty_output(x, n);
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wp = (const uint16_t*)weight.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, heads, head_grain(weight), [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      gemv(rows, xp + h * k, heads * k, wp + h * weight.stride(0), k, nullptr, op + h * n, heads * n, 0, n);
  });
  return out;
}

}  // namespace

"""
kernel_available = gemv_kernel_availability(
    "head_products", ("head_matmul", "head_linear"), _OP_SOURCE, _MATRIX_SOURCE, _MATRIX_AVX2_SOURCE
)


def kernels_apply(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernels compute the per-head products of `x` `[..., H, N or K]` with `weight` `[H, N, K]`: the row
    kernels' `few_bf16_rows` (a row being all heads' values of a token), a plain bf16 weight (no tensor subclass)
    with contiguous rows, on a CPU that supports them — and they are built and loaded."""
    return (
        x.dim() >= 2
        and few_bf16_rows(x, x.shape[-2] * x.shape[-1])
        and plain_tensor(weight)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 3
        and weight.stride(2) == 1
        and weight.stride(1) == weight.shape[2]
        and kernel_available()
    )


def _fake_head_matmul(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[2])


def _fake_head_linear(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[1])


# Registered as `cpu_indexer` registers its op: the schemas and fakes here, the CPU kernels by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "head_matmul"):
    _LIBRARY.define("head_matmul(Tensor x, Tensor weight) -> Tensor")
    _LIBRARY.define("head_linear(Tensor x, Tensor weight) -> Tensor")
    torch.library.register_fake("kdsa::head_matmul", _fake_head_matmul, lib=_LIBRARY)
    torch.library.register_fake("kdsa::head_linear", _fake_head_linear, lib=_LIBRARY)
head_matmul = torch.ops.kdsa.head_matmul
head_linear = torch.ops.kdsa.head_linear


def cpu_head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The `cpu` backend's `head_matmul`: `kdsa::head_matmul` where `kernels_apply`, else `linear_ops.per_head_matmul`
    (same arguments and result)."""
    if kernels_apply(x, weight):
        return head_matmul(x.contiguous(), weight)
    return per_head_matmul(x, weight)


def cpu_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The `cpu` backend's `head_linear`: `kdsa::head_linear` where `kernels_apply`, else `linear_ops.per_head_linear`
    (same arguments and result)."""
    if kernels_apply(x, weight):
        return head_linear(x.contiguous(), weight)
    return per_head_linear(x, weight)


__all__ = ["cpu_head_linear", "cpu_head_matmul", "head_linear", "head_matmul", "kernel_available", "kernels_apply"]
