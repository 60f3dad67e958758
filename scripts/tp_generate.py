"""Generation with the model loaded tensor-parallel by transformers (docs/parallel.md §10): each rank reads only its
shard of the checkpoint (`from_pretrained(path, tp_plan="auto")`), then every rank generates the same batch.

    torchrun --nproc-per-node 2 scripts/tp_generate.py checkpoints/kdsa-tiny --check

Each rank prints the bytes of its parameters and buffers, the bytes its tp all-reduces received and, with `--check`,
whether its tokens equal those of the checkpoint loaded whole in one process (greedy, `--new-tokens` steps).
"""

import torch
import torch.distributed as dist
from launcher_common import greedy_options, held_bytes, launcher_parser, random_prompts
from modeling_kdsa.parallel import tensor_parallel_mesh

from modeling_kdsa import KDSAForCausalLM


def main() -> None:
    args = launcher_parser(__doc__, batch=2, prompt_len=32).parse_args()

    model = KDSAForCausalLM.from_pretrained(args.checkpoint, tp_plan="auto", dtype=torch.float32).eval()
    ids = random_prompts(model.config.vocab_size, args.batch, args.prompt_len)
    options = greedy_options(args.new_tokens)
    tokens = model.generate(ids, **options)
    mesh = tensor_parallel_mesh(model)
    received = sum(mesh.comm.bytes_by_tag.values()) if mesh is not None else 0
    line = f"rank {dist.get_rank() if dist.is_initialized() else 0}: parameter and buffer bytes {held_bytes(model)}"
    line += f", all-reduce bytes received {received}"
    if args.check:
        whole = KDSAForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
        line += f" (whole model {held_bytes(whole)}), tokens equal to one process: "
        line += str(torch.equal(tokens, whole.generate(ids, **options)))
    print(line, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
