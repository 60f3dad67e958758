"""Block-scaled E4M3 weights on x86 CPUs: two hand-written, vectorised kernels (docs/checkpoint-conversion.md §9).

`fp8_linear.dequantize_tiles` (`values.float() * scales`, then a cast) runs on every forward of a layer held in FP8
that the fused product below does not take. torch's float8 -> float conversion on CPU is element by element, ~3 ns
each: 3.3 ms for a 1024 x 1024 weight, ~140x the product of one row with the BF16 weight.

- `kdsa::dequantize_fp8_tiles` computes the same values with AVX512, 16 at a time (or AVX2, 8 at a time, on CPUs
  without AVX512-BF16: `cpu_extension.kernel_isa`), bit for bit (a NaN stays a NaN;
  its bits may differ from torch's, whose own NaN bits depend on whether its vectorised or scalar path ran).
  `dequantize_tiles` calls it outside a compile (inside one, inductor fuses the traced conversion into the product's
  loop) for a bf16 or fp32 result; rows are split over torch's intra-op threads, at any thread count (measured at 1
  and 2: `scripts/bench_cpu_kernels.py`).
- `kdsa::fp8_row_linear` is a held layer's forward of 1 to 16 bf16 rows (a decode step), eagerly and compiled: the row
  kernel's loop (`cpu_row_linear.GEMV_SOURCE`, or `GEMV_AVX2_SOURCE` in the AVX2 build) with each weight vector
  dequantized in registers, bit for bit the product with the dequantized weight, without writing that weight.

`cpu_extension` builds and loads the C++ source below for this CPU's instruction set, which implements the CPU kernels
of both `torch.library` ops (schemas and fake implementations registered here). Where they cannot run, the torch path
runs.
"""

import torch

from .cpu_row_linear import cpu_row_linear, few_bf16_rows, gemv_kernel_availability
from .linear_ops import dequantize_tiles_torch

# The AVX512-BF16 build's conversion, dequantization and fused-product reader (after PRELUDE and GEMV_SOURCE).
_AVX512_CONVERSION = r"""
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
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + c), float_to_bf16_x16(value));
      else
        _mm256_mask_storeu_epi16((uint16_t*)out + c, mask, float_to_bf16_x16(value));
    } else {
      if (whole)
        _mm512_storeu_ps((float*)out + c, value);
      else
        _mm512_mask_storeu_ps((float*)out + c, mask, value);
    }
  }
}

// 32 E4M3 values of a weight row times their tile's scale, rounded to bf16 as `dequantize_row` rounds them: the weight
// vector the row kernel (`cpu_row_linear`) would load from the dequantized copy. `mask` selects the columns that exist
// (a row's tail); the others are 0, as the row kernel's masked load gives them.
inline __m512bh dequantize_32(const uint8_t* values, float scale, __mmask32 mask) {
  const __m256i bytes = mask == (__mmask32)0xffffffff ? _mm256_loadu_si256((const __m256i*)values)
                                                      : _mm256_maskz_loadu_epi8(mask, values);
  const __m512 s = _mm512_set1_ps(scale);
  const __m256i low = float_to_bf16_x16(_mm512_mul_ps(e4m3_to_fp32(_mm256_castsi256_si128(bytes)), s));
  const __m256i high = float_to_bf16_x16(_mm512_mul_ps(e4m3_to_fp32(_mm256_extracti128_si256(bytes, 1)), s));
  return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// The rows of E4M3 values [N, K] with fp32 scales [ceil(N / block_rows), scale_cols] as `gemv_rows` reads a weight:
// row n's reader gives the 32 dequantized bf16 weights from column i (a tile's columns are a multiple of 32, so each
// vector has one scale).
struct Fp8Weights {
  const uint8_t* w;
  const float* scales;
  int64_t k, block_rows, block_cols, scale_cols;
  auto operator()(int64_t n) const {
    return [row = w + n * k, row_scales = scales + (n / block_rows) * scale_cols, block_cols = block_cols](
               int64_t i, __mmask32 mask) { return dequantize_32(row + i, row_scales[i / block_cols], mask); };
  }
};

}  // namespace
"""

