"""Figures for docs/checkpoint-conversion.md §7: each family's tiny checkpoint (eval/family_fixtures.py) loaded by
`KDSAForCausalLM.from_pretrained` against transformers' own class, and the FP8 copies against the unquantized model.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python scripts/foreign_checkpoint_figures.py

FP8 vs unquantized is also printed for the same model with Gaussian weight noise of E4M3's typical relative size
(2.6%), to show which part of the gap is the format's and which the fixture's: the random tiny models route tokens
and select keys on near-tied scores, so any weight perturbation flips some choices.
"""

import copy
import tempfile
from pathlib import Path

import torch
from modeling_kdsa.eval.family_fixtures import LONG, SHORT, Family, fp8_copy, relative_error

from modeling_kdsa import KDSAForCausalLM


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def main() -> None:
    ids = torch.randint(3, 128, (8, 64), generator=torch.Generator().manual_seed(2))
    for name in ("deepseek_v32", "kimi_linear", "glm5_next"):
        folder = Path(tempfile.mkdtemp())
        family = Family(name, folder / "hub")
        with torch.no_grad():
            errors = [
                relative_error(family.model(family.ids[:, :t]).logits, family.reference(family.ids[:, :t]).logits)
                for t in (SHORT, LONG)
            ]
            print(
                f"{name}: max |ours - transformers| / max |logits|: T={SHORT} {errors[0]:.1e}, T={LONG} {errors[1]:.1e}"
            )
            if name == "kimi_linear":
                continue
            unquantized = family.model(ids).logits
            for block in (8, 16):
                fp8_copy(family.folder, folder / f"fp8-{block}", block=block)
                fp8 = KDSAForCausalLM.from_pretrained(folder / f"fp8-{block}").eval()(ids).logits
                print(
                    f"  FP8 blocks {block}x{block} vs unquantized: relative {relative_error(fp8, unquantized):.3f}, "
                    f"top-1 agreement {top1(fp8, unquantized):.3f}"
                )
            noisy = copy.deepcopy(family.model)
            generator = torch.Generator().manual_seed(3)
            for param_name, param in noisy.named_parameters():
                if param.dim() >= 2 and "layers." in param_name and "mlp.gate." not in param_name:
                    param.mul_(1 + 0.026 * torch.randn(param.shape, generator=generator))
            noise = noisy(ids).logits
            print(
                f"  2.6% Gaussian weight noise vs unquantized: relative {relative_error(noise, unquantized):.3f}, "
                f"top-1 agreement {top1(noise, unquantized):.3f}"
            )


if __name__ == "__main__":
    main()
