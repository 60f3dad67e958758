"""Generation with the model loaded tensor-parallel by transformers (docs/parallel.md §10): each rank reads only its
shard of the checkpoint (`from_pretrained(path, tp_plan="auto")`), then every rank generates the same batch.

    torchrun --nproc-per-node 2 scripts/tp_generate.py checkpoints/kdsa-tiny --check

Each rank prints its parameter bytes, the bytes its tp all-reduces received and, with `--check`, whether its tokens
equal those of the checkpoint loaded whole in one process (greedy, `--new-tokens` steps).
"""

import argparse

import torch
import torch.distributed as dist
from modeling_kdsa.parallel import tensor_parallel_mesh

from modeling_kdsa import KDSAForCausalLM


def parameter_bytes(model) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--check", action="store_true", help="compare with the model loaded whole in this process")
    args = parser.parse_args()

    model = KDSAForCausalLM.from_pretrained(args.checkpoint, tp_plan="auto", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=generator)
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    tokens = model.generate(ids, **options)
    mesh = tensor_parallel_mesh(model)
    received = sum(mesh.comm.bytes_by_tag.values()) if mesh is not None else 0
    line = f"rank {dist.get_rank() if dist.is_initialized() else 0}: parameter bytes {parameter_bytes(model)}"
    line += f", all-reduce bytes received {received}"
    if args.check:
        whole = KDSAForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
        line += f" (whole model {parameter_bytes(whole)}), tokens equal to one process: "
        line += str(torch.equal(tokens, whole.generate(ids, **options)))
    print(line, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
