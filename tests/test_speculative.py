"""Speculative decoding: exact KDSACache rollback (KDA replay, DSA page truncation) and transformers' assisted
generation / prompt lookup returning exactly the tokens of plain greedy decoding (docs/design.md §5).

All fp32. Where two computations run the same kernel on the same inputs the test asks for bitwise equality; where
they feed a kernel through different paths (chunked draft verification vs one-token steps) the tolerance is
stated with the measured error.
"""

import copy

import pytest
import torch
from conftest import tiny_config, tiny_model

from modeling_kdsa.cache import ROLLBACK_TOKENS, KDAReplayLayer, KDAReplayRecord, KDSACache, KDSAPagedLayer
from modeling_kdsa.kernels import kernel_set

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


pytestmark = pytest.mark.usefixtures("one_thread")


def rollback_cache(config, rollback_tokens=ROLLBACK_TOKENS) -> KDSACache:
    """A cache that keeps KDA replay records, as generate() builds it for speculative decoding."""
    return KDSACache(config, rollback_tokens=rollback_tokens)


def one_kda_layer_cache(model) -> KDSACache:
    """A cache for the model's first layer (KDA) alone."""
    return rollback_cache(tiny_config(num_hidden_layers=1, layer_types=["linear_attention"]))


def run_layer(layer, x, cache):
    """One forward of a single KDA layer on a model cache, counting the tokens as the model does."""
    cache.begin_forward(x.shape[1])
    return layer(x, cache=cache)


