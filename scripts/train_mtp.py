"""Train one MTP layer (modeling_kdsa/mtp.py) for the shipped tiny target `checkpoints/kdsa-tiny`, on CPU, on the
target's own greedy generations, and add it to the checkpoint.

    .venv/bin/python scripts/train_mtp.py                # train, report, write the MTP tensors into the checkpoint
    .venv/bin/python scripts/train_mtp.py --dry-run      # train and report only

Data: prompts from the training distribution of the eval tasks (eval/synthetic.py, as scripts/train_tiny.py draws
them): copy prompts `copy s_1 .. s_L |` (L = 8..64) and key-value prompts (8..64 pairs, a few answered queries, then
one open query), fresh random contexts, none equal to a held-out eval context. The frozen target continues each
prompt greedily (`generate`, 64 tokens for copy, 32 for key-value); its final normed hidden states over the whole
sequence are computed once.

Model: the MTP layer reads (h_i, t_{i+1}) and predicts t_{i+2} (DeepSeek-V3 §2.2). Its block starts as a copy of the
target's last DSA + MoE layer (layer 3: attention, trained indexer, experts; the AttnRes queries have no place in the
plain-residual block), `eh_proj` as [I | I] (the block first sees enorm(emb) + hnorm(h)), the norms at one. The
trunk, the embedding and the lm_head are frozen. Training runs the block's DSA layer densely and distils its indexer
from that attention (scripts/train_tiny.py's dense training step); evaluation runs the real sparse layer.

Loss, on the generated positions (where t_{i+2} is the target's own greedy token): CE(MTP logits at i, t_{i+2}) plus
`--kl-weight` x KL(target's next-step distribution at i+1 || MTP's), plus the indexer's distillation loss. Reported:
training time, and on held-out generations the acceptance rate of greedy drafting = how often the MTP's top-1 at i
equals the target's greedy token at i+1 (the argmax of the target's logits there), per task and overall.

Writing (`checkpoints/kdsa-tiny`, unless --dry-run): the MTP tensors are added to model.safetensors and
`num_mtp_layers: 1` to config.json; every existing tensor is checked bit-identical after the write, and the
checkpoint is reloaded to check that the MTP layer gives the reported acceptance.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from modeling_kdsa.eval import synthetic
from modeling_kdsa.eval.make_data import SPLITS, TASKS, load_docs
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modeling_kdsa import KDSAForCausalLM
from modeling_kdsa.mtp import KDSAMultiTokenPredictor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from train_tiny import dense_training_forward  # noqa: E402  (the target's own dense DSA training step)

CHECKPOINT = ROOT / "checkpoints" / "kdsa-tiny"
GENERATED = {"copy": 64, "key_value": 32}  # tokens the target generates after a prompt of each task


def prompt_words(rng: random.Random, task: str) -> list[str]:
    if task == "copy":
        length = rng.randint(8, synthetic.EVAL_COPY_LENGTH)
        words, _ = synthetic.copy_example(rng, length)
        return words[: length + 2]  # `copy s_1 .. s_L |`
    pairs = rng.randint(8, synthetic.EVAL_NUM_PAIRS)
    words, _ = synthetic.key_value_example(rng, pairs, num_queries=rng.randint(1, min(8, pairs)))
    return words[:-1]  # ends with the last query's key: its answer is the first generated token


def held_out_signatures() -> set[str]:
    return {synthetic.context_signature(doc["context"].split())
            for task in TASKS for split in SPLITS for doc in load_docs(task, split)}  # fmt: skip


@torch.no_grad()
def make_sequences(target, tokenizer, rng: random.Random, count: int, batch_size: int, held_out: set[str]) -> list:
    """`count` sequences: (task, ids [T], prompt length, hidden [T, D]) with the target's greedy continuation."""
    sequences = []
    while len(sequences) < count:
        task = "copy" if rng.random() < 0.5 else "key_value"
        prompts = []
        while len(prompts) < batch_size:
            words = prompt_words(rng, task)
            if synthetic.context_signature(words) not in held_out:
                prompts.append(tokenizer.convert_tokens_to_ids(words))
        # One batch per prompt length would need no padding; left-pad instead and keep each row's real tokens.
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=GENERATED[task], min_new_tokens=GENERATED[task],
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        for row, prompt in zip(out, prompts, strict=True):
            sequence = row[width - len(prompt) :]
            hidden = target.model(sequence[None]).last_hidden_state[0]
            sequences.append((task, sequence, len(prompt), hidden))
    return sequences[:count]


