"""The README's main job: load the shipped KDSA checkpoint, generate, report speed and cache memory.

    .venv/bin/python scripts/demo.py [--checkpoint DIR] [--dtype float32|bfloat16] [--batch N] [--threads N]

Loads `checkpoints/kdsa-tiny` (trained here by scripts/train_tiny.py; no download) with
`AutoModelForCausalLM.from_pretrained`, then
1. asks it a recall question whose needle sits further back than `index_topk` tokens (so a window of that many recent
   tokens could not see it; the Lightning Indexer has to find it) and prints the prompt and the decoded answer;
2. copies a batch of 64-key sequences with `generate()` and reports prefill and generation tokens/s;
3. prints the cache memory by kind (`KDSACache.memory_bytes()`);
4. decodes a copy and a recall prompt with plain greedy, prompt lookup (`prompt_lookup_num_tokens`), the
   checkpoint's MTP layer (`use_mtp=True`), the DSpark draft `checkpoints/kdsa-tiny-dspark`
   (`speculation_type="dspark"`) and the small draft model `checkpoints/kdsa-tiny-draft` (`assistant_model`), shows
   that all give plain greedy's tokens, and prints tokens/s, the speed-up, tau (new tokens per target forward) and,
   for MTP and DSpark, how many rounds drafted. An output that differs must differ first at a near-tie of plain
   greedy's scores (`speculative.first_difference`: possible where a verify forward rounds differently from
   one-token steps, docs/speculative.md §2), else the demo exits with an error.
"""

import argparse
import logging
import time
from pathlib import Path

# Library noise a user of this demo cannot act on, silenced before the libraries load: torchao (a test dependency,
# imported by transformers' quantizer registry) logs that its CUDA-only extensions do not load on a CPU machine, and
# torch warns about torchao's enum registrations.
for noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(noisy).setLevel(logging.ERROR)

import torch  # noqa: E402
import transformers  # noqa: E402
from modeling_kdsa.eval.make_data import load_docs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from modeling_kdsa import DSparkDraftModel  # noqa: E402  (importing the package registers the architecture)
from modeling_kdsa.speculative import TokenDifference, first_difference  # noqa: E402

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "kdsa-tiny"
DEFAULT_DRAFT = DEFAULT_CHECKPOINT.with_name("kdsa-tiny-draft")
DEFAULT_DSPARK = DEFAULT_CHECKPOINT.with_name("kdsa-tiny-dspark")


