"""Block-scaled E4M3 weights dequantized on x86 CPUs by one hand-written, vectorised kernel
(docs/checkpoint-conversion.md §9).

`fp8_linear.dequantize_tiles` (`values.float() * scales`, then a cast) runs on every forward of a layer held in FP8.
torch's float8 -> float conversion on CPU is element by element, ~3 ns each: 3.3 ms for a 1024 x 1024 weight, ~140x
the product of one row with the BF16 weight, so a held model decoded two orders of magnitude slower than a BF16 one.
This kernel computes the same values with AVX512, 16 at a time, bit for bit (NaN aside: see the C++ comments).

`cpu_extension` builds and loads the C++ source below, which implements the CPU kernel of the `torch.library` op
`kdsa::dequantize_fp8_tiles` (schema and fake implementation registered here). `dequantize_tiles` calls it outside a
compile (inside one, inductor fuses the conversion into the product's loop) for a bf16 or fp32 result on a CPU that
supports it; elsewhere the torch path runs. Rows are split over torch's intra-op threads, at any thread count
(measured at 1 and 2: `scripts/bench_cpu_kernels.py`).
"""

import torch

from .cpu_extension import PRELUDE, compiler, cpu_supports_kernels, load

_SOURCE = (
    PRELUDE
    + r"""
#include <ATen/Parallel.h>

namespace {

// 16 E4M3 (float8_e4m3fn) bytes as fp32, exactly. A normal value's 4 exponent and 3 mantissa bits, shifted into
// fp32's fields, need the exponent bias raised from 7 to 127 (an integer add); a subnormal is m x 2^-9 (converted
// from the integer m, then scaled by a power of two: exact, and no fp32 denormal is involved, so a flush-to-zero mode
// cannot change it). 0x7f / 0xff are NaN (the format has no infinities).
inline __m512 e4m3_to_fp32(__m128i bytes) {
  const __m512i b = _mm512_cvtepu8_epi32(bytes);
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(1.0f / 512.0f));
  __m512 value = _mm512_mask_mov_ps(_mm512_castsi512_ps(normal),
                                    _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8)), subnormal);
  value = _mm512_mask_mov_ps(value, _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7f)),
                             _mm512_set1_ps(NAN));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

// fp32 -> bf16, round to nearest even, as torch's conversion. The values are products, so a NaN is quiet (bit 22 set)
// and the rounding keeps it a NaN (its bits may differ from torch's, whose own NaN bits depend on whether its
// vectorised or scalar path converted the element).
inline __m256i fp32_to_bf16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
}

// One row of `cols` values: value x the scale of its column block, written as fp32 or bf16.
template <bool Bf16>
void dequantize_row(const uint8_t* values, const float* scales, int64_t cols, int64_t block_cols, void* out) {
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 mask = (__mmask16)(cols - c >= 16 ? 0xffff : (1u << (cols - c)) - 1);
    // 16 columns share one scale when block_cols is a multiple of 16; otherwise each column looks its block up.
    __m512 scale;
    if (block_cols % 16 == 0) {
      scale = _mm512_set1_ps(scales[c / block_cols]);
    } else {
      alignas(64) float lane_scales[16];
      for (int j = 0; j < 16; ++j) lane_scales[j] = scales[std::min(c + j, cols - 1) / block_cols];
      scale = _mm512_load_ps(lane_scales);
    }
    // Whole vectors unmasked: masked stores are slow on some CPUs (AMD Zen 4), the tail masked.
    const bool whole = cols - c >= 16;
    const __m128i bytes =
        whole ? _mm_loadu_si128((const __m128i*)(values + c)) : _mm_maskz_loadu_epi8(mask, values + c);
    const __m512 value = _mm512_mul_ps(e4m3_to_fp32(bytes), scale);
    if constexpr (Bf16) {
      if (whole)
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + c), fp32_to_bf16(value));
      else
        _mm256_mask_storeu_epi16((uint16_t*)out + c, mask, fp32_to_bf16(value));
    } else {
      if (whole)
        _mm512_storeu_ps((float*)out + c, value);
      else
        _mm512_mask_storeu_ps((float*)out + c, mask, value);
    }
  }
}

}  // namespace

// kdsa::dequantize_fp8_tiles (schema in Python): values [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N / br),
// ceil(K / bc)] fp32 (the same leading dims), both contiguous; returns values x the scale of each (br x bc) tile as
// `dtype` (bf16 or fp32), the products in fp32 as `values.float() * scales`. Bad input is a ValueError.
at::Tensor dequantize_fp8_tiles(const at::Tensor& values, const at::Tensor& scale_inv, int64_t block_rows,
                                int64_t block_cols, at::ScalarType dtype) {
  bool ok = values.scalar_type() == at::kFloat8_e4m3fn && scale_inv.scalar_type() == at::kFloat &&
            values.is_contiguous() && scale_inv.is_contiguous() && values.dim() >= 2 &&
            scale_inv.dim() == values.dim() && block_rows > 0 && block_cols > 0 &&
            (dtype == at::kBFloat16 || dtype == at::kFloat);
  if (ok) {
    const int64_t d = values.dim();
    ok = scale_inv.sizes().slice(0, d - 2) == values.sizes().slice(0, d - 2) &&
         scale_inv.size(d - 2) == (values.size(d - 2) + block_rows - 1) / block_rows &&
         scale_inv.size(d - 1) == (values.size(d - 1) + block_cols - 1) / block_cols;
  }
  TORCH_CHECK_VALUE(ok,
      "dequantize_fp8_tiles takes contiguous float8_e4m3fn values [..., N, K], fp32 scale_inv [..., ceil(N / ",
      block_rows, "), ceil(K / ", block_cols, ")] and dtype bf16 or fp32; got values ", describe(values),
      ", scale_inv ", describe(scale_inv), ", dtype ", dtype);
  at::Tensor out = at::empty(values.sizes(), values.options().dtype(dtype));
  const int64_t rows_per_matrix = values.size(-2), cols = values.size(-1);
  const int64_t rows = values.numel() / std::max<int64_t>(cols, 1);
  const int64_t scale_rows = scale_inv.size(-2), scale_cols = scale_inv.size(-1);
  const auto* in = (const uint8_t*)values.data_ptr();
  const float* scales = scale_inv.data_ptr<float>();
  const int64_t element = dtype == at::kBFloat16 ? 2 : 4;
  char* dst = (char*)out.data_ptr();
  // Rows are independent; every thread takes a block of them (at least ~64K values each).
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t matrix = r / rows_per_matrix, row = r % rows_per_matrix;
      const float* row_scales = scales + (matrix * scale_rows + row / block_rows) * scale_cols;
      if (dtype == at::kBFloat16)
        dequantize_row<true>(in + r * cols, row_scales, cols, block_cols, dst + r * cols * element);
      else
        dequantize_row<false>(in + r * cols, row_scales, cols, block_cols, dst + r * cols * element);
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(kdsa, CPU, m) { m.impl("dequantize_fp8_tiles", TORCH_FN(dequantize_fp8_tiles)); }
"""
)


