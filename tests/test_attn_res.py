"""Block AttnRes (modeling_kdsa/attn_res.py) against the reference forward of docs/attn-res.md §2."""

import pytest
import torch

from modeling_kdsa import attn_res, norms
from modeling_kdsa.attn_res import BlockAttnResStream, KDSADepthAttention

HIDDEN = 16
EPS = 1e-6


def make_depth_attns(num: int, seed: int, zero_queries: bool = False) -> list[KDSADepthAttention]:
    """Depth attentions with random queries and key-norm gains, so the depth softmax is far from uniform."""
    generator = torch.Generator().manual_seed(seed)
    attns = []
    for _ in range(num):
        attn = KDSADepthAttention(HIDDEN, eps=EPS)
        with torch.no_grad():
            if not zero_queries:
                attn.query.copy_(torch.randn(HIDDEN, generator=generator))
            attn.key_norm.weight.copy_(1 + 0.5 * torch.randn(HIDDEN, generator=generator))
        attns.append(attn)
    return attns


def make_sublayers(num: int, seed: int):
    """Stand-ins for token mixers / FFNs: nonlinear functions of the input with very different output scales."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5 for _ in range(num)]
    scales = [10.0 ** (i % 3 - 1) for i in range(num)]  # 0.1, 1, 10, 0.1, ...
    return [lambda h, w=w, c=c: c * torch.tanh(h @ w) for w, c in zip(weights, scales, strict=True)]


def run_stream(embeddings, block_size, depth_attns, sublayers, two_phase, final_attn=None):
    """Drive the stream as the model does; return every sublayer input and the final output."""
    stream = BlockAttnResStream(embeddings, block_size=block_size, depth_attns=depth_attns, two_phase=two_phase)
    inputs = []
    for s, sublayer in enumerate(sublayers):
        h = stream.input_for(s)
        inputs.append(h)
        stream.add_output(s, sublayer(h))
    return inputs, stream.final(final_attn)


def reference_forward(embeddings, block_size, depth_attns, sublayers, final_attn):
    """docs/attn-res.md §2 reference forward, written per sublayer: `blocks=[]`, `partial=embedding`; a sublayer
    that starts a block attends over `blocks + [partial]` and then commits the partial; the head aggregates
    `blocks + [partial]`."""
    blocks, partial = [], embeddings
    inputs = []
    for s, sublayer in enumerate(sublayers):
        h = depth_attns[s](blocks + [partial])
        if s % block_size == 0:
            blocks, partial = blocks + [partial], None
        y = sublayer(h)
        partial = y if partial is None else partial + y
        inputs.append(h)
    return inputs, final_attn(blocks + [partial])


def assert_close_to_scale(actual, expected, rel):
    """Elementwise |actual - expected| <= rel · max|expected|: round-off is relative to the tensor's scale, and
    elementwise relative error is meaningless for entries near zero."""
    torch.testing.assert_close(actual, expected, atol=rel * expected.abs().max().item(), rtol=0)


def forced_outputs(embeddings, block_size, depth_attns, sublayers):
    """Sublayer outputs of a reference run. Feeding them back as constants ("teacher forcing") compares one
    depth-attention step at a time, instead of letting the sublayers amplify earlier round-off."""
    inputs, _ = reference_forward(embeddings, block_size, depth_attns, sublayers, depth_attns[0])
    return [sublayer(h).detach() for sublayer, h in zip(sublayers, inputs, strict=True)]


def constant_sublayers(outputs):
    return [lambda h, y=y: y for y in outputs]


def direct_depth_attention(sources, query, gain):
    """`softmax_i(queryᵀ RMSNorm(v_i))` written out with an explicit loop over sources, in float64."""
    logits = []
    for v in sources:
        v = v.double()
        key = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * gain.double()
        logits.append(key @ query.double())
    weights = torch.stack(logits).softmax(0)
    return sum(w.unsqueeze(-1) * v.double() for w, v in zip(weights, sources, strict=True))


def test_depth_attention_matches_written_out_formula():
    attn = make_depth_attns(1, seed=0)[0]
    sources = [torch.randn(2, 3, HIDDEN) * scale for scale in (0.1, 1.0, 30.0)]
    expected = direct_depth_attention(sources, attn.query.detach(), attn.key_norm.weight.detach())
    torch.testing.assert_close(attn(sources).double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_layer_forward_matches_techniques_pseudocode():
    """The per-sublayer reference above equals the per-layer pseudocode of docs/attn-res.md §2 (block size 2, where
    each layer starts a block at its attention sublayer), so the tests below compare against the documented
    semantics."""
    num_layers = 3
    attns = make_depth_attns(2 * num_layers + 1, seed=1)
    sublayers = make_sublayers(2 * num_layers, seed=2)
    embeddings = torch.randn(2, 3, HIDDEN)

    blocks, partial = [], embeddings
    for layer in range(num_layers):
        attn_q, ffn_q = attns[2 * layer], attns[2 * layer + 1]
        h = attn_q(blocks + [partial])
        blocks, partial = blocks + [partial], None  # starts_block: every layer with block size 2
        y = sublayers[2 * layer](h)
        partial = y
        h = ffn_q(blocks + [partial])
        partial = partial + sublayers[2 * layer + 1](h)
    expected = attns[-1](blocks + [partial])

    _, out = reference_forward(embeddings, 2, attns[:-1], sublayers, attns[-1])
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("two_phase", [False, True])
def test_sources_per_sublayer(two_phase):
    """Hand-written source lists for block size 3 over 5 sublayers (y_s is sublayer s's output)."""
    attns = make_depth_attns(5, seed=3)
    sublayers = make_sublayers(5, seed=4)
    emb = torch.randn(1, 2, HIDDEN)
    final_attn = make_depth_attns(1, seed=5)[0]
    inputs, out = run_stream(emb, 3, attns, sublayers, two_phase, final_attn)
    y = [sublayers[s](inputs[s]) for s in range(5)]
    expected_sources = [
        [emb],
        [emb, y[0]],
        [emb, y[0] + y[1]],
        [emb, y[0] + y[1] + y[2]],  # sublayer 3 starts block 2: completed blocks only
        [emb, y[0] + y[1] + y[2], y[3]],
    ]
    for s, sources in enumerate(expected_sources):
        torch.testing.assert_close(inputs[s], attns[s](sources), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, final_attn([emb, y[0] + y[1] + y[2], y[3] + y[4]]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 20])
@pytest.mark.parametrize("shape", [(2, 5), (1, 1), (3, 1)])
def test_two_phase_matches_direct_formula(block_size, shape):
    """Two-phase (docs/attn-res.md §3) and direct stream == §2 reference in fp32, for every sublayer input and the
    final aggregation; block size 20 exceeds the 8 sublayers (a single block after b_0). Measured worst error
    9.4e-7 of the tensor's scale on AMD Zen 4 and 1.03e-6 on an Intel Xeon with AMX (two-phase; the direct stream is
    bit-exact); the bound leaves room for other CPUs' fp32 products."""
    num_sublayers = 8
    attns = make_depth_attns(num_sublayers, seed=block_size)
    final_attn = make_depth_attns(1, seed=100 + block_size)[0]
    embeddings = torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        sublayers = constant_sublayers(forced_outputs(embeddings, block_size, attns, make_sublayers(num_sublayers, 7)))
        ref_inputs, ref_out = reference_forward(embeddings, block_size, attns, sublayers, final_attn)
        for two_phase in (False, True):
            inputs, out = run_stream(embeddings, block_size, attns, sublayers, two_phase, final_attn)
            for s in range(num_sublayers):
                assert_close_to_scale(inputs[s], ref_inputs[s], rel=4e-6)
            assert_close_to_scale(out, ref_out, rel=4e-6)


def test_two_phase_bf16_close_to_fp32():
    """bf16 stream (bf16 partial sums, as served) against fp32 on the same bf16 values. Over 40 seeds the worst error
    was 1.5e-2 of the tensor's scale for two-phase and 2.1e-2 for the direct formula (which also rounds keys)."""
    attns = make_depth_attns(8, seed=11)
    final_attn = make_depth_attns(1, seed=12)[0]
    embeddings = torch.randn(2, 4, HIDDEN).bfloat16()
    with torch.no_grad():
        outputs = [y.bfloat16() for y in forced_outputs(embeddings.float(), 3, attns, make_sublayers(8, seed=13))]
        ref_inputs, ref_out = run_stream(
            embeddings.float(), 3, attns, constant_sublayers([y.float() for y in outputs]), False, final_attn
        )
        inputs, out = run_stream(embeddings, 3, attns, constant_sublayers(outputs), True, final_attn)
    for s in range(8):
        assert inputs[s].dtype == torch.bfloat16
        assert_close_to_scale(inputs[s].float(), ref_inputs[s], rel=2.5e-2)
    assert_close_to_scale(out.float(), ref_out, rel=2.5e-2)


def reassociation_bound(attns, embeddings, outputs, num_sources):
    """Largest difference two fp32 evaluations of the same stream may show when they only sum in another order
    (batched over T tokens versus one token at a time: BLAS blocks the reductions differently).

    Per depth attention with folded query `a = q ⊙ g` over sources `v_i` (D channels):
    - each logit `l_i = Σ_d a_d v_{i,d} / rms(v_i)` is within `γ_{D+3} · Σ_d |a_d v_{i,d}| / rms(v_i)` of exact
      (dot product plus the mean of squares; `γ_m = m·u / (1 − m·u)`, u = 2^-24), and by Cauchy-Schwarz
      `Σ_d |a_d v_{i,d}| / rms(v_i) ≤ √D · ‖a‖`; two evaluations differ by twice that: `δl ≤ 2γ_{D+3}·√D·‖a‖`;
    - the softmax weights then move by at most `2·δl` relative (first order), the weighted sum over n sources
      adds `2γ_{n+1}`, exp and the division a few u;
    - so `|δ output| ≤ (4γ_{D+3}·√D·max‖a‖ + 2γ_{n+1} + 8u) · max|v|`, with `max|v| ≤ max|emb| + Σ_s max|y_s|`
      (every source is the embedding or a partial sum of sublayer outputs).
    A token that read another token would be off by O(max|v|), orders of magnitude above this bound."""
    unit = 2.0**-24

    def gamma(m):
        return m * unit / (1 - m * unit)

    max_query = max((a.query.float() * a.key_norm.weight.float()).norm().item() for a in attns)
    max_value = embeddings.abs().max().item() + sum(y.abs().max().item() for y in outputs)
    logit_error = 2 * gamma(HIDDEN + 3) * HIDDEN**0.5 * max_query
    return (2 * logit_error + 2 * gamma(num_sources + 1) + 8 * unit) * max_value


def test_position_wise_decode_equals_prefill():
    """No token reads another: each token alone (T = 1, as in decode) gives the whole sequence's result, within
    the round-off bound of `reassociation_bound` (the two runs sum in different orders; with random data a fixed
    1e-6 of the scale was exceeded about once in 400 runs)."""
    generator = torch.Generator().manual_seed(20)
    attns = make_depth_attns(6, seed=13)
    final_attn = make_depth_attns(1, seed=14)[0]
    embeddings = torch.randn(2, 4, HIDDEN, generator=generator)
    with torch.no_grad():
        outputs = forced_outputs(embeddings, 4, attns, make_sublayers(6, seed=15))
        bound = reassociation_bound([*attns, final_attn], embeddings, outputs, num_sources=3)
        whole_inputs, whole = run_stream(embeddings, 4, attns, constant_sublayers(outputs), True, final_attn)
        for t in range(4):
            token_outputs = [y[:, t : t + 1] for y in outputs]
            inputs, token = run_stream(
                embeddings[:, t : t + 1], 4, attns, constant_sublayers(token_outputs), True, final_attn
            )
            for s in range(6):
                torch.testing.assert_close(inputs[s], whole_inputs[s][:, t : t + 1], atol=bound, rtol=0)
            torch.testing.assert_close(token, whole[:, t : t + 1], atol=bound, rtol=0)


@pytest.mark.parametrize("two_phase", [False, True])
def test_other_tokens_do_not_change_a_token_bit_for_bit(two_phase):
    """Position-wise, exactly: replacing every other token's embedding and sublayer outputs leaves token t's
    inputs and output bit-identical (same shapes, so the same kernels and summation order)."""
    generator = torch.Generator().manual_seed(21)
    attns = make_depth_attns(6, seed=22)
    final_attn = make_depth_attns(1, seed=23)[0]
    embeddings = torch.randn(2, 5, HIDDEN, generator=generator)
    outputs = [torch.randn(2, 5, HIDDEN, generator=generator) * 10.0 ** (s % 3 - 1) for s in range(6)]
    with torch.no_grad():
        inputs, out = run_stream(embeddings, 4, attns, constant_sublayers(outputs), two_phase, final_attn)
        for t in range(5):
            others = torch.ones(5, dtype=torch.bool)
            others[t] = False
            noisy_embeddings = embeddings.clone()
            noisy_embeddings[:, others] = torch.randn(2, 4, HIDDEN, generator=generator) * 100
            noisy_outputs = [y.clone() for y in outputs]
            for y in noisy_outputs:
                y[:, others] = torch.randn(2, 4, HIDDEN, generator=generator) * 100
            noisy_inputs, noisy_out = run_stream(
                noisy_embeddings, 4, attns, constant_sublayers(noisy_outputs), two_phase, final_attn
            )
            for s in range(6):
                assert torch.equal(noisy_inputs[s][:, t], inputs[s][:, t]), (t, s)
            assert torch.equal(noisy_out[:, t], out[:, t]), t


@pytest.mark.parametrize("two_phase", [False, True])
def test_zero_queries_give_uniform_average(two_phase):
    attns = make_depth_attns(6, seed=16, zero_queries=True)  # random gains: zero queries ignore them
    sublayers = make_sublayers(6, seed=17)
    emb = torch.randn(2, 3, HIDDEN)
    inputs, _ = run_stream(emb, 2, attns, sublayers, two_phase)
    y = [sublayers[s](inputs[s]) for s in range(6)]
    expected = [emb, (emb + y[0]) / 2, (emb + y[0] + y[1]) / 2, (emb + y[0] + y[1] + y[2]) / 3]
    expected += [(emb + y[0] + y[1] + y[2] + y[3]) / 3, (emb + y[0] + y[1] + y[2] + y[3] + y[4]) / 4]
    for s in range(6):
        torch.testing.assert_close(inputs[s], expected[s], atol=1e-6, rtol=1e-6)


def test_gradients_reach_queries_and_match_direct():
    """Gradients reach every query and key-norm gain, and two-phase gradients equal the direct ones (measured worst
    8.3e-6 of the gradient's scale over 20 seeds)."""
    generator = torch.Generator().manual_seed(18)
    emb = torch.randn(2, 3, HIDDEN, generator=generator)
    outputs = [torch.randn(2, 3, HIDDEN, generator=generator) * 10.0 ** (s % 3 - 1) for s in range(6)]
    probes = [torch.randn(2, 3, HIDDEN, generator=generator) for _ in range(7)]
    grads = {}
    for two_phase in (False, True):
        attns = make_depth_attns(6, seed=19)
        final_attn = make_depth_attns(1, seed=20)[0]
        inputs, out = run_stream(emb, 3, attns, constant_sublayers(outputs), two_phase, final_attn)
        sum((h * p).sum() for h, p in zip(inputs + [out], probes, strict=True)).backward()
        grads[two_phase] = [(a.query.grad, a.key_norm.weight.grad) for a in attns + [final_attn]]
    for s, ((q_direct, g_direct), (q_two, g_two)) in enumerate(zip(grads[False], grads[True], strict=True)):
        if s == 0:  # sublayer 0 attends over the embedding alone: a softmax over one source has zero gradient
            assert q_two.abs().max() == 0 and g_two.abs().max() == 0
            continue
        assert q_two.abs().max() > 1e-3 and g_two.abs().max() > 1e-3, f"no gradient reached depth attention {s}"
        assert_close_to_scale(q_two, q_direct, rel=2e-5)
        assert_close_to_scale(g_two, g_direct, rel=2e-5)


def test_gradient_reaches_zero_initialised_queries():
    attns = make_depth_attns(4, seed=21, zero_queries=True)
    sublayers = make_sublayers(4, seed=22)
    _, out = run_stream(torch.randn(2, 3, HIDDEN), 2, attns, sublayers, True, KDSADepthAttention(HIDDEN, EPS))
    out.pow(2).sum().backward()
    for s in range(1, 4):
        assert attns[s].query.grad.abs().max() > 1e-4


@pytest.mark.parametrize("two_phase", [False, True])
def test_final_with_and_without_aggregation(two_phase):
    attns = make_depth_attns(5, seed=23)
    sublayers = make_sublayers(5, seed=24)
    emb = torch.randn(2, 3, HIDDEN)
    final_attn = make_depth_attns(1, seed=25)[0]
    inputs, aggregated = run_stream(emb, 2, attns, sublayers, two_phase, final_attn)
    y = [sublayers[s](inputs[s]) for s in range(5)]
    torch.testing.assert_close(aggregated, final_attn([emb, y[0] + y[1], y[2] + y[3], y[4]]), atol=1e-5, rtol=1e-5)

    _, plain = run_stream(emb, 2, attns, sublayers, two_phase, None)
    torch.testing.assert_close(plain, emb + sum(y), atol=1e-5, rtol=1e-5)  # the standard residual stream's value
    # After the final RMSNorm, no aggregation equals a zero-query aggregation (the uniform average).
    _, uniform = run_stream(emb, 2, attns, sublayers, two_phase, KDSADepthAttention(HIDDEN, EPS))
    rms_normalise = lambda x: x / x.pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(rms_normalise(plain), rms_normalise(uniform), atol=1e-5, rtol=1e-5)


def test_misuse_raises():
    attns = make_depth_attns(2, seed=26)
    emb = torch.randn(1, 1, HIDDEN)
    with pytest.raises(ValueError, match="block_size"):
        BlockAttnResStream(emb, block_size=0, depth_attns=attns)
    with pytest.raises(ValueError, match="empty"):
        BlockAttnResStream(emb, block_size=2, depth_attns=[])
    stream = BlockAttnResStream(emb, block_size=2, depth_attns=attns)
    with pytest.raises(ValueError, match="out of order"):
        stream.input_for(1)
    h = stream.input_for(0)
    with pytest.raises(ValueError, match="out of order"):
        stream.input_for(1)  # add_output(0) is missing
    stream.add_output(0, h)
    with pytest.raises(ValueError, match="1 of 2 sublayers"):
        stream.final(None)
    with pytest.raises(ValueError, match="eps"):
        BlockAttnResStream(
            emb, block_size=2, depth_attns=[KDSADepthAttention(HIDDEN, 1e-6), KDSADepthAttention(HIDDEN, 1e-5)]
        )


@pytest.mark.parametrize("two_phase", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_segments_are_bit_identical(monkeypatch, two_phase, dtype):
    """A long sequence runs in token segments (docs/design.md §12): with segments of 64 tokens (the last one taking
    the remainder: 64, 64, 70), every sublayer input, the final aggregation and the key norm are exactly those of
    one pass, in fp32 and bf16, with two rows, and gradients still reach the queries."""
    generator = torch.Generator().manual_seed(31)
    attns = make_depth_attns(6, seed=32)
    final_attn = make_depth_attns(1, seed=33)[0]
    embeddings = torch.randn(2, 198, HIDDEN, generator=generator).to(dtype)
    outputs = [(torch.randn(2, 198, HIDDEN, generator=generator) * 10.0 ** (s % 3 - 1)).to(dtype) for s in range(6)]
    assert [(p.start, p.stop) for p in norms.token_segments(198, 64)] == [(0, 64), (64, 128), (128, 198)]
    results, widest = [], []
    segments = attn_res.token_segments
    monkeypatch.setattr(attn_res, "token_segments", lambda *a: widest.append(len(segments(*a))) or segments(*a))
    for segment in (1 << 30, 64):
        monkeypatch.setattr(norms, "TOKEN_SEGMENT", segment)
        widest.clear()
        inputs, out = run_stream(embeddings, 4, attns, constant_sublayers(outputs), two_phase, final_attn)
        results.append([*inputs, out, attns[0].key_norm(embeddings.float())])
        assert max(widest) == (1 if segment > 198 else 3)  # the segmented pass did run in segments
    for s, (whole, segmented) in enumerate(zip(*results, strict=True)):
        assert torch.equal(segmented, whole), s
    assert all(a.query.grad is None for a in attns)
    sum(x.float().sum() for x in results[1][:-1]).backward()
    assert attns[5].query.grad is not None and attns[5].query.grad.abs().sum() > 0
