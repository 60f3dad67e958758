"""DSpark drafts (modeling_kdsa/dspark.py): checkpoint formats, refusals, the math against a transcription written
here with plain torch ops, the context cache, batching.

The `speculators` package cannot be installed beside this transformers (it pins an older one and pulls GPU wheels), so
the speculators and DeepSpec folders here are written from the documented field and tensor names
(`speculators/models/dspark/`, `speculators/models/dflash/core.py`; DeepSpec `deepspec/modeling/dspark/qwen3/`).
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from modeling_kdsa import DSparkConfig, DSparkDraftModel
from modeling_kdsa.dspark import expected_accepted_length, total_variation

ROOT = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN, TARGET_LAYERS = 61, 32, 4


class FakeTarget(nn.Module):
    """What bind_target reads of a target: config, input embeddings, lm_head."""

    def __init__(self, vocab=VOCAB, hidden=HIDDEN, layers=TARGET_LAYERS):
        super().__init__()
        self.config = DSparkConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=2, mask_token_id=0, target_layer_ids=[0])  # fmt: skip
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def make_config(**overrides) -> DSparkConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1000.0,
                  target_layer_ids=[0, 2], block_size=5, mask_token_id=VOCAB - 1, markov_rank=6,
                  markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True)  # fmt: skip
    fields.update(overrides)
    return DSparkConfig(**fields)


def make_draft(seed=0, **overrides) -> DSparkDraftModel:
    torch.manual_seed(seed)
    draft = DSparkDraftModel(make_config(**overrides)).eval()
    with torch.no_grad():  # norms away from 1 so that a missing norm shows
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param.dim() >= 1:
                param.normal_(0, 0.3)
    return draft


def hidden_tuple(batch, length, seed=1, layers=TARGET_LAYERS, hidden=HIDDEN):
    torch.manual_seed(seed)
    return tuple(torch.randn(batch, length, hidden) for _ in range(layers + 1))


def setup_context(draft, target, batch=1, length=7, seed=1):
    draft.bind_target(target)
    states = hidden_tuple(batch, length, seed)
    cache = draft.new_cache(batch)
    draft.extend_context(cache, states)
    return cache, states


# ------------------------------------------------------------------------------ independent transcription


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta, head_dim):
    """NeoX RoPE written out: pairs (x_i, x_{i+d/2}) rotated by positions·theta^(−2i/d)."""
    half = head_dim // 2
    freqs = positions[:, None].double() * theta ** (-torch.arange(half, dtype=torch.double) * 2 / head_dim)
    cos, sin = freqs.cos().float()[:, None], freqs.sin().float()[:, None]  # [T, 1, half]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_block(sd, cfg, context_rows, context_positions, block_embeds, block_positions):
    """One sequence: the DSpark backbone as a single plain attention per layer over the rows [context ; block]
    (`context_rows` [N, m·H] raw target features, `block_embeds` [γ, H]). Returns norm(h) [γ, H]."""
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = rms(context_rows @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    h = block_embeds
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(-1, heads, d)
        q = rotate(rms(q, sd[p + "self_attn.q_norm.weight"]), block_positions, cfg.rope_theta, d)
        rows = torch.cat([ctx, x])  # the same k_proj / v_proj on context and block rows
        k = (rows @ sd[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
        k = rotate(rms(k, sd[p + "self_attn.k_norm.weight"]), torch.cat([context_positions, block_positions]),
                   cfg.rope_theta, d)  # fmt: skip
        v = (rows @ sd[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
        out = []
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(d)  # every block row sees every row: no causal mask
            out.append(scores.softmax(-1) @ v[:, kv])
        h = h + torch.cat(out, dim=-1) @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"])


def reference_propose(draft, target, states, anchor, position):
    """Greedy proposal of one sequence from the transcription: Markov bias W1[x]·W2ᵀ (vanilla), confidence
    σ(w·[h ; W1[x]] + b), tokens through d2t for a reduced vocabulary."""
    cfg, sd = draft.config, {k: v.detach() for k, v in draft.state_dict().items()}
    features = torch.cat([states[i + 1][0] for i in cfg.target_layer_ids], dim=-1)
    n = features.shape[0]
    block = torch.tensor([anchor] + [cfg.mask_token_id] * (cfg.block_size - 1))
    embed = sd["embed_tokens.weight"] if cfg.owns_embeddings else target.embed.weight.detach()
    head = sd["lm_head.weight"] if "lm_head.weight" in sd else target.head.weight.detach()
    h = reference_block(sd, cfg, features, torch.arange(n), embed[block], position + torch.arange(cfg.block_size))
    tokens, logits_out, confidence, prev = [], [], [], anchor
    for k in range(cfg.block_size):
        w1 = sd["markov_head.markov_w1.weight"][prev]
        logits = h[k] @ head.T + w1 @ sd["markov_head.markov_w2.weight"].T
        draft_id = int(logits.argmax())
        token = draft_id + int(sd["d2t"][draft_id]) if "d2t" in sd else draft_id
        feats = torch.cat([h[k], w1])
        confidence.append(
            torch.sigmoid(feats @ sd["confidence_head.proj.weight"][0] + sd["confidence_head.proj.bias"][0])
        )
        tokens.append(token)
        logits_out.append(logits)
        prev = token
    return torch.tensor(tokens), torch.stack(logits_out), torch.stack(confidence)


# ------------------------------------------------------------------------------------------- the math


def test_propose_matches_transcription():
    draft, target = make_draft(), FakeTarget()
    cache, states = setup_context(draft, target, length=7)
    tokens, q_logits, confidence = draft.propose(cache, torch.tensor([5]), torch.tensor([7]))
    ref_tokens, ref_logits, ref_confidence = reference_propose(draft, target, states, 5, 7)
    assert tokens.shape == (1, 5) and q_logits.shape == (1, 5, VOCAB) and confidence.shape == (1, 5)
    torch.testing.assert_close(q_logits[0], ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens[0], ref_tokens)
    torch.testing.assert_close(confidence[0], ref_confidence, atol=1e-5, rtol=1e-5)


def test_reduced_vocabulary_maps_draft_ids_through_d2t():
    draft_vocab = 20
    draft, target = make_draft(draft_vocab_size=draft_vocab), FakeTarget()
    target_ids = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:draft_vocab]).values
    draft.d2t.copy_(target_ids - torch.arange(draft_vocab))
    draft.t2d.zero_()
    draft.t2d[target_ids] = True
    draft.check_vocabulary_mapping()
    cache, states = setup_context(draft, target)
    tokens, q_logits, _ = draft.propose(cache, torch.tensor([4]), torch.tensor([7]))
    ref_tokens, ref_logits, _ = reference_propose(draft, target, states, 4, 7)
    assert torch.equal(tokens[0], ref_tokens)
    assert torch.isin(tokens, target_ids).all()
    torch.testing.assert_close(q_logits[0][:, target_ids], ref_logits, atol=1e-4, rtol=1e-4)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[target_ids] = False
    assert torch.isneginf(q_logits[0][:, outside]).all()


def test_markov_variants_match_formulas():
    """gated: W2·(σ(G[h ; W1[x]] + g) ⊙ W1[x]); rnn: s' = σ(g)s + (1−σ(g))tanh(c), bias W2·tanh(o), s_0 = 0."""
    torch.manual_seed(0)
    h, prev = torch.randn(3, HIDDEN), torch.tensor([1, 7, 30])
    gated = make_draft(markov_head_type="gated").markov_head
    w1, w2 = gated.markov_w1.weight[prev], gated.markov_w2.weight
    gate = torch.sigmoid(torch.cat([h, w1], -1) @ gated.gate_proj.weight.T + gated.gate_proj.bias)
    bias, _, _ = gated.step(prev, h, None)
    torch.testing.assert_close(bias, (gate * w1) @ w2.T)

    rnn = make_draft(markov_head_type="rnn").markov_head
    w1, w2 = rnn.markov_w1.weight[prev], rnn.markov_w2.weight
    state = torch.randn(3, 6)
    z = torch.cat([state, w1, h], -1) @ rnn.joint_proj.weight.T + rnn.joint_proj.bias
    g, c, o = z[:, :6], z[:, 6:12], z[:, 12:]
    bias, new_state, _ = rnn.step(prev, h, state)
    torch.testing.assert_close(new_state, torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c))
    torch.testing.assert_close(bias, torch.tanh(o) @ w2.T)
    assert torch.equal(rnn.initial_state(h), torch.zeros(3, 6))


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_training_forward_equals_inference(head_type):
    """The teacher-forced training forward at anchor p, fed the tokens the inference loop drafted, gives the
    inference loop's logits and confidences (same context rows, same block, same Markov inputs)."""
    draft, target = make_draft(markov_head_type=head_type), FakeTarget()
    length, gamma = 9, draft.config.block_size
    states = hidden_tuple(1, length + 1 + gamma)
    draft.bind_target(target)
    cache = draft.new_cache(1)
    draft.extend_context(cache, [s[:, :length] for s in states])
    anchor = 11
    tokens, q_logits, confidence = draft.propose(cache, torch.tensor([anchor]), torch.tensor([length]))
    ids = torch.cat([torch.randint(0, VOCAB, (1, length)), torch.tensor([[anchor]]), tokens], dim=1)
    out = draft(ids, draft.context_features(states), torch.tensor([[length, 2]]))
    torch.testing.assert_close(out.logits[0, 0], q_logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.sigmoid(out.confidence_logits[0, 0]), confidence[0], atol=1e-5, rtol=1e-5)
    # the second block (anchor 2) sees only context rows 0, 1
    cache2 = draft.new_cache(1)
    draft.extend_context(cache2, [s[:, :2] for s in states])
    tokens2, _, _ = draft.propose(cache2, ids[:, 2], torch.tensor([2]))
    ids2 = ids.clone()
    ids2[0, 3 : 3 + gamma - 1] = tokens2[0, : gamma - 1]
    out2 = draft(ids2, draft.context_features(states), torch.tensor([[length, 2]]))
    assert torch.equal(out2.logits[0, 1, :].argmax(-1)[: gamma - 1], tokens2[0, : gamma - 1])