def kernel_available() -> bool:
    """The CPU supports the kernels and this one is built and loaded (`cpu_extension.load`)."""
    return cpu_supports_kernels() and load("dequantize_fp8_tiles", _SOURCE, "kdsa::dequantize_fp8_tiles", compiler())


def kernel_applies(values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> bool:
    """The kernel computes `dequantize_tiles(values, scale_inv, block, dtype)`: E4M3 values and fp32 scales on a CPU
    that supports it, a bf16 or fp32 result, no autograd through the scales, outside a compile or export (there
    inductor fuses the conversion into the product) — and it is built and loaded."""
    return (
        values.device.type == "cpu"
        and values.dtype == torch.float8_e4m3fn
        and scale_inv.dtype == torch.float32
        and dtype in (torch.bfloat16, torch.float32)
        and not (torch.is_grad_enabled() and scale_inv.requires_grad)
        and not torch.compiler.is_compiling()
        and kernel_available()
    )


def dequantize_fp8_tiles_cpu(values, scale_inv, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8_tiles(values.contiguous(), scale_inv.contiguous(), block[0], block[1], dtype)


_SCHEMA = (
    "dequantize_fp8_tiles(Tensor values, Tensor scale_inv, int block_rows, int block_cols, ScalarType dtype) -> Tensor"
)


def _fake_dequantize_fp8_tiles(values, scale_inv, block_rows, block_cols, dtype):
    return values.new_empty(values.shape, dtype=dtype)


# Registered as `cpu_indexer` registers its op: the schema and the fake here, the CPU kernel by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "dequantize_fp8_tiles"):
    _LIBRARY.define(_SCHEMA)
    torch.library.register_fake("kdsa::dequantize_fp8_tiles", _fake_dequantize_fp8_tiles, lib=_LIBRARY)
dequantize_fp8_tiles = torch.ops.kdsa.dequantize_fp8_tiles

__all__ = ["dequantize_fp8_tiles", "dequantize_fp8_tiles_cpu", "kernel_applies", "kernel_available"]
