"""Sparse absorbed MLA of a decode step on x86 CPUs as one hand-written kernel (docs/dsa.md §12).

One query per sequence attends to the K rows `[c | k_pe]` its indexer selected. Written with torch ops (`_attend` in
dsa_paged_fused.py) that is a gather of the K rows from the pages, two small bf16 GEMMs (`rows @ queryᵀ` with only H
columns, then `probs @ rows`) and a softmax in between: in a compiled 64k decode step of one DSA layer ~0.25 ms cold,
mostly the gather's scattered reads and the GEMMs' fixed costs. This kernel reads each selected row in place
through the block table with software prefetch, scores it against the heads with AVX512-BF16 dot products
(`vdpbf16ps`, 8 rows x 8 heads at a time, as `cpu_indexer`), takes the softmax in fp32 (ATen's vectorised `exp`), and
sums the rows weighted by the probabilities as bf16 pairs of rows (`vdpbf16ps` again, 8 heads x 32 columns at a
time): ~0.07 ms warm, 0.12 ms cold for the benchmark shape (H = 16, C + R = 256 + 32, K = 512).

Numerics follow the torch path (fp32 sums of exact bf16 products, the probabilities rounded to bf16 before the
weighted sum, fp32 softmax statistics), except that the scores and the weighted sum are not rounded to bf16 before
the softmax and the division: the output is as close or closer to the fp32 reference.

`cpu_extension` builds and loads the C++ source below, which implements the CPU kernel of the `torch.library` op
`kdsa::sparse_mla_decode` (schema and fake implementation registered here); on a CPU without AVX512-BF16 the same source
is built for AVX2 (docs/graph-mode.md §13: the scores' `vdpbf16ps` as two FMAs, the weighted sum as FMAs of widened rows
with the probabilities kept in fp32). Where it cannot run — no AVX2, no compiler, another dtype, geometry or page
format — the callers keep the torch path. Several queries per sequence (a verification) are rows of their own, each with
its sequence's block table (`dsa_paged_cpu.paged_sparse_mla_cpu`).
"""

import torch

from .cpu_extension import PRELUDE, few_threads, kernel_availability