def ids(batch, length, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def repetitive(length, period=11, seed=0):
    """A prompt that repeats a random phrase: prompt lookup finds long matches in it."""
    phrase = ids(1, period, seed)
    return phrase.repeat(1, -(-length // period))[:, :length]


# ------------------------------------------------------------------------------------------- KDA layer replay


@torch.no_grad()
def test_replay_equals_stepping_and_per_step_state_copies():
    """A KDA layer verifies an 8-token draft in one chunked forward; `crop` to every accepted length n = 0..8 then
    replays n recorded steps from the checkpoint. Compared with
    (a) stepping the decode kernel one call per token over the same recorded inputs, keeping a state copy per step
        (vLLM/SGLang's snapshot design) — bitwise equal (n = 8 keeps the chunked verify state: atol 1e-6);
    (b) the layer itself stepping the accepted tokens one forward at a time (different projection/conv rounding)
        — fp32, atol 1e-6 (measured 2e-8);
    and the conv window is exactly the last W pre-conv columns."""
    model = tiny_model()
    layer = model.model.layers[0].linear_attn
    x = torch.randn(2, 18, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    base = one_kda_layer_cache(model)
    run_layer(layer, x[:, :10], base)
    base.crop(0)  # commit the prompt: the checkpoint is now after 10 tokens
    run_layer(layer, x[:, 10:], base)  # the draft: T = 8 with a previous state, the chunked path
    kda = base.layers[0]
    assert kda.checkpoint_tokens == 10 and kda.pending_tokens == 8
    recorded = KDAReplayRecord.concat(kda.records)
    conv0, state0 = kda.checkpoint

    copies = [state0]
    decode_kernel = kernel_set(model.config.kernel_backend, x.device).kda_recurrent  # the one the layer decodes with
    for t in range(8):
        step = recorded.tokens(t, t + 1)
        _, state = decode_kernel(step.k, step.k, step.v, step.g, step.beta, initial_state=copies[-1],
                                 output_final_state=True)  # fmt: skip
        copies.append(state)

    stepped_cache = one_kda_layer_cache(model)
    run_layer(layer, x[:, :10], stepped_cache)
    stepped = [stepped_cache.get_recurrent_state(0).clone()]
    for t in range(10, 18):
        run_layer(layer, x[:, t : t + 1], stepped_cache)
        stepped.append(stepped_cache.get_recurrent_state(0).clone())

    width = model.config.linear_conv_kernel_dim
    for accepted in range(9):
        cache = copy.deepcopy(base)
        cache.crop(10 + accepted)
        state = cache.get_recurrent_state(0)
        if accepted < 8:
            assert torch.equal(state, copies[accepted])
        else:  # all accepted: nothing to replay, the verify forward's own (chunked-kernel) state is kept
            torch.testing.assert_close(state, copies[accepted], atol=1e-6, rtol=0)  # measured 7e-9
        torch.testing.assert_close(state, stepped[accepted], atol=1e-6, rtol=0)
        window = torch.cat([conv0, recorded.conv_inputs[..., :accepted]], dim=-1)[..., -width:]
        assert torch.equal(cache.get_conv_state(0), window)
        assert cache.layers[0].checkpoint_tokens == 10 + accepted and not cache.layers[0].records


@torch.no_grad()
def test_reorder_keeps_records_with_their_sequence():
    """Beam reordering moves checkpoints and records with their rows: swapping the two sequences, then cropping,
    gives each row the state it had before the swap."""
    model = tiny_model()
    layer = model.model.layers[0].linear_attn
    x = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cache = one_kda_layer_cache(model)
    run_layer(layer, x[:, :6], cache)
    cache.crop(0)
    run_layer(layer, x[:, 6:], cache)
    expected = copy.deepcopy(cache)
    expected.crop(9)
    cache.layers[0].reorder_cache(torch.tensor([1, 0]))
    cache.crop(9)
    assert torch.equal(cache.get_recurrent_state(0), expected.get_recurrent_state(0).flip(0))
    assert torch.equal(cache.get_conv_state(0), expected.get_conv_state(0).flip(0))


# --------------------------------------------------------------------------------------- whole-model rollback


@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [63, 64, 65])
def test_crop_at_every_draft_position_equals_never_having_drafted(prompt_len):
    """Prefill, verify a 6-token draft in one forward, crop to each accepted count 0..6 (DSA pages crossing the
    64-token page boundary, KDA replay), then decode the next token: its logits equal those of a cache that only ever
    saw the accepted tokens, stepped one at a time. fp32; chunked vs one-token paths differ by rounding (atol 1e-5,
    measured ~1e-6)."""
    model = tiny_model()
    tokens = ids(1, prompt_len + 7, seed=prompt_len)
    base = rollback_cache(model.config)
    model(tokens[:, :prompt_len], cache=base)
    base.crop(0)
    model(tokens[:, prompt_len : prompt_len + 6], cache=base)
    reference = rollback_cache(model.config)
    model(tokens[:, :prompt_len], cache=reference)
    for accepted in range(7):
        cache = copy.deepcopy(base)
        cache.crop(prompt_len + accepted)
        assert cache.get_seq_length() == prompt_len + accepted
        assert all(layer.num_tokens == prompt_len + accepted for layer in cache.layers)
        nxt = tokens[:, prompt_len + accepted : prompt_len + accepted + 1]
        got = model(nxt, cache=cache).logits
        want = model(nxt, cache=copy.deepcopy(reference)).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        model(nxt, cache=reference)  # the reference accepts this token, stepped alone


@torch.no_grad()
def test_long_forward_folds_into_the_checkpoint_and_the_window_is_bounded():
    """rollback_tokens=16: a 40-token prefill folds its first 24 steps into the checkpoint with the chunked kernel
    and records the last 16; crop can go back 16 tokens, not 17. Continuing after crop(-10) matches a cache that
    saw only the first 30 tokens (fp32, atol 1e-5). A later forward that would exceed the window commits first."""
    model = tiny_model()
    tokens = ids(1, 60, seed=7)
    cache = rollback_cache(model.config, rollback_tokens=16)
    model(tokens[:, :40], cache=cache)
    kda = [layer for layer in cache.layers if isinstance(layer, KDAReplayLayer)]
    assert all(layer.checkpoint_tokens == 24 and layer.pending_tokens == 16 for layer in kda)
    with pytest.raises(ValueError, match="checkpoint is at 24 tokens"):
        cache.crop(23)
    cache.crop(-10)
    got = model(tokens[:, 30:35], cache=cache).logits
    fresh = rollback_cache(model.config, rollback_tokens=16)
    model(tokens[:, :30], cache=fresh)
    want = model(tokens[:, 30:35], cache=fresh).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    # 35 cached, checkpoint at 30 (the crop committed), 5 pending; 12 more would make 17 > 16: commit, then record.
    model(tokens[:, 35:47], cache=cache)
    assert all(layer.checkpoint_tokens == 35 and layer.pending_tokens == 12 for layer in kda)
    memory = cache.memory_bytes()
    assert memory["kda_rollback"] > 0 and memory["rollback_per_token"] > 0


@torch.no_grad()
def test_impossible_crops_raise_and_leave_the_cache_usable():
    model = tiny_model()
    tokens = ids(1, 30, seed=3)
    cache = rollback_cache(model.config)
    model(tokens[:, :20], cache=cache)
    cache.crop(-4)  # commits 16 tokens
    model(tokens[:, 16:22], cache=cache)  # 22 cached, checkpoint at 16
    with pytest.raises(ValueError, match="holding 22 tokens to 23"):
        cache.crop(23)
    with pytest.raises(ValueError, match="holding 22 tokens to -1"):
        cache.crop(-23)
    with pytest.raises(ValueError, match="checkpoint is at 16 tokens"):
        cache.crop(15)
    # Nothing changed: every layer still holds 22 tokens, and a crop inside the window still works.
    assert cache.get_seq_length() == 22
    assert all(layer.num_tokens == 22 for layer in cache.layers)
    cache.crop(18)
    got = model(tokens[:, 18:25], cache=cache).logits
    want = model(tokens[:, :25], use_cache=False).logits[:, 18:]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)  # fp32: chunked vs replayed summation order


# ------------------------------------------------------------------------------ transformers' generate()


@pytest.mark.parametrize("prompt_len", [63, 64, 65])
def test_prompt_lookup_equals_greedy_across_page_boundaries(prompt_len):
    model = tiny_model()
    prompt = repetitive(prompt_len, seed=prompt_len)
    kwargs = dict(max_new_tokens=40, min_new_tokens=40, **GREEDY)
    plain = model.generate(prompt, **kwargs)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=8, **kwargs)
    assert torch.equal(lookup, plain)


def test_assisted_generation_equals_greedy_with_a_rejecting_draft():
    """A random 2-layer KDSA draft disagrees with the target almost everywhere: rounds end with rejections at
    every draft position, and the result must still be plain greedy's, token for token."""
    model = tiny_model()
    draft = tiny_model(seed=1, num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"])
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0  # always draft the full length: more rejections
    prompt = repetitive(65, seed=5)
    kwargs = dict(max_new_tokens=48, min_new_tokens=48, **GREEDY)
    plain = model.generate(prompt, **kwargs)
    assisted = model.generate(prompt, assistant_model=draft, **kwargs)
    assert torch.equal(assisted, plain)


def test_long_speculative_generations_equal_greedy():
    """256 new tokens: prompt lookup, and an assistant with the target's own weights (every draft accepted, so the
    draft length grows 20, 22, ... and the pending records with it)."""
    model = tiny_model()
    prompt = repetitive(40, seed=9)
    kwargs = dict(max_new_tokens=256, min_new_tokens=256, **GREEDY)
    plain = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=10, **kwargs), plain)
    assert torch.equal(model.generate(prompt, assistant_model=tiny_model(), **kwargs), plain)


def test_generate_keeps_records_only_when_it_crops():
    model = tiny_model()
    prompt = repetitive(30)
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True, **GREEDY)
    plain = model.generate(prompt, **kwargs).cache
    assert not plain.is_croppable and plain.memory_bytes()["kda_rollback"] == 0
    lookup = model.generate(prompt, prompt_lookup_num_tokens=4, **kwargs).cache
    assert lookup.is_croppable
    # A cache passed without rollback records: transformers' own check refuses assisted decoding, clearly.
    with pytest.raises(ValueError, match="can be cropped"):
        model.generate(prompt, prompt_lookup_num_tokens=4, cache=KDSACache(model.config), **kwargs)
    assert all(isinstance(layer, KDAReplayLayer | KDSAPagedLayer) for layer in lookup.layers)
