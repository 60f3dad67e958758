"""Graph mode (docs/graph-mode.md): the fixed-capacity `KDSAStaticCache`, the decode step that generate() compiles with
it, the fixed-shape kernels and MoE paths a compiled graph takes, and `torch.compile(model)` with the paged cache.

Compiles are costly on a shared CPU, so the fast tests trace with dynamo's `eager` backend (the same graph capture,
`fullgraph` and recompile checks, no inductor code generation); the inductor runs are marked slow.
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from conftest import count_calls, cpu_compile_config, needs_kernel_build, tiny_model
from transformers import CompileConfig

from modeling_kdsa import KDSAQuantizationConfig, cpu_kda_recurrent, cpu_row_linear, dsa, dsa_paged_cpu, static_cache
from modeling_kdsa.cache import KDSACache, KDSAPagedKPoolLayer
from modeling_kdsa.linear import KDSALinear
from modeling_kdsa.static_cache import KDSAStaticCache, StaticKPoolLayer

CAPTURED_GRAPHS = []


def recording_backend(graph_module, example_inputs):
    """Dynamo's `eager` backend that also keeps the captured FX graphs, so a test can look for host syncs in them."""
    CAPTURED_GRAPHS.append(graph_module)
    return graph_module.forward


def all_nodes(graphs):
    """Every FX node of the captured graphs and of the bodies of their compile regions (docs/graph-mode.md §8)."""
    for graph in graphs:
        for module in graph.modules():
            if isinstance(module, torch.fx.GraphModule):
                yield from module.graph.nodes


def host_syncs(graphs) -> list[str]:
    """Ops of the captured graphs that read a tensor's value on the host. torch 2.13 traces `.item()` / `.tolist()`
    without a graph break (an unbacked scalar), so fullgraph alone does not exclude them; on a GPU each is a sync."""
    syncs = []
    for node in all_nodes(graphs):
        if node.op == "call_method" and node.target in ("item", "tolist"):
            syncs.append(node.target)
        elif node.op == "call_function" and "_local_scalar_dense" in str(node.target):
            syncs.append(str(node.target))
    return syncs


def page_gathers(graphs) -> list[str]:
    """`index_select`s of the captured graphs that gather whole pages `[n, P, W]` rather than rows: a fixed-shape read
    that copies the pool instead of viewing it (docs/graph-mode.md §3)."""
    gathers = []
    for node in all_nodes(graphs):
        value = node.meta.get("example_value")
        if "index_select" in str(node.target) and isinstance(value, torch.Tensor) and value.dim() == 3:
            gathers.append(f"{node.name} {tuple(value.shape)}")
    return gathers


def compile_config(backend=recording_backend, **overrides) -> CompileConfig:
    """generate()'s CPU compile config (`cpu_compile_config`), recording the captured graphs by default."""
    return cpu_compile_config(backend, **overrides)


def prompt(batch: int = 2, length: int = 60, padded: int = 5):
    """Random prompts, the first row left-padded by `padded` tokens. 60 tokens + 32 new cross a page boundary (64)."""
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :padded] = 0
    return ids, mask


def greedy(model, ids, mask, new_tokens, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, **kwargs
        )


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    CAPTURED_GRAPHS.clear()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------- eager static


@pytest.mark.parametrize("features", [{}, "kpool"], ids=["dsa", "kpool"])
def test_static_cache_eager_is_the_paged_cache(features):
    """Uncompiled, the static cache runs the paged kernels over the cached tokens: the same logits, bit for bit (the
    k-pool indexer: the pools the static store writes are the paged store's)."""
    model = tiny_model(**(KPOOL_MODEL if features == "kpool" else features))
    ids, mask = prompt(length=20)
    dynamic = greedy(model, ids, mask, 12, output_logits=True, return_dict_in_generate=True)
    static = greedy(
        model, ids, mask, 12, output_logits=True, return_dict_in_generate=True, cache_implementation="static"
    )
    assert torch.equal(dynamic.sequences, static.sequences)
    assert all(torch.equal(a, b) for a, b in zip(dynamic.logits, static.logits, strict=True))