# The AVX2 build's (CPUs without AVX512-BF16, `cpu_extension.kernel_isa`): the same values, 8 at a time (after PRELUDE
# and GEMV_AVX2_SOURCE).
_AVX2_CONVERSION = r"""
namespace {

// `e4m3_to_fp32` of the AVX512 build on 8 bytes, and on one.
inline __m256 e4m3_to_fp32_x8(const uint8_t* values) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)values));
  const __m256i magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256 normal =
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512.0f));
  const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude);
  __m256 value = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(is_subnormal));
  const __m256i is_nan = _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7f));
  value = _mm256_blendv_ps(value, _mm256_set1_ps(NAN), _mm256_castsi256_ps(is_nan));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign));
}

inline float e4m3_to_float(uint8_t byte) {
  const uint32_t magnitude = byte & 0x7f;
  uint32_t bits = (magnitude << 20) + (120u << 23);
  float value;
  memcpy(&value, &bits, 4);
  if (magnitude < 8) value = (float)magnitude * (1.0f / 512.0f);
  if (magnitude == 0x7f) value = NAN;
  return byte & 0x80 ? -value : value;
}

// 8 fp32 values rounded to bf16 as `float_to_bf16` rounds them (no NaN case: see `float_to_bf16_x16`), as the bits of
// fp32 values whose low 16 bits are 0.
inline __m256i round_to_bf16_x8(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_and_si256(rounded, _mm256_set1_epi32((int)0xffff0000u));
}

// One row of `cols` values: value x the scale of its column block, written as fp32 or bf16. Block by block, so that
// each vector of 8 has one scale; a block's last columns (fewer than 8) one by one.
template <bool Bf16>
void dequantize_row(const uint8_t* values, const float* scales, int64_t cols, int64_t block_cols, void* out) {
  for (int64_t start = 0; start < cols; start += block_cols) {
    const int64_t stop = std::min(start + block_cols, cols);
    const float scale = scales[start / block_cols];
    int64_t c = start;
    for (; c + 8 <= stop; c += 8) {
      const __m256 value = _mm256_mul_ps(e4m3_to_fp32_x8(values + c), _mm256_set1_ps(scale));
      if constexpr (Bf16) {  // the top halves packed to 8 uint16 (lane order restored by the permute)
        const __m256i halves = _mm256_srli_epi32(round_to_bf16_x8(value), 16);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
        _mm_storeu_si128((__m128i*)((uint16_t*)out + c), _mm256_castsi256_si128(packed));
      } else {
        _mm256_storeu_ps((float*)out + c, value);
      }
    }
    for (; c < stop; ++c) {
      const float value = e4m3_to_float(values[c]) * scale;
      if constexpr (Bf16)
        ((uint16_t*)out)[c] = float_to_bf16(value);
      else
        ((float*)out)[c] = value;
    }
  }
}

// A row of E4M3 values for `gemv_avx2_of`: each weight times its tile's scale, rounded to bf16 (the value the
// dequantized copy holds), as fp32. `tile_of[g]`: the column tile of columns 8g .. 8g + 7 (a tile's columns are a
// multiple of 32), looked up rather than divided for every vector.
struct Fp8Row {
  const uint8_t* values;
  const float* scales;
  const int32_t* tile_of;
  int64_t block_cols;
  __m256 vec(int64_t i) const {
    if ((i & 63) == 0) _mm_prefetch((const char*)(values + i) + kPrefetchBytes, _MM_HINT_T0);  // as `Bf16Row`
    const __m256 value = _mm256_mul_ps(e4m3_to_fp32_x8(values + i), _mm256_set1_ps(scales[tile_of[i / 8]]));
    return _mm256_castsi256_ps(round_to_bf16_x8(value));
  }
  float at(int64_t t) const { return bf16_to_float(float_to_bf16(e4m3_to_float(values[t]) * scales[t / block_cols])); }
};

// The rows of E4M3 values [N, K] with fp32 scales [ceil(N / block_rows), scale_cols] as `gemv_rows` reads a weight.
struct Fp8Weights {
  const uint8_t* w;
  const float* scales;
  int64_t k, block_rows, block_cols, scale_cols;
  std::vector<int32_t> tile_of;
  Fp8Weights(const uint8_t* w, const float* scales, int64_t k, int64_t block_rows, int64_t block_cols,
             int64_t scale_cols)
      : w(w), scales(scales), k(k), block_rows(block_rows), block_cols(block_cols), scale_cols(scale_cols),
        tile_of(k / 8) {
    for (int64_t g = 0; g < k / 8; ++g) tile_of[g] = (int32_t)(8 * g / block_cols);
  }
  Fp8Row operator()(int64_t n) const {
    return Fp8Row{w + n * k, scales + (n / block_rows) * scale_cols, tile_of.data(), block_cols};
  }
};

}  // namespace
"""

