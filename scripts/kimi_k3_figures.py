"""MXFP4 routed experts against the unquantized K3-layout model (docs/kimi-k3.md §5): top-1 agreement per seed, on
all positions and on those whose top-1 is not a near tie, next to what bf16 rounding of the unquantized model gives.

    PYTHONPATH=$PWD .venv/bin/python scripts/kimi_k3_figures.py
"""

from modeling_kdsa.eval.kimi_k3_fixtures import mxfp4_top1_agreement


def main() -> None:
    for seed in range(4):
        same, decisive, bf16_same = mxfp4_top1_agreement(seed)
        print(
            f"seed {seed}: MXFP4 top-1 {same.float().mean():.4f} overall, {same[decisive].float().mean():.4f} on the "
            f"{decisive.float().mean():.0%} non-tied positions; bf16 rounding {bf16_same.float().mean():.4f} overall"
        )


if __name__ == "__main__":
    main()
