"""The token-by-token KDA recurrence (a decode step, or the replay of a rollback) on x86 CPUs as one hand-written kernel
over all heads (docs/kda.md §9).

`kda_ops.recurrent_kda` runs a token as a handful of batched torch ops over the fp32 state `[B, H, K, V]` (decay,
prediction `kᵀS`, rank-1 update, output `qᵀS`), each a pass over the state (256 KiB a layer at the benchmark shape, not
in cache at the next step: a decode step reads the weights in between). Here each head's state is read once and the
new state written once, the four steps running on 16 columns at a time while they are in L1: 1.7-2.0x the reference
per layer with the state out of cache (`scripts/bench_cpu_kernels.py`).

`cpu_extension` builds and loads the C++ source below, which implements the CPU kernel of the `torch.library` op
`kdsa::kda_recurrent` (schema and fake implementation registered here), for AVX512 or AVX2
(`cpu_extension.kernel_isa`). Where it cannot run (no AVX2, no compiler, a value head size that is not a multiple of 16,
autograd, export, more than `cpu_extension.MAX_THREADS` threads) `kda_ops.recurrent_kda` runs.
"""

import torch

from .cpu_extension import PRELUDE, few_threads, kernel_availability, kernels_traceable
from .kda_ops import _check_kda_inputs, recurrent_kda

_SOURCE = (
    PRELUDE
    + r"""
#include <ATen/Parallel.h>

namespace {

// One head of one sequence, T tokens, in fp32 (docs/kda.md §3): for each token
//   S = Diag(exp g) S;  delta = beta (v - kᵀS);  S = S + k deltaᵀ;  o = (scale q)ᵀ S.
// Column j of the new state needs only delta[j], so the state [K, V] (row-major) is taken 16 columns (one AVX512
// vector) at a time: a pass down the K rows decays them and sums the prediction, a second pass adds the rank-1 update
// and sums the output, both sums in registers, the column block (K x 64 bytes) in L1 between the passes. q, k, g
// advance by `key_stride` per token, v and o by `value_stride`, beta by `beta_stride`; value_dim is a multiple of 16.
// The first token reads `initial` (nullptr: zeros) and writes `state`, so the state is read and written once per call.
void kda_head(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* initial,
              float* state, float* out, int64_t tokens, int64_t key_dim, int64_t value_dim, int64_t key_stride,
              int64_t value_stride, int64_t beta_stride, float scale, float* decay) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* qt = q + t * key_stride;
    const float* kt = k + t * key_stride;
    const float* gt = g + t * key_stride;
    // exp(g) with ATen's vectorised exp, the one torch's `exp` runs on this CPU.
    for (int64_t i = 0; i < key_dim; i += Vec::size()) {
      const int count = (int)std::min<int64_t>(Vec::size(), key_dim - i);
      Vec::loadu(gt + i, count).exp().store(decay + i, count);
    }
    const Vec b(beta[t * beta_stride]);
    const float* previous = t == 0 ? initial : state;
    for (int64_t j = 0; j < value_dim; j += Vec::size()) {
      Vec prediction(0.0f), o(0.0f);
      for (int64_t i = 0; i < key_dim; ++i) {
        const Vec row = (previous ? Vec::loadu(previous + i * value_dim + j) : Vec(0.0f)) * Vec(decay[i]);
        row.store(state + i * value_dim + j);
        prediction = at::vec::fmadd(Vec(kt[i]), row, prediction);
      }
      const Vec delta = b * (Vec::loadu(v + t * value_stride + j) - prediction);
      for (int64_t i = 0; i < key_dim; ++i) {
        const Vec row = at::vec::fmadd(Vec(kt[i]), delta, Vec::loadu(state + i * value_dim + j));
        row.store(state + i * value_dim + j);
        o = at::vec::fmadd(Vec(qt[i] * scale), row, o);
      }
      o.store(out + t * value_stride + j);
    }
  }
}

// `VALUE_DIM_MULTIPLE` in Python: a whole number of vectors in either build (16 fp32 lanes in AVX512, 8 in AVX2).
constexpr int64_t kValueMultiple = 16;
static_assert(kValueMultiple % at::vec::Vectorized<float>::size() == 0);

}  // namespace

// kdsa::kda_recurrent (schema in Python): q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], initial_state
// [B, H, K, V] or none (zeros), all contiguous fp32. Returns o [B, T, H, V] and the final state [B, H, K, V] (a new
// tensor; initial_state is not modified). Checks what the pointer arithmetic relies on: bad input is a ValueError.
std::tuple<at::Tensor, at::Tensor> kda_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta,
                                                 const std::optional<at::Tensor>& initial_state, double scale) {
  auto fits = [](const at::Tensor& t, int64_t dim) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim;
  };
  auto leading = [&](const at::Tensor& t) { return t.sizes().slice(0, 3) == q.sizes().slice(0, 3); };  // B, T, H
  bool ok = fits(q, 4) && fits(k, 4) && fits(g, 4) && fits(v, 4) && fits(beta, 3) && k.sizes() == q.sizes() &&
            g.sizes() == q.sizes() && leading(v) && leading(beta) && q.size(1) > 0 &&
            v.size(3) % kValueMultiple == 0;
  if (ok && initial_state)
    ok = fits(*initial_state, 4) &&
         initial_state->sizes() == at::IntArrayRef({q.size(0), q.size(2), q.size(3), v.size(3)});
  TORCH_CHECK_VALUE(ok,
      "kda_recurrent takes contiguous fp32 q, k, g [B, T, H, K], v [B, T, H, V] (T > 0, V a multiple of ",
      kValueMultiple, "), beta [B, T, H] and initial_state [B, H, K, V] or None; got q ",
      describe(q), ", k ", describe(k), ", v ", describe(v), ", g ", describe(g), ", beta ", describe(beta),
      ", initial_state ", initial_state ? describe(*initial_state) : std::string("None"));
  const int64_t batch = q.size(0), tokens = q.size(1), heads = q.size(2), key_dim = q.size(3), value_dim = v.size(3);
  at::Tensor state = at::empty({batch, heads, key_dim, value_dim}, q.options());
  at::Tensor out = at::empty({batch, tokens, heads, value_dim}, q.options());
  const int64_t key_stride = heads * key_dim, value_stride = heads * value_dim, state_size = key_dim * value_dim;
  // Heads are independent; with 2 threads each takes a block of them (at least 64 KiB of state each).
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (4 * state_size));
  at::parallel_for(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> decay(key_dim);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const int64_t key_offset = b * tokens * key_stride + h * key_dim;
      const int64_t value_offset = b * tokens * value_stride + h * value_dim;
      kda_head(q.data_ptr<float>() + key_offset, k.data_ptr<float>() + key_offset, v.data_ptr<float>() + value_offset,
               g.data_ptr<float>() + key_offset, beta.data_ptr<float>() + b * tokens * heads + h,
               initial_state ? initial_state->data_ptr<float>() + bh * state_size : nullptr,
               state.data_ptr<float>() + bh * state_size, out.data_ptr<float>() + value_offset, tokens, key_dim,
               value_dim, key_stride, value_stride, heads, (float)scale, decay.data());
    }
  });
  return {out, state};
}

TORCH_LIBRARY_IMPL(kdsa, CPU, m) { m.impl("kda_recurrent", TORCH_FN(kda_recurrent)); }
"""
)