# The ops over either build's `dequantize_row` and `Fp8Weights`.
_OP_SOURCE = r"""
#include <ATen/Parallel.h>

namespace {

// kdsa::fp8_row_linear (schema in Python): x [..., K] contiguous bf16 holding 1 to 16 rows, values [N, K]
// float8_e4m3fn and scale_inv [ceil(N / br), ceil(K / bc)] fp32, both contiguous, bc a multiple of 32, bias [N] bf16
// or none; returns `x @ dequantize(values)ᵀ + bias` [..., N] in bf16, bit for bit the dequantized layer's row product.
// Bad input is a ValueError.
at::Tensor fp8_row_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scale_inv,
                          int64_t block_rows, int64_t block_cols, const std::optional<at::Tensor>& bias) {
  constexpr int64_t kMaxRows = 16;  // `cpu_row_linear.MAX_ROWS`
  bool ok = x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1 &&
            values.scalar_type() == at::kFloat8_e4m3fn && values.is_contiguous() && values.dim() == 2 &&
            scale_inv.scalar_type() == at::kFloat && scale_inv.is_contiguous() && scale_inv.dim() == 2 &&
            block_rows > 0 && block_cols > 0 && block_cols % 32 == 0 && x.size(-1) == values.size(1) &&
            x.size(-1) > 0 && 1 <= x.numel() / x.size(-1) && x.numel() / x.size(-1) <= kMaxRows &&
            scale_inv.size(0) == (values.size(0) + block_rows - 1) / block_rows &&
            scale_inv.size(1) == (values.size(1) + block_cols - 1) / block_cols &&
            (!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->dim() == 1 &&
                       bias->size(0) == values.size(0)));
  TORCH_CHECK_VALUE(ok,
      "fp8_row_linear takes contiguous bf16 x [..., K] holding 1 to ", kMaxRows, " rows, float8_e4m3fn values [N, K], "
      "fp32 scale_inv [ceil(N / ", block_rows, "), ceil(K / ", block_cols, ")] with tiles of a multiple of 32 "
      "columns, and bias [N] bf16 or None; got x ", describe(x), ", values ", describe(values), ", scale_inv ",
      describe(scale_inv), ", bias ", bias ? describe(*bias) : std::string("None"));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = values.size(0);
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = values.size(0), k = values.size(1), x_rows = x.numel() / k;
  // The row kernel's loop (`gemv_rows`: the same steps, accumulators and order of additions) with each weight vector
  // dequantized in registers instead of loaded from a bf16 copy: bit for bit `row_linear(x, dequantize_fp8_tiles(
  // values, ...), bias)`, and no copy is written.
  const Fp8Weights weights{(const uint8_t*)values.data_ptr(), scale_inv.data_ptr<float>(), k, block_rows, block_cols,
                           scale_inv.size(1)};
  const auto* xp = (const uint16_t*)x.data_ptr();
  const auto* bp = bias ? (const uint16_t*)bias->data_ptr() : nullptr;
  auto* op = (uint16_t*)out.data_ptr();
  // With 2 threads each takes a block of weight rows, as the row kernel does (at least ~512 KiB of values each).
  const int64_t grain = std::max<int64_t>(1, (512 << 10) / k);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    gemv_rows(x_rows, xp, k, weights, k, bp, op, rows, begin, end);
  });
  return out;
}

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

}  // namespace

"""
kernel_available = gemv_kernel_availability(
    "dequantize_fp8_tiles", ("dequantize_fp8_tiles", "fp8_row_linear"), _OP_SOURCE, _AVX512_CONVERSION, _AVX2_CONVERSION
)


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