def test_sample_callback_and_analytic_tau():
    draft, target = make_draft(), FakeTarget()
    cache, _ = setup_context(draft, target)
    seen = []

    def sample(logits, k):
        seen.append((k, tuple(logits.shape)))
        processed = logits / 0.5
        return processed.argmin(-1), processed

    tokens, q_logits, _ = draft.propose(cache, torch.tensor([2]), torch.tensor([7]), sample)
    assert seen == [(k, (1, VOCAB)) for k in range(5)]
    # the Markov bias of slot k follows the token the callback returned at k − 1
    _, greedy_logits, _ = draft.propose(cache, torch.tensor([2]), torch.tensor([7]))
    torch.testing.assert_close(q_logits[0, 0], greedy_logits[0, 0] / 0.5)
    assert not torch.allclose(q_logits[0, 1], greedy_logits[0, 1] / 0.5)
    assert tokens[0, 0] == greedy_logits[0, 0].argmin()
    p, q = torch.randn(2, 3, VOCAB), torch.randn(2, 3, VOCAB)
    tv = total_variation(p, q)
    torch.testing.assert_close(tv, 0.5 * (p.softmax(-1) - q.softmax(-1)).abs().sum(-1))
    a = 1 - tv
    torch.testing.assert_close(expected_accepted_length(tv), 1 + a[..., 0] + a[..., 0] * a[..., 1] + a.prod(-1))


