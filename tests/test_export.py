"""`torch.export` of a whole forward (docs/graph-mode.md §7): the exported program reproduces the eager logits for
other inputs of the same shape, padding included, for a model with KDA, DSA and dense MLA layers."""

import torch
from conftest import tiny_model

LAYERS = ["linear_attention", "indexed_attention", "full_attention", "linear_attention"]


def ids(seed):
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_exported_forward_reproduces_eager_logits():
    model = tiny_model(layer_types=LAYERS)
    mask = torch.ones(2, 12, dtype=torch.long)
    program = torch.export.export(model, (ids(0),), {"attention_mask": mask, "use_cache": False}, strict=False)
    padded = mask.clone()
    padded[1, :4] = 0  # left padding
    with torch.no_grad():
        for tokens, attention_mask in ((ids(0), mask), (ids(1), mask), (ids(2), padded)):
            expected = model(tokens, attention_mask=attention_mask).logits
            got = program.module()(tokens, attention_mask=attention_mask, use_cache=False).logits
            real = attention_mask.bool()
            # The export runs the fixed-shape kernels (docs/graph-mode.md §3): equal up to fp32 summation order.
            torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
