"""The decode step as an AOTInductor package (aot/decode_step.py, docs/graph-mode.md §14): exported over a
`KDSAStaticCache` whose tensors it updates in place, it decodes exactly eager's tokens; it carries the C++ kernels as
`kdsa::` ops; loading checks that the package fits the model and cache, and each call checks its inputs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_compile_config, needs_kernel_build, tiny_model
from modeling_kdsa.aot import DecodeStepModule, compile_decode_step, export_decode_step, load_decode_step
from modeling_kdsa.aot import decode_step as aot_decode_step
from modeling_kdsa.quantization import KDSAQuantizationConfig

from modeling_kdsa import cpu_extension, kernels
from modeling_kdsa.cache import KDSACache
from modeling_kdsa.static_cache import KDSAStaticCache

NEW_TOKENS = 256


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """dynamo's per-code state (automatic dynamic shapes) must not carry from one test's model to the next test's
    compile: in torch 2.13 a step whose sizes dynamo then marks dynamic fails to reuse its compile regions (an internal
    KeyError; docs/graph-mode.md §8)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def prompt(batch: int, length: int = 30, padded: int = 5):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :padded] = 0
    return ids, mask


def allocated_cache(model, batch: int, capacity: int) -> KDSAStaticCache:
    """A static cache whose tensors exist (one eager token), emptied again."""
    cache = KDSAStaticCache(model.config, capacity)
    with torch.no_grad():
        model(torch.full((batch, 1), 5), cache=cache)
    cache.reset()
    return cache


def quantized_model():
    """An fp32 model whose MLA latent cache is FP8 (tiles of 128: a latent of 128), the indexer keys bf16."""
    model = tiny_model(index_head_dim=32, kv_lora_rank=128)
    model.config.quantization_config = KDSAQuantizationConfig(indexer="bf16")
    return model


@pytest.fixture(scope="module")
def fp32_package(tmp_path_factory):
    """fp32 model with an FP8 latent cache (`quantized_model`; the bf16 test below has plain pools) and no EOS (so
    every sequence runs all 256 steps), two sequences, one left-padded."""
    model = quantized_model()
    model.generation_config.eos_token_id = None
    ids, mask = prompt(batch=2)
    cache = allocated_cache(model, 2, ids.shape[1] + NEW_TOKENS)
    path = compile_decode_step(model, cache, tmp_path_factory.mktemp("aot") / "fp32.pt2")
    return model, cache, path


def cache_tensors(model, cache) -> list[torch.Tensor]:
    """The cache's tensors, as the exported module registers them."""
    return [tensor for name, tensor in DecodeStepModule(model, cache).named_buffers() if name.startswith("cache_")]


def counting_runner(step) -> list:
    """Count the package's runs: `step.runner` wrapped; returns the one-element counter."""
    calls, runner = [0], step.runner

    def run(*inputs):
        calls[0] += 1
        return runner(*inputs)

    step.runner = run
    return calls


def generate(model, ids, mask, cache=None, new_tokens=NEW_TOKENS, do_sample=False, **kwargs):
    """`model.generate`, greedy by default, over `cache` (reset first) or, with None, a new paged cache."""
    with torch.no_grad():
        if cache is not None:
            cache.reset()
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, cache=cache, do_sample=do_sample, **kwargs
        )


@pytest.mark.slow
def test_generate_with_the_package_decodes_eager_tokens(fp32_package):
    """`model.generate` over the package's cache runs every decode step through the package and gives exactly the
    tokens of the eager paged cache for 256 steps, two sequences, one left-padded: positions, the padding mask, page
    boundaries and the token counts all advance (a count folded into a constant at compile time would write every
    step to one slot)."""
    model, cache, path = fp32_package
    ids, mask = prompt(batch=2)
    expected = generate(model, ids, mask)
    step = load_decode_step(path, model, cache)
    assert cache.decode_step is step
    calls = counting_runner(step)
    # A compile config does not make generate() compile a step the package already serves (the backend would only
    # trace: dynamo's `eager`).
    got = generate(model, ids, mask, cache, compile_config=cpu_compile_config("eager"))
    assert got.shape == expected.shape == (2, ids.shape[1] + NEW_TOKENS)
    assert torch.equal(got, expected)
    assert calls[0] == NEW_TOKENS - 1  # every step after the prefill (the last token is not fed back)
    assert int(cache.get_seq_length()) == ids.shape[1] + NEW_TOKENS - 1  # the cache itself advanced, in place
    assert all(int(layer.num_tokens) == int(cache.get_seq_length()) for layer in cache.layers[1::2])


