"""MXFP4 routed experts against the unquantized K3-layout model (docs/kimi-k3.md §5): top-1 agreement per seed, on
all positions and on those whose top-1 is not a near tie, next to what bf16 rounding of the unquantized model gives.

    PYTHONPATH=$PWD .venv/bin/python scripts/kimi_k3_figures.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kimi_k3 import k3_config, perturbed_model  # noqa: E402

from modeling_kdsa import KDSAForCausalLM  # noqa: E402
from modeling_kdsa.numeric_formats import mxfp4_quantize  # noqa: E402


def main() -> None:
    for seed in range(4):
        dense = perturbed_model(k3_config(quantized=False), seed=seed)
        quantized = KDSAForCausalLM(k3_config(quantized=True)).eval()
        state = dense.state_dict()
        for key in list(state):
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                state[key + "_packed"], state[key + "_scale"] = mxfp4_quantize(state.pop(key))
        quantized.load_state_dict(state, strict=True)
        ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(seed + 1))
        with torch.no_grad():
            reference, mxfp4 = dense(ids).logits, quantized(ids).logits
            bf16 = dense.to(torch.bfloat16)(ids).logits.float()
        top2 = reference.topk(2, dim=-1).values
        decisive = (top2[..., 0] - top2[..., 1]) > 0.1 * reference.std()
        same = reference.argmax(-1) == mxfp4.argmax(-1)
        bf16_same = reference.argmax(-1) == bf16.argmax(-1)
        print(
            f"seed {seed}: MXFP4 top-1 {same.float().mean():.4f} overall, {same[decisive].float().mean():.4f} on the "
            f"{decisive.float().mean():.0%} non-tied positions; bf16 rounding {bf16_same.float().mean():.4f} overall"
        )


if __name__ == "__main__":
    main()
