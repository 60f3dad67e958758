"""The routed experts' products for a decode step in bf16 on x86 CPUs: each row through its own expert's weight, read
in place from the stacked weights (docs/graph-mode.md §12).

`kdsa::expert_linear(x [P, K], weight [E, N, K], experts [P]) -> [P, N]` computes `x[p] @ weight[experts[p]]ᵀ` for
every (token, slot) pair p: the row kernel's dot products (`cpu_row_linear`), the same loop and order of additions,
so each row's result is bit for bit what `cpu_row_linear.row_linear(x[p], weight[experts[p]])` gives. Pairs of the same
expert (tokens of a batch or of a verification that chose it) share each read of its weight, up to 16 at a time, as the
row kernel shares a weight between up to 16 rows; the experts' weights are read one after the other (one sequential
stream per thread, split over threads by rows). The expert indices are read by the kernel, so neither eager nor a
compiled step syncs on them or copies a weight.

`KDSAExperts` calls it for up to 16 tokens eagerly (instead of a Python loop over the experts after a host sync) and for
its fixed-shape decode path in a compiled step (instead of inductor's multiply-and-sum over the gathered weights,
docs/graph-mode.md §4, §9). `cpu_extension` builds and loads the C++ source, over the row kernel's AVX512-BF16 or AVX2
`gemv` (`cpu_extension.kernel_isa`); where the kernel cannot run (no AVX2, no compiler, not bf16, autograd, export, more
than `cpu_extension.MAX_THREADS` threads) those paths keep their torch form. `cpu_expert_linear` below is the `cpu`
backend's `expert_linear`, and `expert_linear_applies` its `experts_in_place` (kernels.py).
"""

import torch

from .cpu_extension import plain_tensor
from .cpu_row_linear import bf16_kernel_input, gemv_kernel_availability
from .linear_ops import expert_linear as expert_linear_reference

# The op over either build's `gemv` (cpu_row_linear: GEMV_SOURCE or GEMV_AVX2_SOURCE).
_OP_SOURCE = r"""
#include <ATen/Parallel.h>

namespace {

// The most pairs of one expert that share each read of its weight: `gemv`'s rows (`cpu_row_linear.MAX_ROWS`).
constexpr int kGroupRows = 16;

// The pairs of one expert, up to kGroupRows.
struct Group {
  int64_t expert;
  int rows;
  int64_t pair[kGroupRows];
};

// Pairs in expert order (stable), in groups of up to kGroupRows pairs of the same expert: a decode step of several
// sequences (or a verification's tokens) whose tokens chose the same expert read its weight once.
std::vector<Group> groups_by_expert(const int64_t* expert, int64_t pairs) {
  std::vector<int64_t> order(pairs);
  for (int64_t p = 0; p < pairs; ++p) order[p] = p;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return expert[a] < expert[b]; });
  std::vector<Group> groups;
  for (int64_t p : order) {
    if (groups.empty() || groups.back().expert != expert[p] || groups.back().rows == kGroupRows)
      groups.push_back(Group{expert[p], 0, {}});
    groups.back().pair[groups.back().rows++] = p;
  }
  return groups;
}

// kdsa::expert_linear (schema in Python): x [P, K] bf16 with contiguous rows (any row stride), weight [E, N, K]
// contiguous bf16, experts [P] int64 in [0, E). Bad input is a ValueError.
at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& experts) {
  bool ok = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
            x.stride(1) == 1 && x.stride(0) >= 0 && weight.dim() == 3 && weight.is_contiguous() &&
            x.size(1) == weight.size(2) && x.size(1) > 0 && experts.scalar_type() == at::kLong && experts.dim() == 1 &&
            experts.is_contiguous() && experts.size(0) == x.size(0);
  TORCH_CHECK_VALUE(ok,
      "expert_linear takes bf16 x [P, K] with contiguous rows, contiguous bf16 weight [E, N, K] and int64 experts [P];"
      " got x ", describe(x), " strides ", x.strides(), ", weight ", describe(weight), ", experts ", describe(experts));
  const int64_t pairs = x.size(0), num_experts = weight.size(0), n = weight.size(1), k = weight.size(2);
  const int64_t* expert = experts.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p)
    TORCH_CHECK_VALUE(0 <= expert[p] && expert[p] < num_experts, "expert_linear: expert index ", expert[p],
                      " of pair ", p, " is outside [0, ", num_experts, ")");
  at::Tensor out = at::empty({pairs, n}, x.options());
  const std::vector<Group> groups = groups_by_expert(expert, pairs);
  const int64_t num_groups = (int64_t)groups.size();
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wp = (const uint16_t*)weight.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  // The groups' N output rows each, in order, split over threads in blocks of ~512 KiB of weight or more (as
  // `row_linear`): each thread reads its groups' weights one after the other. A group's x rows are copied side by side
  // and its outputs computed side by side (`gemv`'s layout), then put in their pairs' rows.
  const int64_t grain = std::max<int64_t>(1, (512 << 10) / (2 * k));
  at::parallel_for(0, num_groups * n, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> rows_in(kGroupRows * k), rows_out(kGroupRows * n);
    for (int64_t g = begin / n; g * n < end; ++g) {
      const Group& group = groups[g];
      const int64_t first = std::max(begin, g * n) - g * n, last = std::min(end, (g + 1) * n) - g * n;
      for (int m = 0; m < group.rows; ++m)
        std::copy_n(xp + group.pair[m] * x.stride(0), k, rows_in.data() + m * k);
      gemv(group.rows, rows_in.data(), k, wp + group.expert * n * k, k, nullptr, rows_out.data(), n, first, last);
      for (int m = 0; m < group.rows; ++m)
        std::copy_n(rows_out.data() + m * n + first, last - first, op + group.pair[m] * n + first);
    }
  });
  return out;
}

}  // namespace

"""
kernel_available = gemv_kernel_availability("expert_linear", ("expert_linear",), _OP_SOURCE)


def expert_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel computes each row of `x` `[P, K]` times its expert's matrix of `weight` `[E, N, K]`: the bf16
    kernels' `bf16_kernel_input` in rows of contiguous values, a plain contiguous bf16 weight (no tensor subclass),
    on a CPU that supports it — and it is built and loaded."""
    return (
        bf16_kernel_input(x)
        and x.dim() == 2
        and x.stride(-1) == 1
        and plain_tensor(weight)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 3
        and weight.is_contiguous()
        and kernel_available()
    )


def _fake_expert_linear(x, weight, experts):
    return x.new_empty(x.shape[0], weight.shape[1])


# Registered as `cpu_indexer` registers its op: the schema and the fake here, the CPU kernel by the C++ library when
# `kernel_available()` first loads it; the first registration in a process stands.
_LIBRARY = torch.library.Library("kdsa", "FRAGMENT")
if not hasattr(torch.ops.kdsa, "expert_linear"):
    _LIBRARY.define("expert_linear(Tensor x, Tensor weight, Tensor experts) -> Tensor")
    torch.library.register_fake("kdsa::expert_linear", _fake_expert_linear, lib=_LIBRARY)
expert_linear = torch.ops.kdsa.expert_linear


def cpu_expert_linear(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
    """The `cpu` backend's `expert_linear`: `kdsa::expert_linear` where `expert_linear_applies` (stacked weights
    and expert indices), else the torch reference `linear_ops.expert_linear` (same arguments and result)."""
    if experts is not None and expert_linear_applies(x, weight):
        return expert_linear(x, weight, experts)
    return expert_linear_reference(x, weight, experts)


__all__ = ["cpu_expert_linear", "expert_linear", "expert_linear_applies", "kernel_available"]