@pytest.mark.slow
def test_generate_with_the_package_samples_and_stops_at_eos_like_eager(fp32_package):
    """generate()'s other machinery around the package's logits: sampling (same seed, same tokens as eager) and EOS
    (a sequence that produces it is padded from then on and decoding stops once all have)."""
    model, cache, path = fp32_package
    ids, mask = prompt(batch=2)
    calls = counting_runner(load_decode_step(path, model, cache))
    sampled = []
    for target in (None, cache):
        torch.manual_seed(1)
        sampled.append(generate(model, ids, mask, target, new_tokens=32, do_sample=True, top_k=20))
    assert torch.equal(*sampled) and calls[0] == 31
    model.generation_config.eos_token_id = 2
    try:
        expected, got = generate(model, ids, mask), generate(model, ids, mask, cache)
    finally:
        model.generation_config.eos_token_id = None
    # Both sequences produce an EOS, at different steps: one is padded while the other goes on, and decoding stops
    # early (seed-dependent).
    first_eos = [row.tolist().index(2) for row in expected[:, ids.shape[1] :]]
    assert first_eos[0] != first_eos[1] and expected.shape[1] < ids.shape[1] + NEW_TOKENS
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_forwards_the_package_does_not_serve_run_eagerly(fp32_package):
    """Only a plain one-token step goes to the package: a prompt, hidden states, router logits or labels run the
    model's own forward (the cache then advances through it), and so does every step once `decode_step` is None."""
    model, cache, path = fp32_package
    step = load_decode_step(path, model, cache)
    calls = counting_runner(step)
    ids, mask = prompt(batch=2)
    token = torch.full((2, 1), 7)
    with torch.no_grad():
        cache.reset()
        model(ids, attention_mask=mask, cache=cache)
        model(token, cache=cache, output_hidden_states=True)
        model(token, cache=cache, output_router_logits=True)
        model(token, cache=cache, labels=token)
        assert calls[0] == 0 and int(cache.get_seq_length()) == ids.shape[1] + 3
        model(token, cache=cache)
        assert calls[0] == 1
        with pytest.raises(ValueError, match="loaded with another model's weights"):
            quantized_model()(token, cache=cache)  # same shapes, other weights: the package would use the first's
        cache.decode_step = None
        model(token, cache=cache)
        assert calls[0] == 1 and int(cache.get_seq_length()) == ids.shape[1] + 5
    # Traced by dynamo (generate()'s compiled step) or exported again, the forward is the model's, not the package's.
    step = load_decode_step(path, model, cache)
    calls = counting_runner(step)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(token, cache=cache)
    export_decode_step(model, cache)
    assert calls[0] == 0 and cache.decode_step is step
    cache.reset()


