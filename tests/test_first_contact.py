"""What a new user meets first: clear errors for bad input (a ValueError naming the argument and the limit, raised
before any state changes) and transformers' conventions where a user expects them (positions beyond
max_position_embeddings, hidden states, return_dict, left-padding tokenizer, the quantization example of
docs/quantization.md)."""

import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from modeling_kdsa import KDSACache, KDSAForCausalLM

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "kdsa-tiny"


def ids(batch=1, length=12, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------- bad input


def test_empty_input_is_a_clear_error(model):
    with pytest.raises(ValueError, match="no tokens"):
        model(torch.zeros(1, 0, dtype=torch.long))


def test_used_cache_with_a_new_prompt_is_a_clear_error(model):
    """generate() feeds only the tokens after the cached ones: a prompt no longer than the cache leaves none. The
    error names the cache, and the cache is unchanged."""
    cache = KDSACache(model.config)
    model(ids(length=12), cache=cache)
    with pytest.raises(ValueError, match="cache already holds 12 tokens and the prompt has 8"):
        model.generate(ids(length=8, seed=1), cache=cache, max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == 12


@pytest.mark.parametrize("bad", [128, 10_000, -1])
def test_out_of_vocabulary_ids_name_vocab_size(model, bad):
    tokens = ids()
    tokens[0, 5] = bad
    cache = KDSACache(model.config)
    with pytest.raises(ValueError, match=r"vocab_size=128"):
        model(tokens, cache=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("mask_length", [10, 14])
def test_generate_with_a_mask_of_the_wrong_length_is_a_clear_error(model, mask_length):
    with pytest.raises(ValueError, match=f"attention_mask has {mask_length} positions but the input has 12 tokens"):
        model.generate(ids(), attention_mask=torch.ones(1, mask_length, dtype=torch.long), max_new_tokens=2)


def test_generate_with_new_tokens_only_and_the_full_mask(model):
    """transformers' convention for a used cache: pass only the new tokens with the mask of the whole sequence."""
    prompt = ids(length=12)
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    cache = KDSACache(model.config)
    model(prompt[:, :9], cache=cache)
    out = model.generate(
        prompt[:, 9:], attention_mask=torch.ones(1, 12, dtype=torch.long), cache=cache, max_new_tokens=4,
        do_sample=False,
    )  # fmt: skip
    assert torch.equal(out[:, -4:], expected[:, -4:])


def test_transformers_tp_plan_in_one_process_loads_the_whole_model(monkeypatch):
    """`tp_plan="auto"` without a launcher is tp = 1 (transformers derives tp from WORLD_SIZE): the whole model, equal
    to a plain load. Sharded loading under torchrun is tests/test_distributed_loading.py (docs/parallel.md §10). No
    pipeline plan is declared (docs/parallel.md §6)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto")
    plain = KDSAForCausalLM.from_pretrained(CHECKPOINT)
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in plain.state_dict().items())
    assert model.model.layers[0].linear_attn.num_heads == model.config.linear_num_heads
    assert KDSAForCausalLM.config_class.base_model_pp_plan is None and KDSAForCausalLM._pp_plan is None


def test_continuous_batching_is_a_clear_error(model):
    """transformers' manager would fail on `Invalid layer type: linear_attention` (docs/design.md §11)."""
    with pytest.raises(ValueError, match="continuous batching .* is not supported: .* recurrent state"):
        model.generate_batch(inputs=[[5, 6, 7]])


def test_output_attentions_is_refused(model):
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids(), output_attentions=True)


# ------------------------------------------------------------------------------------ transformers conventions


def test_generation_beyond_max_position_embeddings_warns_and_keeps_every_token():
    """As in transformers (MaxLengthCriteria only warns), the limit is the trained length, not a hard one: RoPE
    extends. A model with max_position_embeddings=16 generates past it exactly as the same weights with 512 do."""
    short = tiny_model(max_position_embeddings=16)
    long = tiny_model(max_position_embeddings=512)
    long.load_state_dict(short.state_dict())
    prompt = ids(length=12)
    out = short.generate(prompt, max_new_tokens=10, do_sample=False)
    assert out.shape == (1, 22)
    assert torch.equal(out, long.generate(prompt, max_new_tokens=10, do_sample=False))
    assert torch.equal(short(ids(length=40)).logits, long(ids(length=40)).logits)


@pytest.mark.parametrize("attn_res_block_size", [0, 2])
def test_hidden_states_follow_transformers(attn_res_block_size):
    """num_hidden_layers + 1 tensors: the embeddings, each later layer's input, the final normed output."""
    model = tiny_model(attn_res_block_size=attn_res_block_size)
    tokens = ids()
    out = model(tokens, output_hidden_states=True)
    hidden = out.hidden_states
    assert len(hidden) == model.config.num_hidden_layers + 1
    assert torch.equal(hidden[0], model.model.embed_tokens(tokens))
    assert torch.equal(hidden[-1], model.model(tokens).last_hidden_state)
    assert torch.equal(out.logits, model.lm_head(hidden[-1]))
    assert all(h.shape == (1, 12, model.config.hidden_size) for h in hidden)
    assert model(tokens).hidden_states is None


def test_generate_returns_hidden_states_and_return_dict_false_gives_a_tuple(model):
    result = model.generate(
        ids(), max_new_tokens=3, do_sample=False, output_hidden_states=True, return_dict_in_generate=True
    )
    assert len(result.hidden_states) == 3 and len(result.hidden_states[0]) == model.config.num_hidden_layers + 1
    as_tuple = model(ids(), return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], model(ids()).logits)


def test_package_exports_the_cache():
    import modeling_kdsa

    assert modeling_kdsa.KDSACache is KDSACache and "KDSACache" in modeling_kdsa.__all__


# ------------------------------------------------------------------------------------------ shipped checkpoint


def shipped():
    if not (CHECKPOINT / "config.json").exists():
        pytest.skip("checkpoints/kdsa-tiny is not in this checkout")
    from transformers import AutoTokenizer

    return KDSAForCausalLM.from_pretrained(CHECKPOINT).eval(), AutoTokenizer.from_pretrained(CHECKPOINT)


def test_shipped_tokenizer_pads_left_and_batched_generate_equals_each_prompt_alone():
    model, tokenizer = shipped()
    assert tokenizer.padding_side == "left"
    prompts = ["pairs k5 v12 k90 v3 k7 v9 ? k90", "pairs k1 v5 ? k1"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    together = model.generate(**batch, max_new_tokens=3, do_sample=False)
    for row, text in enumerate(prompts):
        alone = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=3, do_sample=False)
        assert torch.equal(together[row, -3:], alone[0, -3:])


PROMPT = "pairs k5 v12 k90 v3 k7 v9 ? k90"


def greedy(model, tokenizer, prompts, new_tokens=6, stop_strings=None):
    """The new tokens of greedy generation; `stop_strings` passes the tokenizer too, as transformers requires."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    stops = {} if stop_strings is None else {"stop_strings": stop_strings, "tokenizer": tokenizer}
    return model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, **stops)[:, batch.input_ids.shape[1] :]


def test_shipped_tokenizer_decodes_words_with_their_leading_space():
    """A continuation decodes as it reads after the prompt; decoding ignores nothing the encoder needs."""
    _, tokenizer = shipped()
    ids = tokenizer(PROMPT).input_ids
    assert tokenizer.decode(ids[-2:]) == " ? k90"
    assert tokenizer(tokenizer.decode(ids)).input_ids == ids


def test_stop_strings_stop_generation_at_the_string():
    """transformers' StopStringCriteria alone fails on the word-level vocabulary ("substring not found"); the model
    builds it with a probe word the vocabulary spells, and generation stops at the token that completes the string."""
    model, tokenizer = shipped()
    free = greedy(model, tokenizer, [PROMPT])[0]
    words = tokenizer.convert_ids_to_tokens(free)
    assert len(set(words[:4])) > 1  # else the stops below could not be told apart
    for stop_at in range(len(words)):
        stop = words[stop_at]
        if stop in words[:stop_at]:
            continue
        for stop_string in [stop, " ".join(words[max(stop_at - 1, 0) : stop_at + 1])]:
            stopped = greedy(model, tokenizer, [PROMPT], stop_strings=[stop_string])[0]
            assert torch.equal(stopped, free[: stop_at + 1]), (stop_string, words)


def test_stop_strings_criterion_matches_the_decoded_text():
    """The criterion fires exactly when the decoded text has the stop string ending inside the last token, the
    contract of transformers' StopStringCriteria, on random sequences (special tokens included)."""
    from modeling_kdsa.stop_strings import VocabularyProbeStopStringCriteria, stop_string_probe

    _, tokenizer = shipped()
    probe = stop_string_probe(tokenizer)
    assert probe == "pairs"
    stops = ["v9", "k1 v2", "9", "? k", "[EOS]", "v12 ?"]
    criterion = VocabularyProbeStopStringCriteria(tokenizer, stops, probe)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tokenizer), (4000, 5), generator=generator)
    ids[::3, -2:] = torch.tensor(tokenizer.convert_tokens_to_ids(["k1", "v2"]))
    ids[1::3, -1] = tokenizer.convert_tokens_to_ids("v9")
    fired = criterion(ids, None)
    for row, hit in zip(ids.tolist(), fired.tolist(), strict=True):
        text, last = tokenizer.decode(row), tokenizer.decode(row[-1:])
        ends = range(len(text) - len(last) + 1, len(text) + 1)
        assert hit == any(text[:end].endswith(stop) for stop in stops for end in ends), row
    assert fired.any() and not fired.all()