_SOURCE = (
    PRELUDE
    + r"""
namespace {

using Vec = at::vec::Vectorized<float>;


// One sequence: rows[j] for j < n are the selected rows (n padded up to a multiple of 8 with `zero_row`).
void attend(const uint16_t* const* rows, int64_t n, int64_t padded, int64_t width, int64_t latent,
            const uint16_t* packed_q, int64_t heads, float scale, float* scores, int32_t* prob_pairs,
            uint16_t* out) {
  const int64_t pairs = width / 2, groups = heads / 8;
  // Scores: 8 rows at a time against 8 heads at a time; row pairs broadcast, the heads' query pairs in one vector.
  for (int64_t j = 0; j < padded; j += 8) {
    for (int r = 0; r < 8 && j + 8 + r < padded; ++r)  // the next group's rows
      for (int64_t byte = 0; byte < 2 * width; byte += 64)
        _mm_prefetch((const char*)rows[j + 8 + r] + byte, _MM_HINT_T0);
    for (int64_t g = 0; g < groups; ++g) {
      __m256 dot[8];
      for (int r = 0; r < 8; ++r) dot[r] = _mm256_setzero_ps();
      const uint16_t* q = packed_q + g * pairs * 16;
      for (int64_t p = 0; p < pairs; ++p) {
        const __m256i q_pairs = _mm256_loadu_si256((const __m256i*)(q + p * 16));
        for (int r = 0; r < 8; ++r) {
          int32_t k_pair;
          memcpy(&k_pair, rows[j + r] + 2 * p, 4);
          dot[r] = dot_bf16_pairs(dot[r], _mm256_set1_epi32(k_pair), q_pairs);
        }
      }
      for (int r = 0; r < 8; ++r) _mm256_storeu_ps(scores + (j + r) * heads + g * 8, dot[r]);
    }
  }
  // Softmax over the n real rows per head, in fp32.
  std::vector<float> row_max(heads, -INFINITY), total(heads, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < heads; ++h) {
      float s = scores[j * heads + h] * scale;
      scores[j * heads + h] = s;
      row_max[h] = s > row_max[h] ? s : row_max[h];
    }
  for (int64_t j = 0; j < n; ++j) {
    int64_t h = 0;
    for (; h + Vec::size() <= heads; h += Vec::size()) {
      Vec e = (Vec::loadu(scores + j * heads + h) - Vec::loadu(row_max.data() + h)).exp();
      e.store(scores + j * heads + h);
    }
    for (; h < heads; ++h) scores[j * heads + h] = expf(scores[j * heads + h] - row_max[h]);
    for (h = 0; h < heads; ++h) total[h] += scores[j * heads + h];
  }
#ifdef __AVX512BF16__
  // Probabilities of row pairs (j, j+1) per head as bf16 pairs, 0 past the real rows.
  for (int64_t j = 0; j < padded; j += 2)
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t a = j < n ? float_to_bf16(scores[j * heads + h]) : 0;
      uint16_t b = j + 1 < n ? float_to_bf16(scores[(j + 1) * heads + h]) : 0;
      prob_pairs[(j / 2) * heads + h] = (int32_t)((uint32_t)a | ((uint32_t)b << 16));
    }
  // Output: out[h, c] = sum_j p[h, j] row_j[c] over the latent columns, 8 heads x 32 columns per pass.
  // Columns of two rows interleaved per 128-bit lane; the accumulators' lanes follow that order and are put back at
  // the end with one permutation.
  const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < latent; c += 32) {
      __m512 acc[8][2];
      for (int h = 0; h < 8; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
      for (int64_t j = 0; j < padded; j += 2) {
        __m512i pair[2];
        for (int half = 0; half < 2; ++half) {
          __m256i a = _mm256_loadu_si256((const __m256i*)(rows[j] + c + 16 * half));
          __m256i b = _mm256_loadu_si256((const __m256i*)(rows[j + 1] + c + 16 * half));
          pair[half] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(a, b)),
                                          _mm256_unpackhi_epi16(a, b), 1);
        }
        const int32_t* pp = prob_pairs + (j / 2) * heads + g * 8;
        for (int h = 0; h < 8; ++h) {
          __m512bh p = (__m512bh)_mm512_set1_epi32(pp[h]);
          acc[h][0] = _mm512_dpbf16_ps(acc[h][0], (__m512bh)pair[0], p);
          acc[h][1] = _mm512_dpbf16_ps(acc[h][1], (__m512bh)pair[1], p);
        }
      }
      for (int h = 0; h < 8; ++h) {
        const float inv = 1.f / total[g * 8 + h];
        for (int half = 0; half < 2; ++half) {
          alignas(64) float values[16];
          _mm512_store_ps(values, _mm512_mul_ps(_mm512_permutexvar_ps(order, acc[h][half]), _mm512_set1_ps(inv)));
          uint16_t* o = out + (g * 8 + h) * latent + c + 16 * half;
          for (int i = 0; i < 16; ++i) o[i] = float_to_bf16(values[i]);
        }
      }
    }
#else
  // The AVX2 build: each real row widened 8 latent columns at a time and added with its 8 heads' probabilities, kept in
  // fp32 (FMAs, rows in order; no bf16 rounding of the probabilities: closer still to the fp32 reference).
  (void)prob_pairs;  // empty in this build
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < latent; c += 8) {
      __m256 acc[8];
      for (int h = 0; h < 8; ++h) acc[h] = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m256 row = widen_bf16x8(rows[j] + c);
        const float* p = scores + j * heads + g * 8;
#pragma GCC unroll 8
        for (int h = 0; h < 8; ++h) acc[h] = _mm256_fmadd_ps(row, _mm256_set1_ps(p[h]), acc[h]);
      }
      for (int h = 0; h < 8; ++h) {
        alignas(32) float values[8];
        _mm256_store_ps(values, _mm256_mul_ps(acc[h], _mm256_set1_ps(1.f / total[g * 8 + h])));
        uint16_t* o = out + (g * 8 + h) * latent + c;
        for (int i = 0; i < 8; ++i) o[i] = float_to_bf16(values[i]);
      }
    }
#endif
}


// kdsa::sparse_mla_decode (schema in Python). Checks every dtype, layout and shape the pointer arithmetic relies on
// and every page it reads, so that bad input is a ValueError, not a read out of bounds.
at::Tensor sparse_mla_decode(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& kv_pages,
                             const at::Tensor& block_table, const at::Tensor& indices, double softmax_scale) {
  auto fits = [](const at::Tensor& t, at::ScalarType dtype, int64_t dims) {
    return t.scalar_type() == dtype && t.dim() == dims && t.is_contiguous();
  };
  bool ok = fits(q_latent, at::kBFloat16, 3) && fits(q_pe, at::kBFloat16, 3) && fits(kv_pages, at::kBFloat16, 3) &&
            fits(block_table, at::kLong, 2) && fits(indices, at::kLong, 2);
  ok = ok && q_pe.size(0) == q_latent.size(0) && q_pe.size(1) == q_latent.size(1) && q_latent.size(1) % 8 == 0 &&
       q_latent.size(2) % 32 == 0 && q_pe.size(2) % 2 == 0 && kv_pages.size(2) == q_latent.size(2) + q_pe.size(2) &&
       block_table.size(0) == q_latent.size(0) && indices.size(0) == q_latent.size(0);
  TORCH_CHECK_VALUE(ok,
      "sparse_mla_decode takes contiguous bf16 q_latent [B, H % 8 == 0, C % 32 == 0], q_pe [B, H, R even] and "
      "kv_pages [N, P, C + R], an int64 block_table [B, n] and int64 indices [B, K]; got q_latent ",
      describe(q_latent), ", q_pe ", describe(q_pe), ", kv_pages ", describe(kv_pages), ", block_table ",
      describe(block_table), ", indices ", describe(indices));
  const int64_t batch = q_latent.size(0), heads = q_latent.size(1), latent = q_latent.size(2);
  const int64_t rope = q_pe.size(2), width = latent + rope, page_size = kv_pages.size(1);
  const int64_t selected = indices.size(1), table_width = block_table.size(1), num_pages = kv_pages.size(0);
  const uint16_t* pages = (const uint16_t*)kv_pages.data_ptr();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* idx = indices.data_ptr<int64_t>();
  at::Tensor out = at::empty({batch, heads, latent}, q_latent.options());
  const int64_t padded_max = (selected + 7) / 8 * 8;
  std::vector<const uint16_t*> rows(std::max<int64_t>(padded_max, 8));
  std::vector<uint16_t> zero_row(width, 0), packed((heads / 8) * (width / 2) * 16);
  std::vector<float> scores(rows.size() * heads);
#ifdef __AVX512BF16__
  std::vector<int32_t> prob_pairs(rows.size() / 2 * heads);
#else
  std::vector<int32_t> prob_pairs;  // the AVX2 weighted sum keeps its probabilities in fp32
#endif
  for (int64_t b = 0; b < batch; ++b) {
    int64_t n = 0;
    for (int64_t j = 0; j < selected; ++j) {
      const int64_t position = idx[b * selected + j];
      if (position < 0) continue;  // -1: no key
      TORCH_CHECK_VALUE(position < table_width * page_size, "sparse_mla_decode: index ", position,
                        " is past the block table's ", table_width * page_size, " slots");
      const int64_t page = table[b * table_width + position / page_size];
      TORCH_CHECK_VALUE(0 <= page && page < num_pages, "sparse_mla_decode: index ", position, " maps to page ", page,
                        " of ", num_pages);
      rows[n++] = pages + (page * page_size + position % page_size) * width;
    }
    uint16_t* o = (uint16_t*)out.data_ptr() + b * heads * latent;
    if (n == 0) {  // no key: the output is 0, as the torch path gives
      memset(o, 0, heads * latent * sizeof(uint16_t));
      continue;
    }
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t j = n; j < padded; ++j) rows[j] = zero_row.data();
    const uint16_t* ql = (const uint16_t*)q_latent.data_ptr() + b * heads * latent;
    const uint16_t* qp = (const uint16_t*)q_pe.data_ptr() + b * heads * rope;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < width; ++d)
        packed[((h / 8) * (width / 2) + d / 2) * 16 + (h % 8) * 2 + d % 2] =
            d < latent ? ql[h * latent + d] : qp[h * rope + d - latent];
    attend(rows.data(), n, padded, width, latent, packed.data(), heads, (float)softmax_scale, scores.data(),
           prob_pairs.data(), o);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdsa, CPU, m) { m.impl("sparse_mla_decode", TORCH_FN(sparse_mla_decode)); }
"""
)