FRESH_PROCESS = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_aot_decode_step import allocated_cache, generate, prompt, quantized_model
from modeling_kdsa.aot import load_decode_step
torch.set_num_threads({threads})
model = quantized_model()
model.generation_config.eos_token_id = None
ids, mask = prompt(batch=2)
cache = allocated_cache(model, 2, {capacity})
load_decode_step({path!r}, model, cache)
print(json.dumps(generate(model, ids, mask, cache, new_tokens=8).tolist()))
"""


@pytest.mark.slow
def test_a_new_process_only_loads_the_package(fp32_package):
    """What a later run of a user's program does: build the model, load the package, generate. That process has not
    used every kernel the package calls (a first run used the KDA recurrence kernel while the package registered
    none of it: "Could not run 'kdsa::kda_recurrent' with arguments from the 'CPU' backend"); loading registers them."""
    model, cache, path = fp32_package
    ids, mask = prompt(batch=2)
    expected = generate(model, ids, mask, new_tokens=8)
    script = FRESH_PROCESS.format(
        tests=str(Path(__file__).parent), threads=torch.get_num_threads(), capacity=cache.max_cache_len, path=str(path)
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected.tolist()


def test_kernels_a_package_calls_are_registered_or_refused(monkeypatch):
    """Every `kdsa::` op this package defines has the function that registers it (a package calling an op missing
    from the kernel registry's `CPU_KERNEL_OPS` could not be loaded); an unknown op, or one whose kernel does not
    build, is refused."""
    defined = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("kdsa::")}
    assert defined == set(kernels.CPU_KERNEL_OPS)
    with pytest.raises(ValueError, match="kdsa::no_such_op, an op this version of modeling_kdsa does not define"):
        aot_decode_step.register_kernels(["no_such_op"])
    monkeypatch.setitem(kernels.CPU_KERNEL_OPS, "kda_recurrent", lambda: False)
    with pytest.raises(ValueError, match="kdsa::kda_recurrent, whose CPU kernel cannot be built or loaded"):
        aot_decode_step.register_kernels(["kda_recurrent"])


@pytest.mark.slow
def test_package_step_takes_strided_inputs(fp32_package):
    """A token column sliced out of a longer tensor (strided) gives the eager step's logits: the package itself would
    read it with the contiguous strides it was traced with."""
    model, cache, path = fp32_package
    step = load_decode_step(path, model, cache)
    ids, mask = prompt(batch=2)
    generated = generate(model, ids, mask, cache, new_tokens=3)
    eager_cache = KDSAStaticCache(model.config, cache.max_cache_len)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, cache=eager_cache)
        cache.reset()
        model(ids, attention_mask=mask, position_ids=positions, cache=cache)
        token, position = generated[:, ids.shape[1] : ids.shape[1] + 1], positions[:, -1:] + 1
        assert not token.is_contiguous()
        padded = torch.nn.functional.pad(mask, (0, cache.capacity - ids.shape[1]), value=1)
        eager = model(token, attention_mask=padded, position_ids=position, cache=eager_cache).logits
        torch.testing.assert_close(step(token, padded, position), eager, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_package_refuses_what_it_was_not_compiled_for(fp32_package):
    model, cache, path = fp32_package
    with pytest.raises(ValueError, match=f"compiled for capacity={cache.capacity}, the cache has capacity=448"):
        load_decode_step(path, model, allocated_cache(model, 2, 400))
    with pytest.raises(ValueError, match="compiled for batch_size=2, the cache has batch_size=1"):
        load_decode_step(path, model, allocated_cache(model, 1, cache.max_cache_len))
    other = quantized_model()
    other.model.layers[0].mlp.up_proj.weight.data = torch.zeros(64, 64)  # same cache, another model
    message = r"constant 'model\.model\.layers\.0\.mlp\.up_proj\.weight' is \[\[96, 64\], .* give \[\[64, 64\]"
    with pytest.raises(ValueError, match=message):
        load_decode_step(path, other, cache)
    with pytest.raises(ValueError, match="hold no tensors yet"):
        load_decode_step(path, model, KDSAStaticCache(model.config, cache.max_cache_len))
    stranger = torch._inductor.aoti_compile_and_package(
        torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),)),
        package_path=str(Path(path).parent / "linear.pt2"),
    )
    with pytest.raises(ValueError, match="is not a KDSA decode-step package"):
        load_decode_step(stranger, model, cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.warns(UserWarning, match=f"compiled with {threads} intra-op threads"):
            load_decode_step(path, model, cache)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_package_call_checks_its_inputs_and_the_capacity(fp32_package):
    model, cache, path = fp32_package
    step = load_decode_step(path, model, cache)
    ids, mask = prompt(batch=2)
    generate(model, ids, mask, cache, new_tokens=4)
    held = int(cache.get_seq_length())
    token = torch.full((2, 1), 7)
    bad_calls = {
        "input_ids of shape \\(2, 1\\), int64": lambda: step(torch.full((2, 2), 7)),
        "int64": lambda: step(token.int()),
        "position_ids of shape": lambda: step(token, position_ids=torch.zeros(2, dtype=torch.long)),
        f"padding mask of shape \\(2, {cache.capacity}\\)": lambda: step(token, torch.ones(2, 40, dtype=torch.long)),
    }
    for message, call in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            call()
    assert int(cache.get_seq_length()) == held  # nothing ran
    with pytest.raises(ValueError, match=f"needs {cache.max_cache_len + 1} cache slots"):
        generate(model, ids, mask, cache, new_tokens=NEW_TOKENS + 2)  # the last new token is not fed back
    assert int(cache.get_seq_length()) == 0  # refused before the prefill (the helper had reset the cache)
    cache.cumulative_length.fill_(cache.max_cache_len)  # as if full
    with pytest.raises(ValueError, match=f"capacity exceeded: {cache.max_cache_len} cached"):
        step(token)
    cache.reset()


def test_export_leaves_the_cache_as_it_was():
    """Exporting traces the model over the cache's own tensors (module buffers) and puts them back: the same tensors
    at the same addresses with the same contents, none of them a tracer's fake."""
    model = tiny_model()
    cache = allocated_cache(model, 1, 40)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 9)), cache=cache)
    before = [(t, t.clone()) for t in cache_tensors(model, cache)]
    program = export_decode_step(model, cache)
    after = cache_tensors(model, cache)
    assert [id(t) for t in after] == [id(t) for t, _ in before]
    assert all(type(t) is torch.Tensor and torch.equal(t, copy) for t, copy in before)
    # Every cache tensor a step writes is a buffer the program mutates (KDA states, pools, counts).
    mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert len(mutated) >= len(before) - 2  # all but the block tables, which a step only reads


