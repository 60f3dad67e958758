"""The Lightning Indexer's decode step on x86 CPUs as one hand-written kernel (docs/dsa.md §11).

One query per sequence (a decode step) scores every visible cached key and keeps the top k. Written with torch ops
this is a bf16 GEMM `keys @ qᵀ` with only `HI` columns (8 at the benchmark shape), then passes for ReLU, the head
weights, the mask, a packed sort key and `topk`. On one core the GEMM is compute-bound (`HI · DI` multiply-adds per
key: 4 per byte read at HI = 8) and oneDNN does not overlap it with the memory reads, so a 64k-key step spent ~0.75 ms
on it against ~0.29 ms for plain reading the keys. This kernel streams the keys once: AVX512-BF16 dot products
(`vdpbf16ps`) of 8 keys at a time against 8 heads at a time, software prefetch a few KiB ahead, ReLU, the head
weights and the sum in registers, and a candidate buffer for the top k, so no score is written to memory.

The C++ source below implements the CPU kernel of the `torch.library` op `kdsa::indexer_topk_decode` (schema and fake
implementation registered here); `cpu_extension` builds and loads it on first use, so the dispatcher calls it without
Python and a compiled step holds it as one opaque op; on a CPU without AVX512-BF16 the same source is built for AVX2,
`vdpbf16ps` replaced by two FMAs (`cpu_extension.kernel_isa`, docs/graph-mode.md §13). Where it cannot run — no AVX2, no
compiler, another dtype or geometry — the callers keep the torch path; a failed build warns once.

Result: the reference's selection (`dsa_ops.select_topk`: score descending, ties to the earlier key) over scores
computed in fp32 from the bf16 inputs (the torch bf16 path rounds each head's product to bf16 first)."""

import torch

from .cpu_extension import PRELUDE, few_threads, kernel_availability