# ------------------------------------------------------------------------------------- cache and batches


def test_cache_crop():
    draft, target = make_draft(), FakeTarget()
    draft.bind_target(target)
    states = hidden_tuple(1, 10)
    cache = draft.new_cache(1)
    draft.extend_context(cache, [s[:, :6] for s in states])
    reference = draft.propose(cache, torch.tensor([3]), torch.tensor([6]))
    draft.extend_context(cache, [s[:, 6:] for s in states])
    assert cache.num_tokens == 10 and cache.keys[0].shape == (1, 2, 10, 8)
    assert not torch.equal(draft.propose(cache, torch.tensor([3]), torch.tensor([6]))[1], reference[1])
    cache.crop(6)
    assert cache.num_tokens == 6 and cache.positions.tolist() == [list(range(6))]
    for got, want in zip(draft.propose(cache, torch.tensor([3]), torch.tensor([6])), reference, strict=True):
        assert torch.equal(got, want)
    cache.crop(-2)
    assert cache.num_tokens == 4
    cache.crop(0)
    assert cache.num_tokens == 4
    with pytest.raises(ValueError, match="cannot crop a DSparkCache holding 4 rows to 5"):
        cache.crop(5)
    # the block's K/V are never kept
    draft.propose(cache, torch.tensor([3]), torch.tensor([4]))
    assert cache.num_tokens == 4


