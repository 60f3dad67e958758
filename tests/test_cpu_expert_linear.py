"""The hand-written CPU kernel of the routed experts' decode products (modeling_kdsa/cpu_expert_linear.py,
docs/graph-mode.md §12): each pair's row against the row kernel on its expert's matrix, pairs of one expert read
together, the two-thread split, the input checks, the compiled op, and the MoE paths that reach it (eager 1 to 4
tokens, bit for bit the grouped loop; compiled decode)."""

import dataclasses

import pytest
import torch
from conftest import (
    assert_avx2_builds_pass,
    assert_refused_like_every_cpu_kernel,
    count_calls,
    graph_recorder,
    graph_targets,
    needs_kernel_build,
    runs_avx512_builds,
)

from modeling_kdsa import cpu_expert_linear, cpu_extension
from modeling_kdsa import kernels as kernels_module
from modeling_kdsa.configuration_kdsa import KDSAConfig
from modeling_kdsa.cpu_expert_linear import expert_linear, expert_linear_applies
from modeling_kdsa.cpu_row_linear import kernel_available as row_kernel_available
from modeling_kdsa.cpu_row_linear import row_linear
from modeling_kdsa.moe import KDSAExperts

pytestmark = pytest.mark.usefixtures("kernels_at_this_thread_count", "no_grad")


def experts_in_place(patch, answer) -> None:
    """The `cpu` backend's `experts_in_place` replaced by `answer` (the layers look their KernelSet up per call), so
    that `KDSAExperts` takes the paths it takes where the expert kernel does not apply."""
    cpu_kernels = dataclasses.replace(kernels_module.CPU_KERNELS, experts_in_place=answer)
    patch.setattr(kernels_module, "CPU_KERNELS", cpu_kernels)


def case(experts=5, n=40, k=37, pairs=6, seed=0):
    """bf16 stacked weights `[E, N, K]`, rows `[P, K]` and expert indices `[P]` (with repeats)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, n, k, generator=generator).bfloat16()
    x = torch.randn(pairs, k, generator=generator).bfloat16()
    index = torch.randint(0, experts, (pairs,), generator=generator)
    return x, weight, index


def row_kernel_products(x, weight, index):
    """Each pair through `kdsa::row_linear` on its expert's matrix, one call per pair."""
    assert row_kernel_available()  # loads the row kernel
    return torch.cat([row_linear(x[p : p + 1].contiguous(), weight[e], None) for p, e in enumerate(index.tolist())])


@needs_kernel_build
@pytest.mark.parametrize(
    "experts, n, k, pairs",
    [
        (5, 40, 37, 6),  # K = 32 + a masked tail of 5
        (8, 1024, 128, 2),  # one unrolled step of 128, a decode step's gate_up rows (two slots)
        (3, 7, 300, 9),  # every loop of the row kernel, more pairs than experts
        (4, 16, 16, 1),  # a row shorter than one vector
    ],
)
def test_each_pair_is_the_row_kernel_on_its_expert(experts, n, k, pairs):
    """Bit for bit `row_linear` of the pair's row with `weight[experts[p]]` (the same loop, the same order of
    additions), and within one bf16 rounding of the fp32 product."""
    x, weight, index = case(experts, n, k, pairs)
    assert expert_linear_applies(x, weight)
    got = expert_linear(x, weight, index)
    assert got.shape == (pairs, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, row_kernel_products(x, weight, index))
    exact = torch.einsum("pk,pnk->pn", x.float(), weight[index].float())
    assert ((got.float() - exact).abs() <= 2**-8 * exact.abs() + 1e-5).all()


@needs_kernel_build
def test_pairs_of_one_expert_share_its_reads_in_groups_of_up_to_sixteen():
    """Seven pairs of expert 2 (one group), one of expert 0 and two of expert 4, interleaved; then 21 pairs of expert 1
    (groups of 16 and 5, the row kernel's groups of 4 inside): every row is still the row kernel's on its own expert,
    within one bf16 rounding of the fp32 product."""
    assert cpu_expert_linear.kernel_available()  # loads the op, whichever test of the file runs first
    x, weight, _ = case(experts=5, n=40, k=300, pairs=10)
    index = torch.tensor([2, 0, 2, 2, 4, 2, 2, 4, 2, 2])
    assert torch.equal(expert_linear(x, weight, index), row_kernel_products(x, weight, index))
    x, weight, _ = case(experts=5, n=40, k=300, pairs=24)
    index = torch.tensor([1] * 10 + [3] + [1] * 11 + [0, 3])
    got = expert_linear(x, weight, index)
    for p in range(24):  # each row against the row kernel given all rows of its expert at once (same groups)
        same = (index == index[p]).nonzero().flatten()
        rows = [row_linear(x[same[i : i + 16]].contiguous(), weight[index[p]], None) for i in range(0, len(same), 16)]
        assert torch.equal(got[p], torch.cat(rows)[(same == p).nonzero().item()])
    exact = torch.einsum("pk,pnk->pn", x.float(), weight[index].float())
    assert ((got.float() - exact).abs() <= 2**-8 * exact.abs() + 1e-5).all()


