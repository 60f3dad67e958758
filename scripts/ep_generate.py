"""Greedy generation under expert parallelism (docs/parallel.md §9, §10): the model is loaded with
`from_pretrained(path, distributed_config={"tp_size": tp, "ep_size": ep})`, each rank reading only its experts (and
tp slices), and every ep rank generates its share of a batch of random prompts.

    torchrun --nproc_per_node 2 scripts/ep_generate.py checkpoints/kdsa-tiny --ep 2
    torchrun --nproc_per_node 4 scripts/ep_generate.py checkpoints/kdsa-tiny --tp 2 --ep 2 --check

Each rank prints its rows, the all-to-all elements it sent, and its parameter bytes against the unsharded model's;
`--check` also generates the whole batch with a copy loaded whole and compares this rank's tokens with it.
"""

import torch
from launcher_common import greedy_options, held_bytes, launcher_parser, random_prompts
from modeling_kdsa.parallel import expert_parallel_mesh_of

from modeling_kdsa import KDSAForCausalLM


def main() -> None:
    parser = launcher_parser(__doc__, batch=4, prompt_len=32)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=2)
    args = parser.parse_args()

    layout = {"tp_size": args.tp, "ep_size": args.ep}  # a dict: DistributedConfig refuses tp_size=1, ep_size=2
    model = KDSAForCausalLM.from_pretrained(args.checkpoint, distributed_config=layout).eval()
    mesh = expert_parallel_mesh_of(model)
    ids = random_prompts(model.config.vocab_size, args.batch, args.prompt_len)
    rows = mesh.batch_rows(args.batch)
    options = greedy_options(args.new_tokens)
    mesh.traffic.reset()
    tokens = model.generate(ids[rows], synced_gpus=True, **options)
    line = (
        f"rank {torch.distributed.get_rank()} (ep {mesh.ep_rank}, tp {mesh.tp.tp_rank}): rows {rows.start}-"
        f"{rows.stop - 1}, sent {mesh.traffic.dispatched_elements} elements in {mesh.traffic.dispatched_rows} routed "
        f"rows ({mesh.traffic.remote_rows} to other ranks), bytes {held_bytes(model)}"
    )
    if args.check:
        whole = KDSAForCausalLM.from_pretrained(args.checkpoint).eval()
        reference = whole.generate(ids, **options)[rows]
        line += f" of {held_bytes(whole)}, tokens equal to one process: {torch.equal(tokens, reference)}"
    print(line, flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
