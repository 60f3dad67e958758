"""Block AttnRes depth softmax with logits far beyond fp32 `exp`'s range: the two-phase stream subtracts running
maxima (phase 1 over the blocks, phase 2 when merging the partial sum), so it must equal the direct formula
(torch.softmax, which subtracts the max itself) and stay finite. Logits here are ~±1000: keys are RMS-normalised
(|k| = √D = 4), queries have norm ~1000."""

import pytest
import torch
from test_attn_res import make_depth_attns, make_sublayers, run_stream


@pytest.mark.parametrize("scale", [300.0, -300.0])
def test_two_phase_equals_direct_for_logits_beyond_exp_range(scale):
    depth_attns = make_depth_attns(8, seed=0)
    with torch.no_grad():
        for attn in depth_attns:
            attn.query.mul_(scale)
    sublayers = make_sublayers(8, seed=1)
    embeddings = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    two_phase, final = run_stream(embeddings, 3, depth_attns, sublayers, two_phase=True)
    direct, final_direct = run_stream(embeddings, 3, depth_attns, sublayers, two_phase=False)
    first_logits = depth_attns[0].key_norm(embeddings) @ depth_attns[0].query
    assert (first_logits.abs() > 104).all(), "every logit beyond fp32 exp's range"
    for ours, reference in zip(two_phase, direct, strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_direct, rtol=1e-4, atol=1e-4)
