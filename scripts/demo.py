"""The README's main job: load a KDSA checkpoint with AutoModelForCausalLM, generate, report speed and cache memory.

Until the trained tiny checkpoint ships (its own issue), this builds a tiny RANDOM-WEIGHT model, saves it and loads it
back through `AutoModelForCausalLM.from_pretrained`, and says so on screen: the generated tokens are meaningless, the
mechanics (save/load, mixed KDA/DSA cache, sparse top-k over a context longer than index_topk) are real.
"""

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from modeling_kdsa import KDSAConfig, KDSAForCausalLM


def tiny_random_config() -> KDSAConfig:
    return KDSAConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        linear_num_heads=4,
        linear_head_dim=32,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        attn_res_block_size=4,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)

    print("NOTE: no trained checkpoint ships yet -- this demo uses a tiny RANDOM-WEIGHT KDSA model.")
    print("      The generated token ids are meaningless; speed, memory and the load path are real.\n")
    with tempfile.TemporaryDirectory() as folder:
        KDSAForCausalLM(tiny_random_config()).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    config = model.config
    n_params = sum(p.numel() for p in model.parameters())
    kinds = ["KDA" if t == "linear_attention" else "DSA" for t in config.layer_types]
    print(f"model: {type(model).__name__}, {n_params / 1e6:.2f} M parameters, dtype {args.dtype}")
    print(f"layers: {' '.join(kinds)}; index_topk={config.index_topk}; AttnRes block={config.attn_res_block_size}")

    prompt = torch.randint(3, config.vocab_size, (args.batch, args.prompt_tokens))
    with torch.inference_mode():
        model(prompt[:, :16])  # warm-up: first-call allocations are not what a user waits for
        start = time.perf_counter()
        model(prompt, use_cache=True)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        generated = model.generate(
            prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
            pad_token_id=config.pad_token_id, return_dict_in_generate=True,
        )  # fmt: skip
        generate_s = time.perf_counter() - start

    new_tokens = generated.sequences[:, args.prompt_tokens :]
    print(f"\nprompt: {args.batch} x {args.prompt_tokens} random token ids (context > index_topk, so DSA is sparse)")
    for row in range(args.batch):
        print(f"row {row} generated ids: {new_tokens[row, :16].tolist()} ...")
    total_new = args.batch * args.new_tokens
    print(f"\nprefill: {args.batch * args.prompt_tokens / prefill_s:,.0f} tokens/s ({prefill_s * 1e3:.0f} ms)")
    print(f"generate (prefill + {args.new_tokens} steps): {total_new / generate_s:,.1f} new tokens/s")

    usage = generated.cache.memory_bytes()  # KDSACache: exact bytes by kind
    context = args.prompt_tokens + args.new_tokens - 1
    print(f"\ncache after generation ({args.batch} sequences, {context} cached tokens each):")
    print(f"  KDA conv + recurrent states       {usage['kda_states'] / 1024:10.1f} KiB (constant in context length)")
    print(f"  DSA pages in use (latent+indexer) {usage['dsa_in_use'] / 1024:10.1f} KiB")
    print(f"  DSA page pool allocated           {usage['dsa_allocated'] / 1024:10.1f} KiB")
    print(f"  DSA bytes per cached token        {usage['per_token']:10d} B per sequence")


if __name__ == "__main__":
    main()