def fp8_row_linear_applies(
    hidden_states: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block, bias
) -> bool:
    """The fused kernel computes a held layer's forward (`linear(x, dequantize_tiles(...), bias)`, which the row kernel
    runs for these rows): the row kernels' `few_bf16_rows`, contiguous E4M3 values and fp32 scales, tiles of a
    multiple of 32 columns, a bf16 bias or none, on a CPU that supports it — and it is built and loaded. Also inside a
    compile, as one opaque op: inductor's own fusion of the traced conversion into the product took 9x longer
    (docs/checkpoint-conversion.md §9)."""
    return (
        few_bf16_rows(hidden_states, hidden_states.shape[-1])
        and values.dtype == torch.float8_e4m3fn
        and values.is_contiguous()
        and scale_inv.dtype == torch.float32
        and scale_inv.is_contiguous()
        and block[1] % 32 == 0
        and (bias is None or bias.dtype == torch.bfloat16)
        and kernel_available()
    )


def dequantize_fp8_tiles_cpu(values, scale_inv, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8_tiles(values.contiguous(), scale_inv.contiguous(), block[0], block[1], dtype)


_SCHEMA = (
    "dequantize_fp8_tiles(Tensor values, Tensor scale_inv, int block_rows, int block_cols, ScalarType dtype) -> Tensor"
)
_ROW_SCHEMA = (
    "fp8_row_linear(Tensor x, Tensor values, Tensor scale_inv, int block_rows, int block_cols, Tensor? bias) -> Tensor"
)


def _fake_dequantize_fp8_tiles(values, scale_inv, block_rows, block_cols, dtype):
    return values.new_empty(values.shape, dtype=dtype)


def _fake_fp8_row_linear(x, values, scale_inv, block_rows, block_cols, bias):
    return x.new_empty(*x.shape[:-1], values.shape[0])


# Registered as `cpu_indexer` registers its op: the schema and the fake here, the CPU kernel by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "dequantize_fp8_tiles"):
    _LIBRARY.define(_SCHEMA)
    _LIBRARY.define(_ROW_SCHEMA)
    torch.library.register_fake("kdsa::dequantize_fp8_tiles", _fake_dequantize_fp8_tiles, lib=_LIBRARY)
    torch.library.register_fake("kdsa::fp8_row_linear", _fake_fp8_row_linear, lib=_LIBRARY)
dequantize_fp8_tiles = torch.ops.kdsa.dequantize_fp8_tiles
fp8_row_linear = torch.ops.kdsa.fp8_row_linear


def cpu_fp8_dequantize(values, scale_inv, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The `cpu` backend's `fp8_dequantize` (kernels.py): `kdsa::dequantize_fp8_tiles` where `kernel_applies`, else
    the torch reference `linear_ops.dequantize_tiles_torch` (same arguments, bit-identical result)."""
    if kernel_applies(values, scale_inv, dtype):
        return dequantize_fp8_tiles_cpu(values, scale_inv, block, dtype)
    return dequantize_tiles_torch(values, scale_inv, block, dtype)


def cpu_fp8_row_linear(hidden_states, values, scale_inv, block: tuple[int, int], bias=None) -> torch.Tensor:
    """The `cpu` backend's `fp8_row_linear` (kernels.py; reference `linear_ops.fp8_linear`): the fused
    `kdsa::fp8_row_linear` where `fp8_row_linear_applies` (no bf16 copy of the weight written), else the weight
    dequantized (`cpu_fp8_dequantize`) and multiplied by the backend's row product (`cpu_row_linear`)."""
    if fp8_row_linear_applies(hidden_states, values, scale_inv, block, bias):
        return fp8_row_linear(hidden_states.contiguous(), values, scale_inv, *block, bias)
    return cpu_row_linear(hidden_states, cpu_fp8_dequantize(values, scale_inv, block, hidden_states.dtype), bias)


__all__ = [
    "cpu_fp8_dequantize",
    "cpu_fp8_row_linear",
    "dequantize_fp8_tiles",
    "dequantize_fp8_tiles_cpu",
    "fp8_row_linear",
    "fp8_row_linear_applies",
    "kernel_applies",
    "kernel_available",
]