def shorten(text: str, head: int = 8, tail: int = 6) -> str:
    words = text.split()
    if len(words) <= head + tail:
        return text
    return " ".join(words[:head] + [f"... ({len(words) - head - tail} words) ..."] + words[-tail:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=4, help="copy prompts generated together")
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT),
                        help="assistant model (same tokenizer); '' skips assisted decoding")  # fmt: skip
    parser.add_argument("--dspark", default=str(DEFAULT_DSPARK), help="DSpark draft folder; '' skips DSpark")
    # One thread by default: on a shared 2-core machine two OpenMP threads waiting for each other ran a prefill
    # ~100x slower than one (measured). Raise it on a quiet many-core machine.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # the tiny checkpoint loads in a blink

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype)).eval()
    config = model.config
    n_params = sum(p.numel() for p in model.parameters())
    kinds = ["KDA" if t == "linear_attention" else "DSA" for t in config.layer_types]
    print(f"checkpoint: {args.checkpoint}")
    print(f"model: {type(model).__name__}, {n_params / 1e6:.2f} M parameters, dtype {args.dtype}")
    print(f"layers: {' '.join(kinds)}; index_topk={config.index_topk}; AttnRes block={config.attn_res_block_size}; "
          f"MoE {config.n_routed_experts} experts top-{config.num_experts_per_tok}")  # fmt: skip

    # 1. Recall: the first held-out doc whose needle is more than index_topk tokens back.
    doc = next(d for d in load_docs("recall_far") if d["distance"] > config.index_topk)
    ids = tokenizer(doc["context"], return_tensors="pt").input_ids
    with torch.inference_mode():
        answer_ids = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=config.pad_token_id)
    answer = tokenizer.decode(answer_ids[0, ids.shape[1] :]).strip()  # a continuation decodes with its space
    needle = doc["context"].split()[-1]
    print(f"\nrecall prompt ({ids.shape[1]} tokens): {shorten(doc['context'])}")
    print(f"  the pair '{needle} {doc['target']}' sits {doc['distance']} tokens before the question "
          f"(> index_topk={config.index_topk})")  # fmt: skip
    print(f"  model answer: {answer!r}   expected: {doc['target']!r}   {'OK' if answer == doc['target'] else 'WRONG'}")

    # 2. Copy a batch with generate(): prefill and decode speed.
    docs = load_docs("copy")[: args.batch]
    prompts = tokenizer([d["context"] for d in docs], return_tensors="pt").input_ids
    new_tokens = len(docs[0]["target"].split())
    with torch.inference_mode():
        model(prompts[:, :16])  # warm-up: first-call allocations are not what a user waits for
        start = time.perf_counter()
        model(prompts, use_cache=True)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        generated = model.generate(
            prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=config.pad_token_id, return_dict_in_generate=True,
        )  # fmt: skip
        generate_s = time.perf_counter() - start
    outputs = tokenizer.batch_decode(generated.sequences[:, prompts.shape[1] :])
    exact = sum(out.strip() == d["target"] for out, d in zip(outputs, docs, strict=True))
    print(f"\ncopy prompt: {shorten(docs[0]['context'])}")
    print(f"  generated:  {shorten(outputs[0])}")
    print(f"  {exact}/{len(docs)} copies exact ({new_tokens} keys each, the source {new_tokens + 1} tokens back)")
    total_new = args.batch * new_tokens
    print(f"\nprefill: {prompts.numel() / prefill_s:,.0f} tokens/s ({args.batch} x {prompts.shape[1]} tokens, "
          f"{prefill_s * 1e3:.0f} ms)")  # fmt: skip
    print(f"generate (prefill + {new_tokens} steps, batch {args.batch}): {total_new / generate_s:,.1f} new tokens/s")

    usage = generated.cache.memory_bytes()  # KDSACache: exact bytes by kind
    context = prompts.shape[1] + new_tokens - 1
    print(f"\ncache after generation ({args.batch} sequences, {context} cached tokens each):")
    print(f"  KDA conv + recurrent states       {usage['kda_states'] / 1024:10.1f} KiB (constant in context length)")
    print(f"  DSA pages in use (latent+indexer) {usage['dsa_in_use'] / 1024:10.1f} KiB")
    print(f"  DSA page pool allocated           {usage['dsa_allocated'] / 1024:10.1f} KiB")
    print(f"  DSA bytes per cached token        {usage['per_token']:10d} B per sequence")

    # 4. Speculative decoding: the rollback (KDSACache.crop) is exact, so every method must return plain greedy's
    # tokens; tau = new tokens per target forward; for MTP and DSpark, the rounds that drafted (the default adaptive
    # schedule drafts while drafting pays, docs/speculative.md §2a).
    transformers.logging.set_verbosity_error()  # transformers' assistant loop warns about its own call on every run
    methods = speculative_methods(args, model)
    for name, prompt, steps in (("copy", prompts[:1], new_tokens), ("recall", ids, 32)):  # the prompts above
        print(f"\nspeculative decoding, {name} prompt ({prompt.shape[1]} tokens), batch 1, {steps} new tokens:")
        print(f"  {'method':34s} {'tokens/s':>9s} {'speed-up':>8s} {'tau':>5s} {'drafted':>8s}")
        greedy = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=config.pad_token_id)
        plain, plain_seconds, plain_scores, notes, differing = None, None, None, [], []
        for method, extra in methods.items():
            seconds, forwards, out = time_generate(model, prompt, greedy, extra)
            if plain is None:
                plain, plain_seconds = out, seconds
            verdict = "same tokens as plain greedy"
            if not torch.equal(out, plain):
                if plain_scores is None:  # only where an output differs: plain greedy again, with its scores
                    plain_scores = plain_greedy_scores(model, prompt, greedy)
                difference = first_difference(plain, out, plain_scores, model.dtype)
                verdict = "differs at a near-tie" if difference.near_tie else "DIFFERENT TOKENS"
                notes.append(f"  {method}: {describe_difference(difference, tokenizer, model.dtype)}")
                if not difference.near_tie:
                    differing.append(method)
            drafted = "—"
            if extra.get("use_mtp") or extra.get("speculation_type"):  # KDSA's drafting loop keeps its statistics
                stats = model.speculation_stats
                drafted = f"{stats.rounds - stats.plain_rounds}/{stats.rounds}"  # lookup rounds included
            print(f"  {method:34s} {steps / seconds:9.1f} {plain_seconds / seconds:7.2f}x {steps / forwards:5.2f} "
                  f"{drafted:>8s}  {verdict}")  # fmt: skip
        if notes:
            print("\n".join(notes))
        if differing:  # the rollback is exact, so a difference away from a near-tie is a bug
            raise SystemExit(f"speculative output differs from plain greedy for: {', '.join(differing)}")