# One source for both builds: the scores' `dot_bf16_pairs` (cpu_extension.PRELUDE) and the weighted sum differ.
kernel_available = kernel_availability("sparse_mla_decode", "kdsa::sparse_mla_decode", _SOURCE, _SOURCE)


def decode_kernel_applies(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_pages) -> bool:
    """The kernel handles this sparse attention: one query per sequence, bf16 queries and plain bf16 pages on a CPU
    that supports it, a head count that is a multiple of 8, a latent width that is a multiple of 32, an even rope
    width, at most `cpu_extension.MAX_THREADS` threads — and it is built and loaded."""
    return (
        q_latent.device.type == "cpu"
        and q_latent.dtype == torch.bfloat16
        and q_pe.dtype == torch.bfloat16
        and q_latent.shape[1] == 1
        and q_latent.shape[2] % 8 == 0
        and q_latent.shape[3] % 32 == 0
        and q_pe.shape[3] % 2 == 0
        and isinstance(kv_pages, torch.Tensor)
        and kv_pages.dtype == torch.bfloat16
        and kv_pages.is_contiguous()
        and few_threads()
        and kernel_available()
    )


def sparse_mla_decode_cpu(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale: float) -> torch.Tensor:
    """`kdsa::sparse_mla_decode` with the shapes of `dsa_paged_cpu.paged_sparse_mla_cpu` (q_latent `[B, 1, H, C]`,
    q_pe `[B, 1, H, R]`, indices `[B, 1, K]`, -1 = none): `[B, 1, H, C]` in bf16."""
    out = sparse_mla_decode(
        q_latent[:, 0].contiguous(), q_pe[:, 0].contiguous(), kv_pages, block_table.long().contiguous(),
        indices[:, 0].long().contiguous(), softmax_scale,
    )  # fmt: skip
    return out.unsqueeze(1)


_SCHEMA = (
    "sparse_mla_decode(Tensor q_latent, Tensor q_pe, Tensor kv_pages, Tensor block_table, Tensor indices, "
    "float softmax_scale) -> Tensor"
)


def _fake_sparse_mla_decode(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale):
    return q_latent.new_empty(q_latent.shape)


# Registered as `cpu_indexer` registers its op: the schema and the fake here, the CPU kernel by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "sparse_mla_decode"):
    _LIBRARY.define(_SCHEMA)
    torch.library.register_fake("kdsa::sparse_mla_decode", _fake_sparse_mla_decode, lib=_LIBRARY)
sparse_mla_decode = torch.ops.kdsa.sparse_mla_decode

__all__ = ["decode_kernel_applies", "kernel_available", "sparse_mla_decode", "sparse_mla_decode_cpu"]
