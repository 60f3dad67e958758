"""What the generation launchers (tp_generate.py, ep_generate.py, prefill_decode.py) share: their common arguments,
the seeded random prompts, greedy options, and the bytes a rank holds."""

import argparse

import torch


def launcher_parser(doc: str, batch: int, prompt_len: int) -> argparse.ArgumentParser:
    """A parser with the checkpoint, the batch of random prompts, the greedy steps and `--check`; each launcher adds
    its layout options."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--check", action="store_true", help="compare with the model loaded whole in this process")
    return parser


def random_prompts(vocab_size: int, batch: int, prompt_len: int) -> torch.Tensor:
    """The same prompts on every rank (seeded), avoiding ids 0-2 (pad, bos, eos of the shipped tokenizer)."""
    return torch.randint(3, vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))


def greedy_options(new_tokens: int) -> dict:
    """`generate()` options for exactly `new_tokens` greedy steps."""
    return dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def held_bytes(model) -> int:
    """Bytes of the parameters and buffers a rank holds (packed MXFP4 experts are buffers)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
