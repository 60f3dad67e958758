"""Accuracy of the quantized KDSA cache: the same weights under BF16 and each quantization choice
(docs/design.md §4, §8).

    python -m modeling_kdsa.eval.quantization_report                     # shipped checkpoint (random model if absent)
    python -m modeling_kdsa.eval.quantization_report --docs 20 --json runs/quantization.json

Per configuration, against the BF16 reference on the same inputs:
- indexer top-k recall per DSA layer: |top-k(MXFP8 q, k) ∩ top-k(BF16 q, k)| / |top-k(BF16 q, k)|, from the indexer
  inputs of the configuration's own forward (so each layer is measured on identical inputs, not on drifted ones);
- logits KL(P_bf16 ‖ P_quant) (mean over positions) and top-1 token agreement over a fixed text set (the test
  split of the shipped lm-eval tasks, `--docs` per task; random token ids for a random model);
- generate agreement: greedy continuations of `--new-tokens` tokens, fraction of equal tokens (position-wise) and of
  identical continuations;
- cache bytes per token (DSA stores, all DSA layers) and the ratio to BF16.
The configurations switch formats on one loaded model by setting `config.quantization_config`, which every cache reads
when it is built (exactly what `from_pretrained(..., quantization_config=...)` leaves behind).
Prints a markdown table and writes JSON (`--json`).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from modeling_kdsa.quantization import KDSAQuantizationConfig
from tqdm import tqdm

from modeling_kdsa.cache import KDSACache
from modeling_kdsa.dsa_ops import indexer_topk
from modeling_kdsa.numeric_formats import FP8_TILE_SIZE, CacheFormats

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "kdsa-tiny"
CONFIGURATIONS = {
    "bf16": None,
    "indexer mxfp8 (ceil)": dict(indexer="mxfp8", kv_cache="bf16", mxfp8_scale_rule="ceil"),
    "indexer mxfp8 (floor)": dict(indexer="mxfp8", kv_cache="bf16", mxfp8_scale_rule="floor"),
    "kv cache fp8": dict(indexer="bf16", kv_cache="fp8"),
    "all (mxfp8 ceil + fp8)": dict(indexer="mxfp8", kv_cache="fp8", mxfp8_scale_rule="ceil"),
}


def load(checkpoint: Path | None, seed: int = 0):
    """(model in bf16, tokenizer or None, description). Without a checkpoint: a random tiny model whose widths the
    formats divide (index_head_dim 32, kv_lora_rank 128)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if checkpoint is not None and (checkpoint / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
        return model, AutoTokenizer.from_pretrained(checkpoint), f"checkpoint {checkpoint.name}"
    from modeling_kdsa import KDSAConfig, KDSAForCausalLM

    torch.manual_seed(seed)
    config = KDSAConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        layer_types=["linear_attention", "indexed_attention"] * 2, linear_num_heads=2, linear_head_dim=16,
        q_lora_rank=32, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2,
        index_head_dim=32, index_topk=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        attn_res_block_size=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return KDSAForCausalLM(config).to(torch.bfloat16).eval(), None, "random tiny model (no checkpoint)"


def texts(tokenizer, docs_per_task: int, seed: int = 0) -> list[torch.Tensor]:
    """Batches of token ids `[n, L]`: per task, the first `docs_per_task` test docs (context + target), or random ids
    for a random model."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(3, 128, (docs_per_task, 96), generator=generator)]
    from .make_data import TASKS, load_docs  # the shipped task data, needed only with the checkpoint

    batches = []
    for task in TASKS:
        docs = load_docs(task, "test")[:docs_per_task]
        ids = [tokenizer(doc["context"] + " " + doc["target"], add_special_tokens=False).input_ids for doc in docs]
        by_length: dict[int, list[list[int]]] = {}
        for row in ids:
            by_length.setdefault(len(row), []).append(row)
        batches.extend(torch.tensor(rows) for rows in by_length.values())
    return batches


def kv_tile_size(config) -> int:
    """128 (DeepSeek / FlashMLA) when it divides kv_lora_rank, else the largest power of two that does (>= 32)."""
    tile = FP8_TILE_SIZE
    while config.kv_lora_rank % tile and tile > 32:
        tile //= 2
    return tile


def set_configuration(model, choices: dict | None) -> None:
    model.config.quantization_config = None if choices is None else KDSAQuantizationConfig(
        kv_cache_tile_size=kv_tile_size(model.config), **choices
    )  # fmt: skip


@torch.inference_mode()
def indexer_recall(model, batches, formats: CacheFormats) -> list[float]:
    """Per DSA layer: recall of the BF16 top-k by the MXFP8 top-k on the indexer inputs of this configuration's
    forward (hooked), over every query of every batch (reference: dsa_ops.indexer_topk)."""
    # The trunk's DSA layers: a forward never runs the MTP layers' (their indexers would capture nothing).
    attentions = [m for m in model.model.modules() if hasattr(m, "indexer") and hasattr(m, "index_topk")]
    hits, totals = [0] * len(attentions), [0] * len(attentions)
    captured = {}
    handles = [
        attention.indexer.register_forward_hook(lambda module, args, out, i=i: captured.__setitem__(i, out))
        for i, attention in enumerate(attentions)
    ]
    try:
        for ids in batches:
            model(ids, use_cache=False)
            for i, attention in enumerate(attentions):
                q_index, weights, k_index = captured[i]
                reference = indexer_topk(q_index, weights, k_index, attention.index_topk, 0)
                keys = formats.encode_index_keys(k_index)
                keys = keys if isinstance(keys, torch.Tensor) else keys.dequantize(k_index.dtype)
                quantized = indexer_topk(
                    formats.quantize_index_queries(q_index), weights, keys, attention.index_topk, 0
                )
                valid = reference >= 0
                found = (quantized[..., :, None] == reference[..., None, :]).any(dim=-2) & valid
                hits[i] += int(found.sum())
                totals[i] += int(valid.sum())
    finally:
        for handle in handles:
            handle.remove()
    return [h / max(t, 1) for h, t in zip(hits, totals, strict=True)]


@torch.inference_mode()
def logits_of(model, batches) -> list[torch.Tensor]:
    return [model(ids, use_cache=False).logits.float() for ids in batches]


@torch.inference_mode()
def generate_all(model, batches, new_tokens: int) -> list[torch.Tensor]:
    """Greedy continuations of each batch's first half (as a prompt)."""
    outputs = []
    for ids in batches:
        prompt = ids[:, : ids.shape[1] // 2]
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=model.config.pad_token_id)  # fmt: skip
        outputs.append(out[:, prompt.shape[1] :])
    return outputs


@torch.inference_mode()
def cache_bytes_per_token(model, ids: torch.Tensor) -> int:
    cache = KDSACache(model.config)
    model(ids[:1, :8], cache=cache)
    return cache.memory_bytes()["per_token"]


def run(checkpoint: Path | None, docs_per_task: int, new_tokens: int) -> dict:
    model, tokenizer, description = load(checkpoint)
    batches = texts(tokenizer, docs_per_task)
    set_configuration(model, None)
    reference_logits = logits_of(model, batches)
    reference_generated = generate_all(model, batches, new_tokens)
    reference_bytes = cache_bytes_per_token(model, batches[0])
    results = {}
    for name, choices in tqdm(CONFIGURATIONS.items(), desc="configurations", file=sys.stderr):
        set_configuration(model, choices)
        formats = CacheFormats.from_config(model.config)
        logits = reference_logits if choices is None else logits_of(model, batches)
        kl = agree = positions = 0.0
        for ref, got in zip(reference_logits, logits, strict=True):
            log_p, log_q = F.log_softmax(ref, -1), F.log_softmax(got, -1)
            kl += float((log_p.exp() * (log_p - log_q)).sum(-1).sum())
            agree += float((ref.argmax(-1) == got.argmax(-1)).sum())
            positions += ref.shape[0] * ref.shape[1]
        generated = reference_generated if choices is None else generate_all(model, batches, new_tokens)
        same_tokens = sum(float((a == b).sum()) for a, b in zip(reference_generated, generated, strict=True))
        same_sequences = sum(float((a == b).all(-1).sum()) for a, b in zip(reference_generated, generated, strict=True))
        num_sequences = sum(a.shape[0] for a in generated)
        bytes_per_token = cache_bytes_per_token(model, batches[0])
        results[name] = {
            "choices": model.config.quantization_config.to_dict() if choices else None,
            "indexer_recall_per_dsa_layer": indexer_recall(model, batches, formats),
            "logits_kl": kl / positions,
            "top1_agreement": agree / positions,
            "generate_token_agreement": same_tokens / (num_sequences * new_tokens),
            "generate_identical_sequences": same_sequences / num_sequences,
            "cache_bytes_per_token": bytes_per_token,
            "cache_bytes_ratio": bytes_per_token / reference_bytes,
        }
    set_configuration(model, None)
    return {
        "model": description,
        "texts": sum(b.shape[0] for b in batches),
        "positions": int(sum(b.numel() for b in batches)),
        "new_tokens": new_tokens,
        "kv_cache_tile_size": kv_tile_size(model.config),
        "index_topk": model.config.index_topk,
        "results": results,
    }


def format_table(report: dict) -> str:
    lines = [
        f"Model: {report['model']}; {report['texts']} texts, {report['positions']} positions; index_topk "
        f"{report['index_topk']}; FP8 tile {report['kv_cache_tile_size']}; greedy {report['new_tokens']} tokens.",
        "",
        "| configuration | indexer top-k recall per DSA layer | logits KL | top-1 agreement | generate tokens equal "
        "| generate sequences identical | DSA cache bytes/token (× BF16) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        recall = ", ".join(f"{x:.4f}" for x in r["indexer_recall_per_dsa_layer"])
        lines.append(
            f"| {name} | {recall} | {r['logits_kl']:.2e} | {r['top1_agreement']:.4f} | "
            f"{r['generate_token_agreement']:.4f} | {r['generate_identical_sequences']:.4f} | "
            f"{r['cache_bytes_per_token']} ({r['cache_bytes_ratio']:.3f}) |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--docs", type=int, default=40, help="test docs per task")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report = run(args.checkpoint, args.docs, args.new_tokens)
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
