"""Greedy generation under expert parallelism (docs/parallel.md §9): every ep rank generates its share of a batch of
random prompts with the routed experts split over the ep ranks (and the model cut by tp inside each tp group).

    torchrun --nproc_per_node 2 scripts/ep_generate.py checkpoints/kdsa-tiny --ep 2
    torchrun --nproc_per_node 4 scripts/ep_generate.py checkpoints/kdsa-tiny --tp 2 --ep 2 --check

Each rank prints its rows, the all-to-all elements it sent, and its parameter bytes against the unsharded model's;
`--check` also generates the whole batch with an unsharded copy and compares this rank's tokens with it.
"""

import argparse

import torch
from modeling_kdsa.parallel import apply_expert_parallel, init_expert_parallel_mesh

from modeling_kdsa import KDSAForCausalLM


def parameter_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--check", action="store_true", help="compare with the unsharded model on the whole batch")
    args = parser.parse_args()

    mesh = init_expert_parallel_mesh(tp_size=args.tp, ep_size=args.ep)
    model = KDSAForCausalLM.from_pretrained(args.checkpoint).eval()
    full_bytes = parameter_bytes(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=generator)
    rows = mesh.batch_rows(args.batch)
    model = apply_expert_parallel(model, mesh)
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    mesh.traffic.reset()
    tokens = model.generate(ids[rows], synced_gpus=True, **options)
    line = (
        f"rank {torch.distributed.get_rank()} (ep {mesh.ep_rank}, tp {mesh.tp.tp_rank}): rows {rows.start}-"
        f"{rows.stop - 1}, sent {mesh.traffic.dispatched_elements} elements in {mesh.traffic.dispatched_rows} routed "
        f"rows ({mesh.traffic.remote_rows} to other ranks), bytes {parameter_bytes(model)} of {full_bytes}"
    )
    if args.check:
        reference = KDSAForCausalLM.from_pretrained(args.checkpoint).eval().generate(ids, **options)[rows]
        line += f", tokens equal to one process: {torch.equal(tokens, reference)}"
    print(line, flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