@needs_kernel_build
def test_rows_are_read_through_their_stride():
    """x may have any row stride: a token's row expanded over its slots (stride 0) gives the results of its copies."""
    assert cpu_expert_linear.kernel_available()
    x, weight, index = case(pairs=4)
    shared = x[:1].expand(4, -1)
    assert shared.stride(0) == 0
    assert torch.equal(expert_linear(shared, weight, index), expert_linear(shared.contiguous(), weight, index))


@needs_kernel_build
def test_two_threads_split_the_pairs_rows(monkeypatch):
    """Over the grain (~512 KiB of weight per thread) the pairs' rows are split between two threads, a block
    boundary falling inside a pair's rows: the results stay the row kernel's. (That the split happens at all needs the
    OpenMP build: test_cpu_extension.py.)"""
    assert cpu_expert_linear.kernel_available()
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", 2)
    torch.set_num_threads(2)
    try:
        x, weight, index = case(experts=4, n=1000, k=512, pairs=3)  # grain 512 rows: blocks end mid-pair
        assert torch.equal(expert_linear(x, weight, index), row_kernel_products(x, weight, index))
    finally:
        torch.set_num_threads(threads)


@needs_kernel_build
def test_the_kernel_refuses_inputs_it_cannot_read():
    """The op reads raw pointers: a wrong dtype, a width mismatch, strided values, an index of another length or type,
    and an expert outside the weight are ValueErrors, not crashes or reads past the weight."""
    assert cpu_expert_linear.kernel_available()
    x, weight, index = case()
    for args in [
        (x.float(), weight, index),
        (x, weight.float(), index),
        (x[:, :5].contiguous(), weight, index),
        (x.t().contiguous().t(), weight, index),
        (x, weight.transpose(1, 2).contiguous().transpose(1, 2), index),
        (x, weight[0], index),
        (x, weight, index[:2]),
        (x, weight, index.int()),
    ]:
        with pytest.raises(ValueError, match="expert_linear takes"):
            expert_linear(*args)
    for bad in (5, -1):
        with pytest.raises(ValueError, match=f"expert index {bad} of pair 2 is outside"):
            expert_linear(x, weight, torch.tensor([0, 1, bad, 0, 1, 2]))


@needs_kernel_build
def test_the_torch_paths_run_where_the_kernel_does_not_apply(monkeypatch):
    """fp32, a weight subclass or non-contiguous weight, autograd, autocast, more threads than MAX_THREADS and an
    unavailable kernel keep the torch paths."""
    x, weight, index = case()

    class Subclass(torch.Tensor):
        pass

    for args in [(x.float(), weight), (x, weight.float()), (x, weight.as_subclass(Subclass)), (x, weight[:, ::2])]:
        assert not expert_linear_applies(*args)
    assert_refused_like_every_cpu_kernel(monkeypatch, expert_linear_applies, (x, weight), cpu_expert_linear)


def make_experts(num_experts=16, width=64, intermediate=48, seed=0) -> KDSAExperts:
    config = KDSAConfig(hidden_size=width, moe_intermediate_size=intermediate, n_routed_experts=num_experts)
    experts = KDSAExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return experts.bfloat16()


@needs_kernel_build
@pytest.mark.parametrize("num_experts, top_k", [(16, 4), (32, 16)])
def test_one_token_runs_its_experts_through_the_kernel_without_a_host_sync(monkeypatch, num_experts, top_k):
    """Eagerly, one bf16 token takes two kernel calls (gate_up, down) for all its slots, no Python loop over experts
    and no `.tolist()`; its output is bit for bit the grouped path's (that of two tokens on disjoint experts), and the
    per-expert loop gives the same bits where the kernel does not apply. Up to 16 slots: torch's sum over them then
    adds in order (more are summed pairwise, docs/graph-mode.md §12)."""
    experts = make_experts(num_experts)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        hidden = torch.randn(2, 64, generator=generator).bfloat16()
        indices = torch.randperm(num_experts, generator=generator)[: 2 * top_k].reshape(2, top_k)  # disjoint, unsorted
        weights = torch.rand(2, top_k, generator=generator)
        grouped = experts(hidden, indices, weights)
        with monkeypatch.context() as patch:
            calls = count_calls(patch, cpu_expert_linear, "expert_linear")
            patch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a host sync in the one-token path"))
            alone = experts(hidden[:1], indices[:1], weights[:1])
        assert len(calls) == 2 and calls[0][0].shape == (top_k, 64)  # gate_up and down, all slots at once
        assert torch.equal(alone[0], grouped[0])
        with monkeypatch.context() as patch:
            calls = count_calls(patch, cpu_expert_linear, "expert_linear")
            experts_in_place(patch, lambda *args: False)
            assert torch.equal(experts(hidden[:1], indices[:1], weights[:1]), alone)
        assert not calls