_SOURCE = (
    PRELUDE
    + r"""
namespace {

struct Candidate {
  float score;
  int64_t position;
};

// The reference's order: higher score first, then the earlier key.
inline bool better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.position < b.position);
}

// Candidates for the best k: every key scoring above `threshold` is kept until the buffer holds 2k, then the buffer
// is cut to its best k and `threshold` becomes the worst of those. Positions arrive in increasing order, so a key
// scoring exactly `threshold` loses its tie to every key kept with that score.
struct TopK {
  std::vector<Candidate> buffer;
  size_t k;
  float threshold = -INFINITY;
  explicit TopK(size_t k) : k(k) { buffer.reserve(2 * k); }
  inline void offer(float score, int64_t position) {
    if (!(score > threshold)) return;
    buffer.push_back({score, position});
    if (buffer.size() == 2 * k) {
      std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), better);
      buffer.resize(k);
      threshold = buffer[k - 1].score;
    }
  }
};

// Sums of each of 8 vectors' 8 lanes, as one vector.
inline __m256 lane_sums(const __m256* v) {
  __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}


struct Sequence {
  const uint16_t* pages;      // the pool, [num_pages, page_size, dim]
  const int64_t* table;       // this sequence's pages, in order
  int64_t page_size, dim, heads;
  const uint16_t* packed_q;   // [heads / 8][dim / 2][8][2]: 8 heads' pairs of query elements per 256-bit row
  const float* weights;       // [heads]
  const uint8_t* padding;     // [keys]: 1 = a real key; or null
  const float* query;         // [heads][dim] fp32, for the tail
};

// A key position walked forward through the block table without a division per step.
struct Cursor {
  const Sequence& s;
  int64_t page, offset;
  Cursor(const Sequence& s, int64_t key) : s(s), page(key / s.page_size), offset(key % s.page_size) {}
  inline const uint16_t* row() const { return s.pages + (s.table[page] * s.page_size + offset) * s.dim; }
  inline void advance(int64_t keys) {  // keys <= page_size
    offset += keys;
    if (offset >= s.page_size) offset -= s.page_size, ++page;
  }
};

// Scores the 8 keys at `keys` (positions key .. key + 7, one page) against one row's query into `best`.
inline void score_eight(const Sequence& s, const uint16_t* keys, int64_t key, TopK& best) {
  const int64_t groups = s.heads / 8, pairs = s.dim / 2;
  const __m256 zero = _mm256_setzero_ps();
  alignas(32) float scores[8];
  __m256 total[8];
  for (int r = 0; r < 8; ++r) total[r] = zero;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dot[8];
    for (int r = 0; r < 8; ++r) dot[r] = zero;
    const uint16_t* q = s.packed_q + g * pairs * 16;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m256i q_pairs = _mm256_loadu_si256((const __m256i*)(q + p * 16));
      for (int r = 0; r < 8; ++r) {
        int32_t k_pair;
        memcpy(&k_pair, keys + r * s.dim + 2 * p, 4);
        dot[r] = dot_bf16_pairs(dot[r], _mm256_set1_epi32(k_pair), q_pairs);
      }
    }
    __m256 w = _mm256_loadu_ps(s.weights + g * 8);
    for (int r = 0; r < 8; ++r) total[r] = _mm256_fmadd_ps(_mm256_max_ps(dot[r], zero), w, total[r]);
  }
  __m256 group_scores = lane_sums(total);
  // One comparison finds the keys above the threshold (usually none); only those are offered.
  int above = _mm256_movemask_ps(_mm256_cmp_ps(group_scores, _mm256_set1_ps(best.threshold), _CMP_GT_OQ));
  if (above == 0) return;
  _mm256_store_ps(scores, group_scores);
  for (; above != 0; above &= above - 1) {
    const int r = __builtin_ctz(above);
    if (!s.padding || s.padding[key + r]) best.offer(scores[r], key + r);
  }
}

// Scores keys [0, end) for `count` rows that read the same pages (one sequence's queries of a verification, or one
// decode query) into their `best`: each block of 8 keys is prefetched and read once and scored for every row while it
// is in L1.
void score_rows(const Sequence* rows, TopK* best, int64_t count, int64_t end) {
  const Sequence& s = rows[0];
  const int64_t ahead = std::min(s.page_size, std::max<int64_t>(8, (8192 / (2 * s.dim)) / 8 * 8));  // ~8 KiB
  int64_t key = 0;
  Cursor at(s, 0), next(s, ahead);
  for (; key + 8 <= end; key += 8, at.advance(8), next.advance(8)) {
    if (key + ahead + 8 <= end) {
      const char* bytes = (const char*)next.row();
      for (int64_t byte = 0; byte < 16 * s.dim; byte += 64) _mm_prefetch(bytes + byte, _MM_HINT_T0);
    }
    const uint16_t* keys = at.row();  // 8 keys in one page (page_size is a multiple of 8)
    for (int64_t i = 0; i < count; ++i) score_eight(rows[i], keys, key, best[i]);
  }
  for (; key < end; ++key, at.advance(1)) {  // the last < 8 keys
    const uint16_t* k = at.row();
    for (int64_t i = 0; i < count; ++i) {
      const Sequence& row = rows[i];
      if (row.padding && !row.padding[key]) continue;
      float score = 0.f;
      for (int64_t h = 0; h < row.heads; ++h) {
        float dot = 0.f;
        for (int64_t d = 0; d < row.dim; ++d) dot += bf16_to_float(k[d]) * row.query[h * row.dim + d];
        score += row.weights[h] * (dot > 0.f ? dot : 0.f);
      }
      best[i].offer(score, key);
    }
  }
}

// For each of `batch` rows: the `top_k` best of its first `num_keys` keys under
// score = sum_h weights[h] * relu(q[h] . key), best first, into out [batch, width] (-1 past the last found).
// Consecutive rows with the same block table (the queries of one sequence, `dsa_paged_cpu._queries_topk_cpu`) are
// scored in one pass over the keys.
void topk_decode(
    const uint16_t* pages, int64_t page_size, int64_t dim, const int64_t* table, int64_t table_stride,
    const uint16_t* q, const float* weights, int64_t heads, int64_t num_keys, const uint8_t* padding,
    int64_t padding_stride, int64_t batch, int64_t top_k, int64_t width, int64_t* out) {
  const int64_t pairs = dim / 2;
  std::vector<uint16_t> packed(batch * heads * dim);
  std::vector<float> query(batch * heads * dim);
  std::vector<Sequence> rows;
  rows.reserve(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const uint16_t* qb = q + b * heads * dim;
    uint16_t* pb = packed.data() + b * heads * dim;
    float* fb = query.data() + b * heads * dim;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t p = 0; p < pairs; ++p)
        for (int i = 0; i < 2; ++i) {
          pb[((h / 8) * pairs + p) * 16 + (h % 8) * 2 + i] = qb[h * dim + 2 * p + i];
          fb[h * dim + 2 * p + i] = bf16_to_float(qb[h * dim + 2 * p + i]);
        }
    rows.push_back(Sequence{pages, table + b * table_stride, page_size, dim, heads, pb, weights + b * heads,
                            padding ? padding + b * padding_stride : nullptr, fb});
  }
  const int64_t table_pages = (num_keys + page_size - 1) / page_size;  // the entries the keys read
  for (int64_t first = 0; first < batch;) {
    int64_t last = first + 1;
    while (last < batch && std::equal(rows[first].table, rows[first].table + table_pages, rows[last].table)) ++last;
    std::vector<TopK> best(last - first, TopK(top_k));
    score_rows(rows.data() + first, best.data(), last - first, num_keys);
    for (int64_t b = first; b < last; ++b) {
      std::vector<Candidate>& found = best[b - first].buffer;
      int64_t kept = std::min<int64_t>(top_k, (int64_t)found.size());
      if (kept < (int64_t)found.size())
        std::nth_element(found.begin(), found.begin() + (kept - 1), found.end(), better);
      std::sort(found.begin(), found.begin() + kept, better);
      for (int64_t i = 0; i < width; ++i) out[b * width + i] = i < kept ? found[i].position : -1;
    }
    first = last;
  }
}


// kdsa::indexer_topk_decode (schema in Python). Checks every dtype, layout and shape the pointer arithmetic above
// relies on, so that bad input is a ValueError, not a read out of bounds; the block table's entries are trusted.
at::Tensor indexer_topk_decode(const at::Tensor& q_index, const at::Tensor& scaled_weights,
                               const at::Tensor& index_pages, const at::Tensor& block_table,
                               const at::Tensor& num_keys, const std::optional<at::Tensor>& key_padding,
                               int64_t top_k, int64_t width) {
  auto fits = [](const at::Tensor& t, at::ScalarType dtype, int64_t dims) {
    return t.scalar_type() == dtype && t.dim() == dims && t.is_contiguous();
  };
  bool ok = fits(q_index, at::kBFloat16, 3) && fits(scaled_weights, at::kFloat, 2) &&
            fits(index_pages, at::kBFloat16, 3) && fits(block_table, at::kLong, 2) &&
            num_keys.scalar_type() == at::kLong && num_keys.numel() == 1 &&
            (!key_padding || fits(*key_padding, at::kBool, 2)) && top_k >= 1 && width >= 0;
  const int64_t keys = ok ? num_keys.item<int64_t>() : 0;
  if (ok) {
    const int64_t batch = q_index.size(0), heads = q_index.size(1), dim = q_index.size(2);
    const int64_t page_size = index_pages.size(1);
    ok = heads % 8 == 0 && dim % 2 == 0 && page_size % 8 == 0 && index_pages.size(2) == dim &&
         scaled_weights.size(0) == batch && scaled_weights.size(1) == heads && block_table.size(0) == batch &&
         0 <= keys && keys <= block_table.size(1) * page_size &&
         (!key_padding || (key_padding->size(0) == batch && key_padding->size(1) >= keys));
  }
  TORCH_CHECK_VALUE(ok,
      "indexer_topk_decode takes contiguous bf16 q_index [B, HI % 8 == 0, DI even] and index_pages [N, P % 8 == 0, "
      "DI], fp32 scaled_weights [B, HI], an int64 block_table [B, n] covering num_keys, a bool key_padding "
      "[B, >= num_keys] and top_k >= 1; got q_index ", describe(q_index), ", scaled_weights ",
      describe(scaled_weights), ", index_pages ", describe(index_pages), ", block_table ", describe(block_table),
      ", key_padding ", key_padding ? describe(*key_padding) : std::string("None"), ", num_keys ",
      describe(num_keys), ", top_k=", top_k);
  const int64_t batch = q_index.size(0);
  at::Tensor out = at::empty({batch, width}, q_index.options().dtype(at::kLong));
  const uint8_t* padding = key_padding ? (const uint8_t*)key_padding->data_ptr() : nullptr;
  topk_decode((const uint16_t*)index_pages.data_ptr(), index_pages.size(1), q_index.size(2),
              block_table.data_ptr<int64_t>(), block_table.size(1), (const uint16_t*)q_index.data_ptr(),
              scaled_weights.data_ptr<float>(), q_index.size(1), keys, padding,
              key_padding ? key_padding->size(1) : 0, batch, top_k, width, out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdsa, CPU, m) { m.impl("indexer_topk_decode", TORCH_FN(indexer_topk_decode)); }
"""
)


