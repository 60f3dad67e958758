"""Prefill a batch of long prompts over a (cp, tp) mesh, then decode them over (tp, ep) on the same ranks from the
prefill's cache (docs/parallel.md §11).

    torchrun --nproc_per_node 2 scripts/prefill_decode.py checkpoints/kdsa-tiny --cp 2 --decode-tp 2 --check
    torchrun --nproc_per_node 4 scripts/prefill_decode.py checkpoints/kdsa-tiny --cp 2 --tp 2 --decode-tp 2 \\
        --decode-ep 2 --check
    accelerate launch --multi_gpu --num_processes 4 scripts/prefill_decode.py checkpoints/kdsa-tiny --cp 2 --tp 2 \\
        --decode-tp 2 --decode-ep 2 --mesh accelerate

`--mesh accelerate` builds the prefill mesh with accelerate's `ParallelismConfig(cp_size, tp_size)` (it has no
expert dim; the hand-over builds the decode mesh). Each rank prints its decode rank, rows and parameter bytes;
`--check` also runs the unsharded model's `generate()` on the whole batch and compares this rank's tokens.
"""

import torch
import torch.distributed as dist
from launcher_common import greedy_options, held_bytes, launcher_parser, random_prompts
from modeling_kdsa.parallel import (
    apply_tensor_parallel,
    context_parallel_prefill,
    hand_over_to_decode,
    init_parallel_mesh,
)
from modeling_kdsa.parallel.mesh import default_device_and_backend, mesh_from_device_mesh

from modeling_kdsa import KDSAForCausalLM
from modeling_kdsa.cache import KDSACache


def prefill_mesh(args):
    if args.mesh == "torch":
        return init_parallel_mesh(args.cp, args.tp)
    from accelerate import ParallelismConfig, PartialState

    PartialState()  # joins the launcher's process group
    device_type, _ = default_device_and_backend()
    return mesh_from_device_mesh(ParallelismConfig(cp_size=args.cp, tp_size=args.tp).build_device_mesh(device_type))


def main() -> None:
    parser = launcher_parser(__doc__, batch=2, prompt_len=64)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--decode-ep", type=int, default=1)
    parser.add_argument("--mesh", choices=("torch", "accelerate"), default="torch")
    args = parser.parse_args()

    mesh = prefill_mesh(args)
    model = KDSAForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    full_bytes = held_bytes(model)
    ids = random_prompts(model.config.vocab_size, args.batch, args.prompt_len).to(mesh.device)
    model = apply_tensor_parallel(model.to(mesh.device), mesh)
    prefill_bytes = held_bytes(model)
    cache = KDSACache(model.config)
    context_parallel_prefill(model, ids[:, :-1], mesh, cache=cache)
    decode = hand_over_to_decode(model, cache, mesh, tp_size=args.decode_tp, ep_size=args.decode_ep)
    options = greedy_options(args.new_tokens)
    tokens = decode.model.generate(ids[decode.rows], cache=decode.cache, synced_gpus=args.decode_ep > 1, **options)
    line = (
        f"rank {dist.get_rank()}: prefill (cp {mesh.cp_rank}, tp {mesh.tp_rank}) -> decode (ep {decode.mesh.ep_rank}, "
        f"tp {decode.mesh.tp.tp_rank}), rows {decode.rows.start}-{decode.rows.stop - 1}, parameter bytes "
        f"{prefill_bytes} (prefill) / {held_bytes(decode.model)} (decode) of {full_bytes}"
    )
    if args.check:
        reference = KDSAForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval().to(mesh.device)
        line += f", tokens equal to one process: {torch.equal(tokens, reference.generate(ids, **options)[decode.rows])}"
    print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