def test_batch_with_padded_context_rows_equals_each_row_alone():
    draft, target = make_draft(), FakeTarget()
    draft.bind_target(target)
    lengths, pad = [7, 4], 3
    singles = [hidden_tuple(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    garbage = hidden_tuple(1, pad, seed=99)
    batched = tuple(torch.cat([a, torch.cat([g, b], dim=1)]) for a, b, g in zip(*singles, garbage, strict=True))
    mask = torch.tensor([[1] * 7, [0] * pad + [1] * 4])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = draft.new_cache(2)
    # in two pieces, as a decode loop feeds it
    draft.extend_context(cache, [s[:, :5] for s in batched], mask[:, :5], positions[:, :5])
    draft.extend_context(cache, [s[:, 5:] for s in batched], mask[:, 5:])  # positions continue each row's count
    assert cache.positions.tolist() == positions.tolist()
    anchors, anchor_positions = torch.tensor([8, 9]), torch.tensor(lengths)
    tokens, q_logits, confidence = draft.propose(cache, anchors, anchor_positions)
    for row, states in enumerate(singles):
        alone = draft.new_cache(1)
        draft.extend_context(alone, states)
        got = draft.propose(alone, anchors[row : row + 1], anchor_positions[row : row + 1])
        assert torch.equal(tokens[row], got[0][0])
        torch.testing.assert_close(q_logits[row], got[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(confidence[row], got[2][0], atol=1e-6, rtol=1e-6)
    cache.select(torch.tensor([1]))
    torch.testing.assert_close(draft.propose(cache, anchors[1:], anchor_positions[1:])[1], q_logits[1:])


def test_context_uses_hidden_states_at_layer_id_plus_one():
    draft, target = make_draft(), FakeTarget()
    cache, states = setup_context(draft, target)
    reference = draft.propose(cache, torch.tensor([1]), torch.tensor([7]))
    changed = list(states)
    for index in (0, 2, 4):  # embeddings, layer 1's output, final normed: not ids 0, 2 (+1)
        changed[index] = torch.randn_like(states[index])
    other = draft.new_cache(1)
    draft.extend_context(other, changed)
    assert torch.equal(draft.propose(other, torch.tensor([1]), torch.tensor([7]))[1], reference[1])
    changed[3] = torch.randn_like(states[3])  # layer 2's output
    other = draft.new_cache(1)
    draft.extend_context(other, changed)
    assert not torch.equal(draft.propose(other, torch.tensor([1]), torch.tensor([7]))[1], reference[1])


def test_input_errors():
    draft, target = make_draft(), FakeTarget()
    unbound = make_draft()
    cache = unbound.new_cache(1)
    unbound.extend_context(cache, hidden_tuple(1, 3))
    with pytest.raises(ValueError, match="bind_target"):
        unbound.propose(cache, torch.tensor([1]), torch.tensor([3]))
    draft.bind_target(target)
    with pytest.raises(ValueError, match="has 4 entries; the bound target gives 5"):
        draft.extend_context(draft.new_cache(1), hidden_tuple(1, 3)[:4])
    with pytest.raises(ValueError, match="attention_mask_new"):
        draft.extend_context(draft.new_cache(1), hidden_tuple(1, 3), torch.ones(1, 4))
    with pytest.raises(ValueError, match="batch 1; the DSparkCache was made for 2"):
        draft.extend_context(draft.new_cache(2), hidden_tuple(1, 3))
    with pytest.raises(ValueError, match="propose needs a context"):
        draft.propose(draft.new_cache(1), torch.tensor([1]), torch.tensor([0]))


# ----------------------------------------------------------------------------------------------- formats


def test_speculators_round_trip(tmp_path):
    draft, target = make_draft(), FakeTarget()
    draft.save_pretrained(tmp_path, verifier_name_or_path="fake")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["sample_from_anchor"] is True
    assert raw["aux_hidden_state_layer_ids"] == [1, 3]  # target layer ids [0, 2] + 1
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 2
    assert raw["transformer_layer_config"]["vocab_size"] == VOCAB and raw["draft_vocab_size"] == VOCAB
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    names = set(load_file(tmp_path / "model.safetensors"))
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias",
            "layers.1.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= names  # fmt: skip
    loaded = DSparkDraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.config.target_layer_ids == [0, 2] and loaded.config.block_size == 5
    cache, _ = setup_context(draft, target)
    for got, want in zip(loaded.propose(cache, torch.tensor([2]), torch.tensor([7])),
                         draft.propose(cache, torch.tensor([2]), torch.tensor([7])), strict=True):  # fmt: skip
        assert torch.equal(got, want)
    half = DSparkDraftModel.from_pretrained(tmp_path, target=target, torch_dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.markov_head.markov_w1.weight.dtype == torch.bfloat16
    half_cache, _ = setup_context(half, target)  # fp32 target hidden states and embeddings, cast on the way in
    assert half_cache.keys[0].dtype == torch.bfloat16
    tokens, q_logits, _ = half.propose(half_cache, torch.tensor([2]), torch.tensor([7]))
    assert q_logits.dtype == torch.float32 and tokens.shape == (1, 5)


def test_reduced_vocabulary_round_trip(tmp_path):
    draft = make_draft(draft_vocab_size=10)
    draft.d2t.copy_(torch.arange(10) * 3)  # target ids 0, 4, 8, ...
    draft.t2d[torch.arange(10) * 4] = True
    draft.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"lm_head.weight", "d2t", "t2d"} <= names and "embed_tokens.weight" not in names
    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size == 10 and torch.equal(loaded.d2t, draft.d2t)
    assert loaded.lm_head.weight.shape == (10, HIDDEN) and loaded.markov_head.markov_w2.weight.shape == (10, 6)
    assert loaded.markov_head.markov_w1.weight.shape == (VOCAB, 6)


def write_deepspec(folder: Path, draft: DSparkDraftModel, target: FakeTarget, **config_overrides):
    """A DeepSpec folder written from its documented layout: the target's Qwen3 config plus the draft fields, the
    draft tensors plus embed_tokens and lm_head."""
    cfg = draft.config
    raw = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": 1e-6, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "layer_types": ["full_attention"] * cfg.num_hidden_layers, "tie_word_embeddings": False,
        "num_target_layers": TARGET_LAYERS, "target_layer_ids": cfg.target_layer_ids, "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id, "num_anchors": 512, "enable_confidence_head": True,
        "confidence_head_with_markov": True, "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
    }  # fmt: skip
    raw.update(config_overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    tensors = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    tensors["embed_tokens.weight"] = target.embed.weight.detach().clone()
    tensors["lm_head.weight"] = target.head.weight.detach().clone()
    save_file(tensors, folder / "model.safetensors")
    return raw, tensors


def test_deepspec_folder_loads_and_proposes_the_same(tmp_path):
    draft, target = make_draft(), FakeTarget()
    write_deepspec(tmp_path, draft, target)
    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    assert loaded.config.owns_embeddings and loaded.config.num_target_layers == TARGET_LAYERS
    assert loaded.config.rope_theta == draft.config.rope_theta
    cache, _ = setup_context(draft, target)
    want = draft.propose(cache, torch.tensor([2]), torch.tensor([7]))
    got = loaded.propose(cache, torch.tensor([2]), torch.tensor([7]))  # its own embeddings: no bind_target needed
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    other = FakeTarget()
    loaded.bind_target(other)  # a DeepSpec draft keeps its own embed_tokens / lm_head
    assert loaded._shared_embed is None
    assert torch.equal(loaded.propose(cache, torch.tensor([2]), torch.tensor([7]))[1], want[1])
    # saved again in the speculators form, it needs the target's embeddings and gives the same proposals
    loaded.save_pretrained(tmp_path / "speculators")
    again = DSparkDraftModel.from_pretrained(tmp_path / "speculators", target=target)
    assert torch.equal(again.propose(cache, torch.tensor([2]), torch.tensor([7]))[1], want[1])


def edit_speculators(folder: Path, config=None, tensors=None):
    raw = json.loads((folder / "config.json").read_text())
    if config:
        config(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    if tensors:
        state = load_file(folder / "model.safetensors")
        tensors(state)
        save_file(state, folder / "model.safetensors")


REFUSALS = {
    "dflash": (dict(config=lambda r: r.update(speculators_model_type="dflash")), "'dflash' is refused: a DFlash"),
    "unknown type": (dict(config=lambda r: r.update(speculators_model_type="eagle3")), "'eagle3' is not supported"),
    "not anchor-first": (dict(config=lambda r: r.update(sample_from_anchor=False)), "sample_from_anchor=False"),
    "aux id 0": (dict(config=lambda r: r.update(aux_hidden_state_layer_ids=[0, 3])), "entry 0 is out of range"),
    "no mask token": (dict(config=lambda r: r.pop("mask_token_id")), "lacks mask_token_id"),
    "no aux ids": (dict(config=lambda r: r.pop("aux_hidden_state_layer_ids")), "lacks aux_hidden_state_layer_ids"),
    "sliding layers": (
        dict(config=lambda r: r["transformer_layer_config"].update(layer_types=["sliding_attention"] * 2)),
        "sliding windows are not supported",
    ),
    "llama backbone": (dict(config=lambda r: r["transformer_layer_config"].update(model_type="llama")), "'llama'"),
    "yarn rope": (
        dict(
            config=lambda r: r["transformer_layer_config"].update(
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
            )
        ),  # fmt: skip
        "rope type 'yarn'",
    ),
    "missing tensor": (
        dict(tensors=lambda s: s.pop("layers.1.self_attn.k_norm.weight")),
        r"missing tensor\(s\) \['layers.1.self_attn.k_norm.weight'\]",
    ),  # fmt: skip
    "extra tensor": (
        dict(tensors=lambda s: s.update({"layers.2.mlp.up_proj.weight": torch.zeros(1)})),
        r"unexpected tensor\(s\) \['layers.2.mlp.up_proj.weight'\]",
    ),  # fmt: skip
    "lm_head with full vocabulary": (
        dict(tensors=lambda s: s.update({"lm_head.weight": torch.zeros(VOCAB, HIDDEN)})),
        "carries no embed_tokens / lm_head",
    ),  # fmt: skip
    "wrong shape": (
        dict(tensors=lambda s: s.update({"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)})),
        r"fc.weight has shape \(32, 96\); the config gives \(32, 64\)",
    ),  # fmt: skip
    "wrong rank": (dict(config=lambda r: r.update(markov_rank=7)), r"has shape \(.*\); the config gives"),
    "not dspark": (
        dict(config=lambda r: (r.pop("speculators_model_type"), r.update(architectures=["Qwen3Model"]))),
        "not a DSpark checkpoint",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_speculators_refusals(tmp_path, case):
    make_draft().save_pretrained(tmp_path)
    edits, message = REFUSALS[case]
    edit_speculators(tmp_path, **edits)
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_reduced_vocabulary_mapping_refused(tmp_path):
    draft = make_draft(draft_vocab_size=10)
    draft.d2t.copy_(torch.arange(10) * 3)
    draft.t2d[torch.arange(10) * 4] = True
    draft.save_pretrained(tmp_path)
    edit_speculators(tmp_path, tensors=lambda s: s["t2d"].__setitem__(1, True))
    with pytest.raises(ValueError, match="t2d marks 11 target ids; draft_vocab_size is 10"):
        DSparkDraftModel.from_pretrained(tmp_path)
    edit_speculators(tmp_path, tensors=lambda s: (s["t2d"].__setitem__(1, False), s["t2d"].__setitem__(0, False),
                                                  s["t2d"].__setitem__(2, True)))  # fmt: skip
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        DSparkDraftModel.from_pretrained(tmp_path)
    edit_speculators(tmp_path, tensors=lambda s: s["d2t"].__setitem__(9, 100))
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target vocabulary"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_layer_ids_checked_against_the_target(tmp_path):
    make_draft(target_layer_ids=[0, 3]).save_pretrained(tmp_path)  # aux [1, 4]: layer 3 is the last of 4
    draft = DSparkDraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="target layer id 3 is the target's final layer"):
        draft.bind_target(FakeTarget())
    with pytest.raises(ValueError, match="target layer id 3 is out of range for a target with 3 layers"):
        draft.bind_target(FakeTarget(layers=3))
    draft.bind_target(FakeTarget(layers=5))
    with pytest.raises(ValueError, match="target_hidden_size=32; the target's hidden_size is 16"):
        make_draft().bind_target(FakeTarget(hidden=16))
    with pytest.raises(ValueError, match="target vocab_size of 61; the target has 62"):
        make_draft().bind_target(FakeTarget(vocab=62))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(target_layer_ids=[0, 3]), "target layer id 3 is the target's final layer"),
        (dict(target_layer_ids=[0, 4]), "target layer id 4 is out of range for a target with 4 layers"),
        (dict(num_target_layers=5), "num_target_layers=5 layers; this target has 4"),
        (dict(architectures=["Qwen3ForCausalLM"]), "not a DSpark checkpoint"),
    ],
)
def test_deepspec_refusals(tmp_path, overrides, message):
    draft, target = make_draft(), FakeTarget()
    write_deepspec(tmp_path, draft, target, **overrides)
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path, target=target)


def test_deepspec_missing_embeddings_refused(tmp_path):
    draft, target = make_draft(), FakeTarget()
    write_deepspec(tmp_path, draft, target)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("embed_tokens.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['embed_tokens.weight'\]"):
        DSparkDraftModel.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------- the real target


def test_with_kdsa_target():
    """Bound to kdsa-tiny, fed its real hidden_states tuple; a draft for another depth is refused."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(ROOT / "checkpoints" / "kdsa-tiny").eval()
    config = make_config(vocab_size=201, hidden_size=128, target_layer_ids=[0, 1, 2], mask_token_id=3)
    draft = DSparkDraftModel(config).eval().bind_target(target)
    ids = torch.randint(4, 201, (1, 12))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    cache = draft.new_cache(1)
    draft.extend_context(cache, states)
    tokens, q_logits, confidence = draft.propose(cache, ids[:, -1], torch.tensor([12]))
    assert tokens.shape == (1, 5) and q_logits.shape == (1, 5, 201) and confidence.shape == (1, 5)
    assert draft._shared_embed is target.get_input_embeddings()
    assert not any(p is target.lm_head.weight for p in draft.parameters())
    with pytest.raises(ValueError, match="final layer"):
        DSparkDraftModel(make_config(vocab_size=201, hidden_size=128, target_layer_ids=[3])).bind_target(target)


SHIPPED = ROOT / "checkpoints" / "kdsa-tiny-dspark"


def accepted_per_round(draft, target, ids: torch.Tensor, prompt_len: int) -> float:
    """Greedy speculation replayed on a known greedy continuation `ids` [1, S]: mean tokens per round (accepted drafts
    + 1) when each round proposes at the anchor and the longest matching prefix is accepted."""
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    cache, position, rounds = draft.new_cache(1), prompt_len, []
    draft.extend_context(cache, [s[:, :position] for s in states])
    while position < ids.shape[1] - 1:
        tokens, _, _ = draft.propose(cache, ids[:, position], torch.tensor([position]))
        n = min(tokens.shape[1], ids.shape[1] - 1 - position)
        count = int((tokens[0, :n] == ids[0, position + 1 : position + 1 + n]).long().cumprod(0).sum())
        draft.extend_context(cache, [s[:, position : position + count + 1] for s in states])
        position += count + 1
        rounds.append(count + 1)
    return sum(rounds) / len(rounds)


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="no shipped DSpark draft")
def test_shipped_draft_loads_and_agrees_with_the_target():
    from modeling_kdsa.eval.make_data import load_docs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(ROOT / "checkpoints" / "kdsa-tiny").eval()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "kdsa-tiny")
    draft = DSparkDraftModel.from_pretrained(SHIPPED, target=target)
    assert not list(SHIPPED.glob("*.py"))
    raw = json.loads((SHIPPED / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark"
    taus = []
    for doc in load_docs("recall_near", "test")[:3]:  # held out from the draft's training
        ids = tokenizer(doc["context"], return_tensors="pt").input_ids
        continued = target.generate(ids, do_sample=False, max_new_tokens=24)
        taus.append(accepted_per_round(draft, target, continued, ids.shape[1]))
        assert torch.equal(
            target.generate(ids, assistant_model=draft, speculation_type="dspark", do_sample=False, max_new_tokens=24),
            continued,
        )
    # an untrained draft accepts next to nothing (about 1.0 token per round)
    assert sum(taus) / len(taus) > 1.5, taus