@pytest.mark.parametrize("features", [{}, "kpool"], ids=["dsa", "kpool"])
def test_static_cache_state_lives_at_fixed_addresses(features):
    model = tiny_model(**(KPOOL_MODEL if features == "kpool" else features))
    ids, mask = prompt(length=20)
    cache = KDSAStaticCache(model.config, max_cache_len=40)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        addresses = [t.data_ptr() for layer in cache.layers for t in _layer_tensors(layer)]
        model(ids[:, :1], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1), cache=cache)
    assert [t.data_ptr() for layer in cache.layers for t in _layer_tensors(layer)] == addresses
    assert int(cache.get_seq_length()) == 21
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    assert [t.data_ptr() for layer in cache.layers for t in _layer_tensors(layer)] == addresses


def _layer_tensors(layer):
    if hasattr(layer, "block_table"):
        return (*layer._all_planes(), layer.block_table, layer.num_tokens, *_pool_origin(layer))
    return (layer.conv_states[0], layer.recurrent_states[0])


def _pool_origin(layer):
    return (layer.pool_origin,) if isinstance(layer, StaticKPoolLayer) else ()


def test_static_cache_refusals():
    model = tiny_model()
    ids, mask = prompt(length=10)
    with pytest.raises(ValueError, match="max_cache_len"):
        KDSAStaticCache(model.config, max_cache_len=0)
    cache = KDSAStaticCache(model.config, max_cache_len=16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="padding mask"):
            model(ids, attention_mask=torch.ones(2, 200, dtype=torch.long), cache=cache)
        model(ids, attention_mask=mask, cache=cache)
        with pytest.raises(ValueError, match="capacity exceeded"):
            model(ids, cache=cache)
    assert int(cache.get_seq_length()) == 10  # the refused forward wrote nothing
    with pytest.raises(ValueError, match="crop"):
        cache.crop(5)
    with pytest.raises(ValueError, match="reorder_cache"):
        cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="speculative decoding"):
        greedy(model, ids, None, 4, cache_implementation="static", prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="beam search"):
        greedy(model, ids, None, 4, cache_implementation="static", num_beams=2)
    # A static cache passed to generate() too small for the prompt and the new tokens: refused before the prefill.
    small = KDSAStaticCache(model.config, max_cache_len=12)
    with pytest.raises(ValueError, match="needs 13 cache slots .* max_cache_len=12"):
        greedy(model, ids, mask, 4, cache=small)
    assert int(small.get_seq_length()) == 0
    assert greedy(model, ids, mask, 3, cache=small).shape == (2, 13)  # 12 slots: the last token is not fed back


# ----------------------------------------------------------------------------------------------- fixed-shape kernels


@pytest.mark.parametrize(
    "features",
    [
        {},
        {"swiglu_limit": 0.05},  # GLM's clamp, active at these activation sizes
        {"hidden_act": "situ"},  # Kimi K3's SiTU
        {"routed_expert_weight_format": "mxfp4", "moe_intermediate_size": 64},  # packed experts, dequantized at use
    ],
    ids=["silu", "clamp", "situ", "mxfp4"],
)
def test_fixed_shape_moe_paths_match_the_grouped_loop(features):
    """The compiled MoE paths run each expert exactly as the eager loop does: activation, clamp, packed weights."""
    model = tiny_model(**features)
    moe = model.model.layers[1].mlp
    for tokens in (1, 9):  # decode (gathered weights) and many tokens (dense over the experts)
        hidden = torch.randn(tokens, model.config.hidden_size)
        indices, weights = moe.gate(hidden)
        expected = moe.experts(hidden, indices, weights)
        torch.testing.assert_close(moe.experts._forward_gathered(hidden, indices, weights), expected)
        torch.testing.assert_close(moe.experts._forward_dense(hidden, indices, weights), expected)