# One source for both builds: ATen's `at::vec` is AVX512 or AVX2 code by the build's CPU_CAPABILITY.
kernel_available = kernel_availability("kda_recurrent", "kdsa::kda_recurrent", _SOURCE, _SOURCE)


# The kernel takes the state 16 columns (one AVX512 fp32 vector, two AVX2 ones) at a time.
VALUE_DIM_MULTIPLE = 16


def kernel_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel runs this recurrence: on a CPU that supports it, at least one token, a value head size that is a
    multiple of `VALUE_DIM_MULTIPLE`, not under `torch.export` (an exported program may run where the op is not
    registered) unless `kernels_in_export()`, without autograd (the op has no backward), at most
    `cpu_extension.MAX_THREADS` threads — and it is built and loaded."""
    return (
        q.device.type == "cpu"
        and q.dim() == 4
        and q.shape[1] > 0  # the state is written by the first token
        and v.shape[-1] % VALUE_DIM_MULTIPLE == 0
        and kernels_traceable()
        and not torch.is_grad_enabled()
        and few_threads()
        and kernel_available()
    )


# The most tokens after a cached state that the KDA layer steps through this kernel in one call instead of the chunked
# form (kda.py, where `kda_recurrent_stepwise`, this backend's `kernel_applies`, holds): a verification of up to 15
# drafted tokens and the anchor. Each token's steps are those of a one-token call (the state goes through the same fp32
# buffer), so the final state is bit for bit that of T one-token calls.
MAX_STEPPED_TOKENS = 16


def cpu_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """`kda_ops.recurrent_kda` (same arguments and results, the registry's `kda_recurrent` contract) through the
    kernel where it applies."""
    if not kernel_applies(q, v):
        return recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)
    _check_kda_inputs(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5

    def fp32(x: torch.Tensor) -> torch.Tensor:
        return x.float().contiguous()

    state = None if initial_state is None else fp32(initial_state)
    o, final_state = kda_recurrent(fp32(q), fp32(k), fp32(v), fp32(g), fp32(beta), state, scale)
    return o.to(v.dtype), (final_state if output_final_state else None)


_SCHEMA = (
    "kda_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, float scale) -> "
    "(Tensor, Tensor)"
)


def _fake_kda_recurrent(q, k, v, g, beta, initial_state, scale):
    batch, tokens, heads, key_dim = q.shape
    return v.new_empty(v.shape), q.new_empty(batch, heads, key_dim, v.shape[-1])


# Registered as `cpu_indexer` registers its op: the schema and the fake here, the CPU kernel by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "kda_recurrent"):
    _LIBRARY.define(_SCHEMA)
    torch.library.register_fake("kdsa::kda_recurrent", _fake_kda_recurrent, lib=_LIBRARY)
kda_recurrent = torch.ops.kdsa.kda_recurrent

__all__ = [
    "MAX_STEPPED_TOKENS",
    "VALUE_DIM_MULTIPLE",
    "cpu_recurrent_kda",
    "kda_recurrent",
    "kernel_applies",
    "kernel_available",
]