@needs_kernel_build
@pytest.mark.parametrize("tokens", [2, 3, 4, 5, 8, 16])
def test_up_to_sixteen_tokens_take_the_kernel_with_the_grouped_paths_bits(monkeypatch, tokens):
    """A decode step of several sequences or a verification of 2 to 16 tokens (sharing some experts, up to 16 pairs
    of one expert): two kernel calls, no host sync, and bit for bit the grouped loop's output (whose products are the
    row kernel's for up to 16 rows per expert)."""
    experts = make_experts(num_experts=6)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(tokens, 64, generator=generator).bfloat16()
    indices = torch.stack([torch.randperm(6, generator=generator)[:3] for _ in range(tokens)])  # experts shared
    weights = torch.rand(tokens, 3, generator=generator)
    with monkeypatch.context() as patch:
        experts_in_place(patch, lambda *args: False)
        grouped = experts(hidden, indices, weights)
    with monkeypatch.context() as patch:
        calls = count_calls(patch, cpu_expert_linear, "expert_linear")
        patch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a host sync in the batch decode path"))
        batched = experts(hidden, indices, weights)
    assert len(calls) == 2 and calls[0][0].shape == (3 * tokens, 64)
    assert torch.equal(batched, grouped)


@needs_kernel_build
def test_compiled_batch_of_four_takes_the_kernel_even_with_more_pairs_than_experts():
    """Compiled, 4 tokens x 3 slots over 6 experts (12 pairs > 6 experts, where the fixed-shape path without the
    kernel runs every expert on every token) take the kernel, with the eager grouped loop's bits."""
    experts = make_experts(num_experts=6)
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 64, generator=generator).bfloat16()
    indices = torch.stack([torch.randperm(6, generator=generator)[:3] for _ in range(4)])
    weights = torch.rand(4, 3, generator=generator)
    backend, graphs = graph_recorder()
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, dynamic=False, backend=backend)
    assert torch.equal(compiled(hidden, indices, weights), experts(hidden, indices, weights))
    assert sum("expert_linear" in target for target in graph_targets(graphs)) == 2


@needs_kernel_build
@pytest.mark.parametrize("tokens", [17, 0])
def test_seventeen_tokens_or_none_keep_the_grouped_loop(monkeypatch, tokens):
    """More tokens than the row kernel's 16 rows (a prefill) keep the grouped GEMMs; so does an empty batch."""
    experts = make_experts()
    calls = count_calls(monkeypatch, cpu_expert_linear, "expert_linear")
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert experts(hidden, torch.randint(0, 16, (tokens, 1)), torch.rand(tokens, 1)).shape == (tokens, 64)
    assert not calls


@needs_kernel_build
@pytest.mark.parametrize("kernel", [True, False])
def test_one_tokens_slots_are_summed_in_expert_order(monkeypatch, kernel):
    """The grouped loop adds a token's weighted expert outputs in expert order; the one-token paths must too, whatever
    order the router lists the slots in. Experts 2 and 9 made identical with weights -1e8 and +1e8 cancel exactly when
    added first (slot order 9, 2, 5), and lose expert 5's low bits when 5 comes between them (expert order 2, 5, 9)."""
    experts_in_place(monkeypatch, lambda *args: kernel and expert_linear_applies(*args))
    experts = make_experts()
    with torch.no_grad():
        experts.gate_up_proj[9] = experts.gate_up_proj[2]
        experts.down_proj[9] = experts.down_proj[2]
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    indices, weights = torch.tensor([[9, 2, 5], [0, 1, 3]]), torch.tensor([[1e8, -1e8, 1.0], [0.2, 0.3, 0.5]])
    grouped = experts(hidden, indices, weights)
    alone = experts(hidden[:1], indices[:1], weights[:1])
    assert torch.equal(alone[0], grouped[0])
    slot_order = experts._run_expert(hidden[:1], 5)  # what adding in slot order leaves: expert 5's output alone
    assert not torch.equal(alone, slot_order)


@needs_kernel_build
def test_compiled_decode_holds_the_kernel_as_an_op():
    """In a compiled step the fixed-shape decode path calls the op (no gathered weights), with the eager bits;
    `opcheck` checks the fake against the real op."""
    experts = make_experts()
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    indices, weights = torch.tensor([[9, 2, 14, 5]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    backend, graphs = graph_recorder()
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, dynamic=False, backend=backend)
    assert torch.equal(compiled(hidden, indices, weights), experts(hidden, indices, weights))
    targets = graph_targets(graphs)
    assert sum("expert_linear" in target for target in targets) == 2
    x, weight, index = case()
    torch.library.opcheck(torch.ops.kdsa.expert_linear.default, (x, weight, index))


@runs_avx512_builds
def test_the_avx2_builds_pass_every_test_of_this_file():
    """The AVX2 build (what CPUs without AVX512-BF16 run) is the same op over the row kernel's AVX2 `gemv`."""
    assert_avx2_builds_pass(__file__)