def test_export_refuses_caches_it_cannot_carry(tmp_path):
    model = tiny_model()
    with pytest.raises(TypeError, match="over a KDSAStaticCache, got KDSACache"):
        export_decode_step(model, KDSACache(model.config))
    with pytest.raises(ValueError, match="hold no tensors yet: run one eager forward"):
        export_decode_step(model, KDSAStaticCache(model.config, 32))
    model = quantized_model()
    model.config.quantization_config = KDSAQuantizationConfig()  # MXFP8 indexer keys
    with pytest.raises(ValueError, match="MXFP8 indexer keys .* cannot compile"):
        compile_decode_step(model, allocated_cache(model, 1, 32), tmp_path / "never.pt2")
    assert not (tmp_path / "never.pt2").exists()


@needs_kernel_build
def test_export_carries_the_cpu_kernels_only_for_the_package():
    """A bf16 model with 8 attention and indexer heads: the exported step holds every C++ kernel of the decode step
    as a `kdsa::` op; a plain `torch.export` of the same model keeps the torch paths of the kernels that step aside
    under export (docs/graph-mode.md §7)."""
    model = tiny_model(index_n_heads=8, num_attention_heads=8).to(torch.bfloat16)
    cache = allocated_cache(model, 1, 40)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_extension, "MAX_THREADS", max(cpu_extension.MAX_THREADS, torch.get_num_threads()))
        program = export_decode_step(model, cache)
        plain = torch.export.export(model, (torch.zeros(1, 4, dtype=torch.long),), {"use_cache": False}, strict=False)
    ops = {str(node.target) for node in program.graph.nodes if "kdsa" in str(node.target)}
    assert {f"kdsa.{op}.default" for op in KERNEL_OPS} <= ops
    # The lm_head, outside the layers' compile regions, sees FakeTensor weights (`cpu_extension.plain_tensor`).
    weights = [node.args[1].name for node in program.graph.nodes if "row_linear" in str(node.target)]
    assert "p_model_lm_head_weight" in weights
    plain_ops = {str(node.target) for node in plain.graph.nodes}
    assert not any(op in target for op in ("row_linear", "kda_recurrent") for target in plain_ops)


KERNEL_OPS = ("row_linear", "head_linear", "head_matmul", "expert_linear", "kda_recurrent")


@needs_kernel_build
@pytest.mark.slow
def test_bf16_package_with_kernels_follows_the_compiled_step(tmp_path):
    """The bf16 package, whose products are the C++ kernels, against generate()'s compiled step (the same fixed-shape
    graph under inductor; docs/graph-mode.md §2): fed the same tokens for 24 steps, the logits agree within bf16
    rounding at all but at most two steps. (Against the eager step both differ alike, by up to ~0.5 at some steps:
    inductor keeps fp32 where the eager ops round to bf16, and an indexer selection of 8 keys can flip on a near tie.
    Such a flip can separate the package from the compiled step too for one step — 0.15 at one step of 24 on an
    AVX512F CPU without AVX512-BF16, where the kernels run their AVX2 builds and inductor vectorises with AVX512 —
    and the next steps agree again; a broken package differs at every step.)"""
    model = tiny_model(index_n_heads=8, num_attention_heads=8).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    ids, _ = prompt(batch=1, padded=0)
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(cpu_extension, "MAX_THREADS", max(cpu_extension.MAX_THREADS, torch.get_num_threads()))
        tokens = model.generate(ids, max_new_tokens=24, do_sample=False)[:, ids.shape[1] :]
        cache, compiled_cache = allocated_cache(model, 1, 64), KDSAStaticCache(model.config, 64)
        step = load_decode_step(compile_decode_step(model, cache, tmp_path / "bf16.pt2"), model, cache)
        compiled = model.get_compiled_call(cpu_compile_config("inductor"))
        model(ids, cache=cache)
        model(ids, cache=compiled_cache)
        differences = []
        for index in range(tokens.shape[1]):
            token = tokens[:, index : index + 1]
            expected = compiled(input_ids=token, cache=compiled_cache, use_cache=True).logits
            differences.append(float((step(token).float() - expected.float()).abs().max()))
    assert sum(d > 0.03 for d in differences) <= 2, differences
    assert sorted(differences)[len(differences) // 2] < 0.01, differences