# One source for both builds: `dot_bf16_pairs` (cpu_extension.PRELUDE) is what differs.
kernel_available = kernel_availability("indexer_topk_decode", "kdsa::indexer_topk_decode", _SOURCE, _SOURCE)


def decode_kernel_applies(q_index: torch.Tensor, index_pages) -> bool:
    """The kernel handles this decode step: bf16 plain pages on a CPU that supports it, one query per sequence, a
    head count that is a multiple of 8, an even head dim, pages of a multiple of 8 rows, at most
    `cpu_extension.MAX_THREADS` threads — and it is built and loaded."""
    return (
        q_index.device.type == "cpu"
        and q_index.dtype == torch.bfloat16
        and q_index.shape[1] == 1
        and q_index.shape[2] % 8 == 0
        and q_index.shape[3] % 2 == 0
        and isinstance(index_pages, torch.Tensor)
        and index_pages.dtype == torch.bfloat16
        and index_pages.is_contiguous()
        and index_pages.shape[1] % 8 == 0
        and few_threads()
        and kernel_available()
    )


_SCHEMA = (
    "indexer_topk_decode(Tensor q_index, Tensor scaled_weights, Tensor index_pages, Tensor block_table, "
    "Tensor num_keys, Tensor? key_padding, int top_k, int width) -> Tensor"
)


def _fake_indexer_topk_decode(q_index, scaled_weights, index_pages, block_table, num_keys, key_padding, top_k, width):
    return q_index.new_empty(q_index.shape[0], width, dtype=torch.int64)


# `kdsa::indexer_topk_decode`: the schema and the fake (a compiled graph holds the op as one call, its shape from the
# fake) are registered here; the CPU kernel by the C++ library when `kernel_available()` first loads it, so the
# dispatcher calls C++ directly (a Python kernel cost ~80 µs more per call when a step had evicted it from the caches).
# The package and a checkpoint's copy of this file may both be imported in one process: the first registration stands
# (the copies are identical).
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "indexer_topk_decode"):
    _LIBRARY.define(_SCHEMA)
    torch.library.register_fake("kdsa::indexer_topk_decode", _fake_indexer_topk_decode, lib=_LIBRARY)
indexer_topk_decode = torch.ops.kdsa.indexer_topk_decode