def test_batched_left_padded_generate_with_stop_strings_equals_each_prompt_alone():
    model, tokenizer = shipped()
    prompts = [PROMPT, "pairs k1 v5 ? k1"]
    stop = tokenizer.convert_ids_to_tokens(greedy(model, tokenizer, [prompts[1]])[0])[1]
    together = greedy(model, tokenizer, prompts, stop_strings=[stop])
    for row, text in enumerate(prompts):
        alone = greedy(model, tokenizer, [text], stop_strings=[stop])[0]
        assert torch.equal(together[row, : len(alone)], alone)
        assert (together[row, len(alone) :] == tokenizer.pad_token_id).all()
    assert together.shape[1] > min(len(greedy(model, tokenizer, [t], stop_strings=[stop])[0]) for t in prompts)


def test_pipeline_output_is_spaced_text_that_round_trips():
    from transformers import pipeline

    model, tokenizer = shipped()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    new = greedy(model, tokenizer, [PROMPT], new_tokens=4)[0]
    full = generator(PROMPT, max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert full == PROMPT + " " + " ".join(tokenizer.convert_ids_to_tokens(new))
    assert tokenizer(full).input_ids == tokenizer(PROMPT).input_ids + new.tolist()
    continuation = generator(PROMPT, max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert PROMPT + continuation == full
    first = tokenizer.convert_ids_to_tokens(new[:1])[0]
    stopped = generator(PROMPT, max_new_tokens=4, do_sample=False, stop_strings=[first], tokenizer=tokenizer)
    assert stopped[0]["generated_text"] == PROMPT + " " + first


def test_docs_quantization_example_runs_on_the_shipped_checkpoint(tmp_path):
    """The quantization block of docs/quantization.md §4, executed as written with `path` = the shipped checkpoint."""
    shipped()
    doc = (ROOT / "docs" / "quantization.md").read_text()
    section = doc[doc.index("## §4 The `kdsa` quantization method") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    from transformers import AutoModelForCausalLM

    namespace = {"AutoModelForCausalLM": AutoModelForCausalLM, "path": CHECKPOINT, "out": tmp_path / "quantized"}
    exec(code, namespace)
    config = namespace["model"].config.quantization_config
    assert config.kv_cache == "fp8" and config.indexer == "mxfp8"
    assert (tmp_path / "quantized" / "config.json").exists()


def test_fp32_strict_modules_are_fp32_under_a_half_default_dtype():
    """`_keep_in_fp32_modules_strict` is applied by from_pretrained; a model built under a bf16 default dtype (as
    transformers' own tests and `from_config(dtype=...)` do) must create those parameters in fp32 too."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = tiny_model()
    finally:
        torch.set_default_dtype(previous)
    strict = model._keep_in_fp32_modules_strict
    matched = {name: p.dtype for name, p in model.named_parameters() if any(key in name for key in strict)}
    assert len(matched) > 10 and set(matched.values()) == {torch.float32}, matched
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    model(ids())  # runs with mixed dtypes


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(), {"attention_res", "mlp_res", "output_attn_res"}),
        (dict(attn_res_block_size=0), set()),
        (dict(attn_res_block_size=0, hc_mult=4), {"attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale"}),
    ],
    ids=["attn_res", "plain", "mhc"],
)
def test_fp32_strict_entries_each_name_a_parameter_of_the_model(overrides, expected):
    """transformers' convention (its common model tests check it): every `_keep_in_fp32_modules_strict` entry names
    a module of the built model; the stream-specific entries appear exactly with their stream."""
    base = {"A_log", "dt_bias", "indexer.weights_proj", "mlp.gate.weight", "e_score_correction_bias"}
    for model in (tiny_model(**overrides), tiny_model(**overrides).model):
        names = [name for name, _ in model.state_dict().items()]
        strict = model._keep_in_fp32_modules_strict
        assert strict == base | expected
        for entry in strict:
            assert any(re.search(rf"(?:^|\.){re.escape(entry)}(?:\.|$)", name) for name in names), entry


@pytest.mark.parametrize(
    "rope_parameters",
    [
        dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
        dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=16),
    ],
    ids=["linear", "yarn"],
)
def test_rope_scaled_configs_run_past_max_position_embeddings(rope_parameters):
    """What RoPE scaling is for: inputs longer than max_position_embeddings, prefill + decode == one forward."""
    model = tiny_model(rope_parameters=rope_parameters, max_position_embeddings=16)
    tokens = ids(length=40)
    full = model(tokens).logits
    cache = KDSACache(model.config)
    steps = [model(tokens[:, :30], cache=cache).logits]
    steps += [model(tokens[:, t : t + 1], cache=cache).logits for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