# ------------------------------------------------------------------------------------- fused single-row products


def linear_calls(graph_module) -> int:
    """`F.linear` calls in a captured graph and in the bodies of its compile regions."""
    linears = (torch._C._nn.linear, torch.nn.functional.linear)
    return sum(node.op == "call_function" and node.target in linears for node in all_nodes([graph_module]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_single_row_linear_streams_the_weight_only_when_compiled(dtype, bias):
    """KDSALinear is `F.linear` bit for bit eagerly (with autograd); compiled on CPU, a single row takes the
    multiply-and-sum form or, in bf16, the row kernel (no linear call left in the graph) and gives the GEMM's result up
    to fp32 summation order; two rows stay a GEMM unless the bf16 row kernel takes them (docs/graph-mode.md §9,
    §10)."""
    layer = KDSALinear(48, 40, bias=bias, dtype=dtype)
    compiled = torch.compile(layer, backend=recording_backend, fullgraph=True)
    for rows, streamed in ((1, True), (2, False)):
        CAPTURED_GRAPHS.clear()
        x = torch.randn(rows, 1, 48, dtype=dtype)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(layer(x), expected)
        with torch.no_grad():
            got = compiled(x)
            row_kernel = cpu_row_linear.row_linear_applies(x, layer.weight, layer.bias)
        assert linear_calls(CAPTURED_GRAPHS[-1]) == (0 if streamed or row_kernel else 1)
        reference = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double() if bias else None)
        # Both round the same fp32 sum (in another order) to the output dtype.
        tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(got.double(), reference, **tolerance)
        assert got.dtype == dtype and got.shape == expected.shape


def test_fused_form_stays_out_of_export_and_mixed_dtypes():
    """The fused form is for inductor: a strict `torch.export` (traced by dynamo, so "compiling") records the `linear`
    (its program may run without inductor), and activations of another dtype than the weight keep `F.linear`'s
    behaviour, compiled or not (here its dtype error) instead of being silently cast (docs/graph-mode.md §9)."""
    layer = KDSALinear(48, 40, bias=False)
    x = torch.randn(1, 1, 48)
    program = torch.export.export(layer, (x,), strict=True)
    assert [str(node.target) for node in program.graph.nodes if node.op == "call_function"] == ["aten.linear.default"]
    with pytest.raises(RuntimeError, match="dtype"):
        layer(x.bfloat16())
    with pytest.raises(RuntimeError, match="dtype"):
        torch.compile(layer, backend=recording_backend, fullgraph=True)(x.bfloat16())


@pytest.mark.parametrize("features", [{}, {"routed_expert_weight_format": "mxfp4", "moe_intermediate_size": 64}])
def test_compiled_gathered_experts_match_the_grouped_loop(features):
    """The gathered-expert decode path under compile (the multiply-and-sum over gathered weights) equals the eager
    loop up to fp32 summation order."""
    model = tiny_model(**features)
    experts = model.model.layers[1].mlp.experts
    hidden = torch.randn(1, model.config.hidden_size)
    indices, weights = model.model.layers[1].mlp.gate(hidden)
    with torch.no_grad():
        expected = experts(hidden, indices, weights)
        got = torch.compile(experts, backend=recording_backend, fullgraph=True)(hidden, indices, weights)
    assert not any(node.target in (torch.matmul, torch.bmm) for node in all_nodes(CAPTURED_GRAPHS))  # the fused form
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_compiled_batch_one_decode_streams_every_weight():
    """Batch 1: every linear layer of the compiled step takes the fused form, and the tokens are eager's."""
    model = tiny_model()
    ids, mask = prompt(batch=1, length=40, padded=0)
    expected = greedy(model, ids, mask, 32)
    got = greedy(model, ids, mask, 32, cache_implementation="static", compile_config=compile_config())
    assert torch.equal(got, expected)
    assert len(CAPTURED_GRAPHS) == 1 and linear_calls(CAPTURED_GRAPHS[0]) == 0


# ----------------------------------------------------------------------------------------------- compiled decode


def test_compiled_static_decode_is_one_graph_and_gives_eager_tokens():
    """generate(cache_implementation="static") compiles the decode step with fullgraph=True (no graph break, no host
    sync), one graph for 32 steps of a growing context that crosses a page boundary, and the tokens of eager decoding
    with the paged cache (left padding included)."""
    model = tiny_model()
    ids, mask = prompt()
    expected = greedy(model, ids, mask, 32)
    got = greedy(model, ids, mask, 32, cache_implementation="static", compile_config=compile_config())
    assert hasattr(model, "_compiled_call")  # generate() did take the compiled path
    assert torch.equal(got, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(CAPTURED_GRAPHS) == 1 and host_syncs(CAPTURED_GRAPHS) == []


def region_calls(graph_module) -> list[str]:
    """The body each `invoke_subgraph` call of a captured graph runs (a compile region, docs/graph-mode.md §7)."""
    return [
        node.args[0].target
        for node in graph_module.graph.nodes
        if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph
    ]


def test_compiled_static_decode_compiles_each_layer_body_once():
    """The compiled step runs each layer's sublayers (KDA; DSA; MoE) as compile regions: one `invoke_subgraph` call
    per layer and sublayer, all calls of a kind running one body, which inductor compiles once (dynamo inlines a body
    called once: here the dense MLP of layer 0). Without the regions the graph has no `invoke_subgraph` at all."""
    model = tiny_model()
    ids, mask = prompt(length=20)
    expected = greedy(model, ids, mask, 4)
    got = greedy(model, ids, mask, 4, cache_implementation="static", compile_config=compile_config())
    assert torch.equal(got, expected)
    assert len(CAPTURED_GRAPHS) == 1
    config = model.config
    kinds = [config.layer_types.count("linear_attention"), config.layer_types.count("indexed_attention")]
    kinds.append(config.mlp_layer_types.count("sparse"))
    assert min(kinds) >= 2
    calls = region_calls(CAPTURED_GRAPHS[0])
    assert sorted(calls.count(body) for body in set(calls)) == sorted(kinds)


# Dense MLA ("full_attention"), a shared-indexer DSA layer, mHC and group routing in one model.
OTHER_LAYER_KINDS = dict(
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "full_attention"],
    indexer_types=["full", "full", "shared", "full"],
    attn_res_block_size=0,
    hc_mult=2,
    n_group=2,
    topk_group=1,
)


def test_compiled_static_decode_other_layer_kinds():
    model = tiny_model(**OTHER_LAYER_KINDS)
    ids, mask = prompt(length=30)
    expected = greedy(model, ids, mask, 16)
    assert torch.equal(greedy(model, ids, mask, 16, cache_implementation="static"), expected)
    got = greedy(model, ids, mask, 16, cache_implementation="static", compile_config=compile_config())
    assert torch.equal(got, expected)
    assert len(CAPTURED_GRAPHS) == 1 and host_syncs(CAPTURED_GRAPHS) == []
    assert page_gathers(CAPTURED_GRAPHS) == []  # dense MLA and the indexer read their pools in place


@needs_kernel_build
@pytest.mark.usefixtures("kernels_at_this_thread_count")
@pytest.mark.parametrize("shape, batch", [("default", 2), ("default", 1), ("kpool", 3)])
def test_bf16_decode_steps_reach_the_cpu_kernels(monkeypatch, shape, batch):
    """A bf16 model with 8 attention and 8 indexer heads: each eager decode step's indexer and sparse attention call
    the hand-written CPU kernels (docs/dsa.md §11, §12), and so does the compiled static step, where each kernel is
    one op of the graph; both decode the same tokens. `kpool`: GLM-5.3-Flash's shape (below), whose k-pool indexer
    scores its pooled keys with the same kernel and whose shared-indexer layer reuses the selection. With a few
    sequences (up to 4) the linear products go through the row kernel too (§10), and the KDA recurrence through its
    kernel (docs/kda.md §9)."""
    overrides, (ids, mask) = (KPOOL_MODEL, kpool_prompt()) if shape == "kpool" else ({}, prompt(batch, length=30))
    model = tiny_model(index_n_heads=8, num_attention_heads=8, **overrides).to(torch.bfloat16)
    with monkeypatch.context() as spies:  # undone before the compiled step, which traces the ops themselves
        calls = [count_calls(spies, dsa_paged_cpu, name) for name in ("indexer_topk_decode", "sparse_mla_decode_cpu")]
        row_calls = count_calls(spies, cpu_row_linear, "row_linear")
        kda_calls = count_calls(spies, cpu_kda_recurrent, "kda_recurrent")
        expected = greedy(model, ids, mask, 8)
    # 7 decode steps (the first token comes from the prefill) x 2 DSA layers, of which the shared one has no indexer
    assert [len(c) for c in calls] == ([7, 14] if shape == "kpool" else [14, 14])
    assert batch <= cpu_row_linear.MAX_ROWS  # so every linear product of a step has few enough rows for the kernel
    assert len(row_calls) >= 7 * 10
    assert len(kda_calls) == 7 * (1 if shape == "kpool" else 2)  # 7 decode steps x the KDA layers (prefill: chunked)
    got = greedy(model, ids, mask, 8, cache_implementation="static", compile_config=compile_config())
    assert torch.equal(got, expected)
    nodes = [str(node.target) for node in all_nodes(CAPTURED_GRAPHS)]
    assert len(CAPTURED_GRAPHS) == 1
    counts = [sum(op in node for node in nodes) for op in ("indexer_topk_decode", "sparse_mla_decode")]
    # The default shape's two DSA layers run one region body (§8): one call of each op. The k-pool shape's two bodies
    # differ (the shared-indexer layer has no indexer) and each is inlined where it is called once, so its ops are
    # counted in the step's graph and in the bodies dynamo keeps: only their presence is checked there.
    assert counts == [1, 1] if shape == "default" else min(counts) >= 1
    assert any("row_linear" in node for node in nodes) and any("kda_recurrent" in node for node in nodes)


# GLM-5.3-Flash's shape: NoPE, the k-pool indexer (kp = 4, 2 pools + the tail of 3 per query), a shared-indexer layer
# after a full one, a dense MLA layer.
KPOOL_MODEL = dict(
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "full_attention"],
    indexer_types=["full", "full", "shared", "full"],
    qk_rope_head_dim=0,
    index_kpool=4,
    index_topk=8,
)