def plain_greedy_scores(model, prompt, greedy: dict) -> tuple[torch.Tensor, ...]:
    """Plain greedy's processed scores, one `[B, V]` per new token (a rerun: plain greedy is deterministic)."""
    with torch.inference_mode():
        return model.generate(prompt, **greedy, output_scores=True, return_dict_in_generate=True).scores


def describe_difference(difference: TokenDifference, tokenizer, dtype) -> str:
    plain_word, word = tokenizer.decode(difference.plain_token).strip(), tokenizer.decode(difference.token).strip()
    what = (
        f"plain greedy's scores for {plain_word!r} and {word!r} there differ by {difference.gap:.4g}, "
        f"{difference.gap / difference.ulp:.1f} {str(dtype).removeprefix('torch.')} spacings"
    )
    if difference.near_tie:  # docs/speculative.md §2: a verify forward rounds differently from one-token steps
        return f"new token {difference.position} is a near-tie: {what}; the verify forward rounded the other way"
    return f"new token {difference.position} differs: {what} (not a near-tie)"


def speculative_methods(args, model) -> dict[str, dict]:
    """generate() keywords per method: plain, prompt lookup, the checkpoint's MTP layer, a DSpark draft alone and
    with prompt lookup first (docs/speculative.md §2b), and an assistant model (each only where the checkpoint or
    folder is there)."""
    dtype = getattr(torch, args.dtype)
    methods = {"plain greedy": {}, "prompt lookup (10 tokens)": {"prompt_lookup_num_tokens": 10}}
    if getattr(model.config, "num_mtp_layers", 0):
        methods["MTP layer (use_mtp=True)"] = {"use_mtp": True}
    if args.dspark:
        draft = DSparkDraftModel.from_pretrained(args.dspark, dtype=dtype)
        methods[f"DSpark ({Path(args.dspark).name})"] = {"assistant_model": draft, "speculation_type": "dspark"}
        # The lookup-first hybrid: the text's own continuation where it has one, DSpark otherwise (§2b).
        methods["DSpark + prompt lookup"] = {"assistant_model": draft, "speculation_type": "dspark",
                                             "prompt_lookup_num_tokens": 10}  # fmt: skip
    if args.draft:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval()
        methods[f"assisted ({Path(args.draft).name})"] = {"assistant_model": draft}
    return methods


def time_generate(model, ids, greedy: dict, extra: dict) -> tuple[float, int, torch.Tensor]:
    """One warm-up call (first-call allocations), then one timed call; returns (seconds, target forwards, output)."""
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with torch.inference_mode():
        model.generate(ids, **greedy, **extra)
        forwards.clear()
        start = time.perf_counter()
        out = model.generate(ids, **greedy, **extra)
        seconds = time.perf_counter() - start
    hook.remove()
    return seconds, len(forwards), out


if __name__ == "__main__":
    main()