def batch_tensors(sequences: list) -> tuple[torch.Tensor, ...]:
    """Right-padded `ids [B, T]`, `hidden [B, T, D]` and the loss mask `[B, T-2]` over MTP positions i whose target
    t_{i+2} is a generated token (right padding never reaches a real position: the block is causal)."""
    width = max(len(s[1]) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    hidden = torch.zeros(len(sequences), width, sequences[0][3].shape[-1])
    mask = torch.zeros(len(sequences), width - 2, dtype=torch.bool)
    for b, (_, sequence, prompt_len, states) in enumerate(sequences):
        ids[b, : len(sequence)] = sequence
        hidden[b, : len(sequence)] = states
        mask[b, prompt_len - 2 : len(sequence) - 2] = True
    return ids, hidden, mask


def mtp_logits(target, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """MTP logits at positions 0 .. T-3 (inputs h_i, t_{i+1}; predicts t_{i+2})."""
    return target.mtp.logits(0, target.mtp(0, hidden[:, :-2], ids[:, 1:-1]))


@torch.no_grad()
def acceptance(target, sequences: list, batch_size: int) -> dict[str, float]:
    """Share of generated positions where the MTP's top-1 at i equals the target's greedy token at i+1."""
    hits, totals = {}, {}
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        ids, hidden, mask = batch_tensors(chunk)
        drafted = mtp_logits(target, ids, hidden).argmax(-1)
        greedy = target.lm_head(hidden[:, 1:-1]).argmax(-1)
        for b, (task, *_) in enumerate(chunk):
            hits[task] = hits.get(task, 0) + int((drafted[b] == greedy[b])[mask[b]].sum())
            totals[task] = totals.get(task, 0) + int(mask[b].sum())
    result = {task: hits[task] / totals[task] for task in sorted(totals)}
    result["all"] = sum(hits.values()) / sum(totals.values())
    return result


def build_mtp(target) -> None:
    """Attach a fresh MTP layer: block = the target's layer 3 (DSA + MoE) without its AttnRes modules, eh_proj =
    [I | I], norms at one; only the MTP layer trains."""
    target.config.num_mtp_layers = 1
    target.mtp = KDSAMultiTokenPredictor(target.config)
    target.mtp.bind(target)
    target.mtp.apply(target._init_weights)
    layer = target.mtp.layers[0]
    source = target.model.layers[3].state_dict()
    missing, unexpected = layer.block.load_state_dict(source, strict=False)
    assert not missing and all(k.startswith(("attention_res", "mlp_res")) for k in unexpected), (missing, unexpected)
    hidden = target.config.hidden_size
    with torch.no_grad():
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    for parameter in target.mtp.parameters():
        parameter.requires_grad_(True)


def dense_training(target, enabled: bool) -> list:
    """Training runs the MTP block's DSA layer densely and distils its indexer from that attention, as
    scripts/train_tiny.py trains the target (the top-k selection has no gradient); evaluation runs it sparse."""
    attention = target.mtp.layers[0].block.self_attn
    if not enabled:
        del attention.forward, attention.indexer_losses
        return []

    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, **_):
        return dense_training_forward(attention, hidden_states, position_embeddings, attention_mask, cache)

    attention.forward = forward
    attention.indexer_losses = []
    return attention.indexer_losses


def write_checkpoint(target, folder: Path) -> list[str]:
    """Add the MTP tensors to model.safetensors and num_mtp_layers to config.json; check every existing tensor is
    bit-identical afterwards. Returns the names written."""
    weights = folder / "model.safetensors"
    with safe_open(weights, framework="pt") as f:
        metadata = f.metadata()
    before = load_file(weights)
    if any(name.startswith("mtp.") for name in before):
        raise ValueError(f"{weights} already holds MTP tensors; restore the checkpoint before retraining")
    mtp = {f"mtp.{name}": tensor.detach().contiguous().clone() for name, tensor in target.mtp.state_dict().items()}
    save_file(before | mtp, weights, metadata=metadata)
    after = load_file(weights)
    for name, tensor in before.items():
        if after[name].dtype != tensor.dtype or not torch.equal(after[name], tensor):
            raise RuntimeError(f"{name} changed while the MTP tensors were written")
    assert set(after) == set(before) | set(mtp)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["num_mtp_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(mtp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    parser.add_argument("--train-sequences", type=int, default=1024)
    parser.add_argument("--val-sequences", type=int, default=128)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--kl-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="train and report; do not write the checkpoint")
    parser.add_argument("--data", type=Path, help="file keeping the generated sequences between runs (read if present)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    # A checkpoint that already ships an MTP layer is refused by write_checkpoint; its trunk loads either way.
    target = KDSAForCausalLM.from_pretrained(args.checkpoint, num_mtp_layers=0).eval()
    tokenizer = synthetic.build_tokenizer()
    held_out = held_out_signatures()

    start = time.perf_counter()
    if args.data is not None and args.data.exists():
        train, val = torch.load(args.data)
    else:
        train = make_sequences(target, tokenizer, rng, args.train_sequences, args.batch_size, held_out)
        val = make_sequences(target, tokenizer, rng, args.val_sequences, args.batch_size, held_out)
        if args.data is not None:
            torch.save((train, val), args.data)
    data_seconds = time.perf_counter() - start
    print(f"data: {len(train)} train / {len(val)} val target generations in {data_seconds:.0f} s")

    build_mtp(target)
    print(f"acceptance before training (block = layer 3 copy): {acceptance(target, val, args.batch_size)}")
    optimizer = torch.optim.AdamW(target.mtp.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.steps, pct_start=0.1)
    start = time.perf_counter()
    target.mtp.train()
    indexer_losses = dense_training(target, True)
    for step in range(args.steps):
        ids, hidden, mask = batch_tensors(rng.sample(train, args.batch_size))
        logits = mtp_logits(target, ids, hidden)[mask]
        ce = F.cross_entropy(logits, ids[:, 2:][mask])
        indexer_loss = indexer_losses.pop()
        loss = ce + indexer_loss
        if args.kl_weight:
            with torch.no_grad():
                teacher = F.log_softmax(target.lm_head(hidden[:, 1:-1][mask]), dim=-1)
            kl = F.kl_div(F.log_softmax(logits, dim=-1), teacher, log_target=True, reduction="batchmean")
            loss = loss + args.kl_weight * kl
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.mtp.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            hits = (logits.argmax(-1) == ids[:, 2:][mask]).float().mean()
            print(f"step {step}: loss {loss.item():.3f} (CE {ce.item():.3f}, indexer {indexer_loss.item():.3f}), "
                  f"batch top-1 {hits.item():.3f}")
    train_seconds = time.perf_counter() - start
    dense_training(target, False)
    target.mtp.eval()
    accepted = acceptance(target, val, args.batch_size)
    print(f"training: {args.steps} steps in {train_seconds:.0f} s (data {data_seconds:.0f} s), one thread")
    print(f"validation acceptance (MTP top-1 == target greedy): {accepted}")
    if args.dry_run:
        return
    written = write_checkpoint(target, args.checkpoint)
    reloaded = KDSAForCausalLM.from_pretrained(args.checkpoint).eval()
    again = acceptance(reloaded, val, args.batch_size)
    if again != accepted:
        raise RuntimeError(f"the reloaded checkpoint's acceptance {again} differs from {accepted}")
    print(f"wrote {len(written)} MTP tensors and num_mtp_layers=1 into {args.checkpoint}; existing tensors unchanged")


if __name__ == "__main__":
    main()