def kpool_prompt(length: int = 26, pads: tuple[int, ...] = (0, 3, 6)):
    """Left padding 0, 3, 6: three sequences whose pools start at different phases (docs/dsa.md §9)."""
    ids = torch.randint(3, 128, (len(pads), length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def test_static_kpool_fixed_shape_path_equals_the_paged_cache(monkeypatch):
    """The fixed-shape k-pool path of a compiled step (pool writes, `static_kpool_indexer_topk`), run eagerly by
    patching `_compiling`, against the eager paged KDSACache: a 26-token prefill and 14 decode steps over three pool
    phases; every k-pool selection equal as a set, the logits within fp32 summation order."""
    model = tiny_model(**KPOOL_MODEL)
    ids, mask = kpool_prompt()
    steps = torch.randint(3, 128, (3, 14), generator=torch.Generator().manual_seed(2))
    selections = {KDSAPagedKPoolLayer: [], StaticKPoolLayer: []}

    def recording(kernels, store, *args, _select=dsa.paged_kpool_indexer_topk):
        selections[type(store)].append(_select(kernels, store, *args))
        return selections[type(store)][-1]

    monkeypatch.setattr(dsa, "paged_kpool_indexer_topk", recording)  # the layer's read of the store's pools

    def run(cache):
        with torch.no_grad():
            logits = [model(ids, attention_mask=mask, cache=cache).logits]
            step_mask = mask
            for t in range(steps.shape[1]):
                step_mask = torch.cat([step_mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
                logits.append(model(steps[:, t : t + 1], attention_mask=step_mask, cache=cache).logits)
        return torch.cat(logits, dim=1)

    expected = run(KDSACache(model.config))
    monkeypatch.setattr(static_cache, "_compiling", lambda: True)
    got = run(KDSAStaticCache(model.config, max_cache_len=48))
    assert len(selections[StaticKPoolLayer]) == len(selections[KDSAPagedKPoolLayer]) == 15
    for fixed, paged in zip(selections[StaticKPoolLayer], selections[KDSAPagedKPoolLayer], strict=True):
        as_sets = [{i for i in row if i >= 0} for row in fixed.flatten(0, 1).tolist()]
        assert as_sets == [{i for i in row if i >= 0} for row in paged.flatten(0, 1).tolist()]
    valid = torch.cat([mask, torch.ones_like(steps)], dim=1)[..., None].bool()
    torch.testing.assert_close(got * valid, expected * valid, atol=2e-5, rtol=1e-5)


def test_static_kpool_cache_refuses_masks_that_move_the_pools():
    """Pools start at the first real token: eagerly, a mask that is not left padding, or that moves the first real
    token after pools were stored, is refused (docs/dsa.md §9)."""
    model = tiny_model(**KPOOL_MODEL)
    ids, mask = kpool_prompt(length=12)
    cache = KDSAStaticCache(model.config, max_cache_len=16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="left padding"):
            model(ids, attention_mask=mask.flip(1), cache=cache)
        cache.reset()
        model(ids, attention_mask=mask, cache=cache)
        with pytest.raises(ValueError, match="same left padding"):
            model(ids[:, :1], attention_mask=torch.ones(3, 13, dtype=mask.dtype), cache=cache)


def test_compiled_static_decode_with_kpool_indexer():
    """GLM-shaped model: generate() compiles the decode step with the k-pool indexer and a shared-indexer layer
    (fullgraph, no host sync, one graph while 24 steps cross six pool boundaries); eager paged decoding's tokens and
    logits."""
    model = tiny_model(**KPOOL_MODEL)
    ids, mask = kpool_prompt(length=30)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    expected = greedy(model, ids, mask, 24, **kwargs)
    got = greedy(model, ids, mask, 24, cache_implementation="static", compile_config=compile_config(), **kwargs)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=2e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(CAPTURED_GRAPHS) == 1 and host_syncs(CAPTURED_GRAPHS) == []
    assert page_gathers(CAPTURED_GRAPHS) == []  # the pooled keys are read in place


@pytest.mark.slow
def test_compiled_static_kpool_decode_inductor():
    """The GLM-shaped model under inductor: 64 compiled steps (16 pool boundaries) give eager's tokens, one graph."""
    model = tiny_model(**KPOOL_MODEL)
    ids, mask = kpool_prompt(length=30)
    expected = greedy(model, ids, mask, 64)
    got = greedy(model, ids, mask, 64, cache_implementation="static", compile_config=compile_config(backend="inductor"))
    assert torch.equal(got, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_compiled_static_decode_inductor_256_steps():
    """Inductor, batch 1 (every product a single row, so every linear layer takes the fused multiply-and-sum form):
    256 compiled steps (tokens exactly eager's), then a second generate() without a recompile. Batches of several
    rows run under inductor in the k-pool test above."""
    model = tiny_model()
    ids, mask = prompt(batch=1, length=30, padded=0)
    expected = greedy(model, ids, mask, 256)
    config = compile_config(backend="inductor")
    got = greedy(model, ids, mask, 256, cache_implementation="static", compile_config=config)
    assert torch.equal(got, expected)
    again = greedy(model, ids, mask, 256, cache_implementation="static", compile_config=config)
    assert torch.equal(again, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------------------------------- torch.compile(model), paged


def _compiled_forward_matches_eager(backend: str, **config):
    model = tiny_model(**config)
    ids, mask = prompt(length=12, padded=3)
    with torch.no_grad():
        cache = KDSACache(model.config)
        expected = [model(ids, attention_mask=mask, cache=cache).logits]
        steps = [expected[0][:, -1:].argmax(-1)]
        for _ in range(2):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            expected.append(model(steps[-1], attention_mask=mask, cache=cache).logits)
            steps.append(expected[-1].argmax(-1))
        compiled = torch.compile(model, backend=backend)
        cache = KDSACache(model.config)
        mask = mask[:, :12]
        got = [compiled(ids, attention_mask=mask, cache=cache).logits]
        for step in steps[:2]:
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            got.append(compiled(step, attention_mask=mask, cache=cache).logits)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "residual", [dict(), dict(attn_res_block_size=0, hc_mult=2), KPOOL_MODEL], ids=["attn_res", "mhc", "kpool"]
)
def test_torch_compile_model_with_paged_cache_traces(residual):
    """`torch.compile(model)` forward (prefill, then decode steps) with the paged cache gives eager's logits."""
    _compiled_forward_matches_eager("eager", **residual)


@pytest.mark.parametrize("features", [{}, KPOOL_MODEL], ids=["dsa", "kpool"])
def test_paged_cache_graph_breaks_only_in_the_page_allocator(features):
    """The page allocator (host code) is the only graph break, and it runs before the layer loop (`reserve` from
    `begin_forward`): a break inside a decoder layer made the residual stream cross compiled frames, which crashed
    inductor (docs/graph-mode.md §1). The k-pool store writes its pools without a host read and checks the mask only
    eagerly."""
    model = tiny_model(**features)
    cache = KDSACache(model.config)
    ids, mask = prompt(length=12, padded=3)
    with torch.no_grad():
        for step in (ids, ids[:, :1]):
            if step is not ids:
                mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            explanation = torch._dynamo.explain(model)(step, attention_mask=mask, cache=cache)
            assert explanation.break_reasons
            layer_files = ("dsa.py", "kda.py", "moe.py", "attn_res.py", "hyper_connections.py")
            layer_files += tuple(f"dsa_paged_{kind}.py" for kind in ("common", "reference", "fused", "cpu", "static"))
            for reason in explanation.break_reasons:
                frames = [(frame.filename.rsplit("/", 1)[-1], frame.name) for frame in reason.user_stack]
                assert frames[-1] == ("cache.py", "_prepare_pages"), frames
                assert not any(name in ("_write", "append") or file in layer_files for file, name in frames), frames


@pytest.mark.slow
def test_torch_compile_model_with_paged_cache_inductor():
    """Inductor with default options: the residual stream no longer crosses compiled frames (it crashed with
    `NameError: name 's37' is not defined`)."""
    _compiled_forward_matches_eager("inductor")


def test_quantized_static_cache_eager_and_compiled():
    """FP8 latent tiles and MXFP8 indexer keys in the static pools: eager equals the paged cache bit for bit, the
    compiled step (one graph, no host sync) gives the same tokens."""
    model = tiny_model(index_head_dim=32, kv_lora_rank=128)
    model.config.quantization_config = KDSAQuantizationConfig()
    ids, mask = prompt(length=20)
    paged = greedy(model, ids, mask, 12, output_logits=True, return_dict_in_generate=True)
    static = greedy(
        model, ids, mask, 12, output_logits=True, return_dict_in_generate=True, cache_implementation="static"
    )
    assert torch.equal(paged.sequences, static.sequences)
    assert all(torch.equal(a, b) for a, b in zip(paged.logits, static.logits, strict=True))
    compiled = greedy(model, ids, mask, 12, cache_implementation="static", compile_config=compile_config())
    assert torch.equal(compiled, paged.sequences)
    assert len(CAPTURED_GRAPHS) == 1 and host_syncs(CAPTURED_GRAPHS) == []
    assert page_gathers(CAPTURED_GRAPHS) == []  # quantized pools are dequantized whole, not gathered first
