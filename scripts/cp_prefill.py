"""Long-prompt prefill under context × tensor parallelism: time to first token, per-rank indexer work and
activation memory, bytes communicated per layer; a projection to 128k-1M tokens on 8-64 devices. docs/parallel.md.

    torchrun --nproc_per_node 4 scripts/cp_prefill.py --cp 2 --tp 2 --seq-len 4096
    accelerate launch --multi_gpu --num_processes 4 scripts/cp_prefill.py --cp 2 --tp 2   # also on CPU: gloo
    python scripts/cp_prefill.py --seq-len 2048            # cp = tp = 1, no launcher needed

Random weights (the timing does not depend on them). Prints a per-rank table, a per-layer communication table and
the projection, and writes everything as JSON (`--json`). Activation memory: the rise of the process's peak resident
memory during the prefill on CPU (`/proc/self/clear_refs` resets the peak), `torch.cuda.max_memory_allocated` on
CUDA. Bytes: what each rank receives (parallel/mesh.py `CommLog`), divided by the number of layers of that kind.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from modeling_kdsa.parallel import (
    SequenceLayout,
    apply_tensor_parallel,
    context_parallel_prefill,
    init_parallel_mesh,
    single_process_mesh,
)

from modeling_kdsa import KDSAConfig, KDSAForCausalLM

KIB = 1024


def bench_config(num_layers: int, index_topk: int) -> KDSAConfig:
    """The README's benchmark shape (hidden 1024, 3 KDA : 1 DSA, 16 heads, MoE 8 experts top-2), `num_layers` deep."""
    layer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    return KDSAConfig(num_hidden_layers=num_layers, layer_types=layer_types, index_topk=index_topk)


def peak_memory_start(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM to the current resident size
        handle.write("5")
    return _proc_status_kib("VmRSS") * KIB


def peak_memory_rise(device: torch.device, start: int) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - start
    return _proc_status_kib("VmHWM") * KIB - start


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(args) -> dict:
    launched = "WORLD_SIZE" in os.environ
    mesh = init_parallel_mesh(args.cp, args.tp) if launched else single_process_mesh()
    if not launched and (args.cp, args.tp) != (1, 1):
        raise SystemExit(
            "cp·tp > 1 needs cp·tp processes: torchrun --nproc_per_node N, or accelerate launch --multi_gpu "
            "--num_processes N (without --multi_gpu accelerate starts a single process, also on CPU)"
        )
    torch.manual_seed(0)
    config = bench_config(args.layers, args.index_topk)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = KDSAForCausalLM(config).to(dtype=dtype, device=mesh.device).eval()
    apply_tensor_parallel(model, mesh)
    ids = torch.randint(3, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(1))

    context_parallel_prefill(model, ids[:, : max(64, 2 * args.cp)], mesh, layout=args.layout)  # warm-up
    mesh.comm.reset()
    if dist.is_initialized():
        dist.barrier()
    memory_start = peak_memory_start(mesh.device)
    started = time.perf_counter()
    out = context_parallel_prefill(model, ids, mesh, layout=args.layout, last_token_only=True)
    ttft = time.perf_counter() - started
    activation_bytes = peak_memory_rise(mesh.device, memory_start)
    if dist.is_initialized():
        dist.barrier()

    layout = SequenceLayout(args.seq_len, args.cp, args.layout)
    rank_report = {
        "cp_rank": mesh.cp_rank,
        "tp_rank": mesh.tp_rank,
        "ttft_s": ttft,
        "indexer_pairs": out.stats.indexer_pairs,
        "indexer_pairs_causal_layout": layout.causal_pairs(mesh.cp_rank)
        * config.layer_types.count("indexed_attention"),
        "indexer_s": out.stats.indexer_seconds,
        "seconds_by_kind": out.stats.seconds_by_kind,
        "activation_bytes": activation_bytes,
        "comm_bytes": dict(mesh.comm.bytes_by_tag),
    }
    reports = [rank_report]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, rank_report)
    return {"config": config, "mesh": mesh, "reports": reports, "layout": layout}


def per_layer_bytes(report: dict, config: KDSAConfig) -> dict[str, float]:
    """Bytes received per layer of the kind each tag belongs to (the last-token hidden gather is per model)."""
    layers = {"kda": config.layer_types.count("linear_attention"), "dsa": config.layer_types.count("indexed_attention")}
    kind_of_tag = {
        "cp.kda_conv_halo": "kda",
        "cp.kda_state_summaries": "kda",
        "tp.kda_o_proj": "kda",
        "cp.dsa_latent_and_index_keys": "dsa",
        "tp.indexer_indices": "dsa",
        "tp.mla_o_proj": "dsa",
        "tp.mlp": "all",
    }
    result = {}
    for tag, num_bytes in report["comm_bytes"].items():
        kind = kind_of_tag.get(tag)
        divisor = config.num_hidden_layers if kind == "all" else layers.get(kind, 1)
        result[tag] = num_bytes / max(divisor, 1)
    return result


def projection(result: dict, args) -> list[dict]:
    """TTFT and per-rank memory at 128k-1M tokens on 8-64 devices, from this run's per-layer costs.

    Compute per rank (slowest rank): `n_kda · a_kda · T/N + n_dsa · (a_dsa · T/N + a_pair · P) + n_layers · a_mlp · T/N`
    with `P` the indexer pairs of the busiest rank, `≈ T²/(2·cp)/tp` under zigzag, and the `a_*` seconds per token
    (per pair) measured here per rank of a tp group, i.e. already divided by this run's tp. Communication adds
    bytes / `--link-gbps`. Memory per rank: all DSA layers' gathered keys `T · (C + R + DI)` plus T/cp times this run's
    activation bytes per local token (measured peak minus its gathered keys). Seconds are for devices as fast as the
    processes of this run; scale by the throughput ratio for real accelerators: the shape of the curve is the point.
    """
    config, reports = result["config"], result["reports"]
    cp, tp = args.cp, args.tp
    local_tokens = args.seq_len / cp
    n_kda = config.layer_types.count("linear_attention")
    n_dsa = config.layer_types.count("indexed_attention")
    slowest = max(reports, key=lambda r: r["ttft_s"])
    seconds = slowest["seconds_by_kind"]
    a_kda = seconds.get("kda", 0.0) / max(n_kda, 1) / local_tokens
    a_pair = slowest["indexer_s"] / max(slowest["indexer_pairs"], 1)  # both summed over the DSA layers
    a_dsa = (seconds.get("dsa", 0.0) - slowest["indexer_s"]) / max(n_dsa, 1) / local_tokens
    a_mlp = seconds.get("mlp", 0.0) / config.num_hidden_layers / local_tokens
    itemsize = 2 if args.dtype == "bf16" else 4
    key_width = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    gathered_keys = n_dsa * args.seq_len * key_width * itemsize
    memory_per_local_token = max(0, max(r["activation_bytes"] for r in reports) - gathered_keys) / local_tokens
    state_bytes = config.linear_num_heads * config.linear_head_dim * 2 * config.linear_head_dim * 4
    rows = []
    for devices in (8, 16, 32, 64):
        proj_cp = devices // tp
        for tokens in (128 * KIB, 256 * KIB, 512 * KIB, 1024 * KIB):
            local = tokens / proj_cp
            pairs = tokens * tokens / (2 * proj_cp) / tp  # busiest rank under zigzag, one DSA layer
            compute = (
                n_kda * a_kda * local
                + n_dsa * (a_dsa * local + a_pair * pairs)
                + config.num_hidden_layers * (a_mlp * local)
            )
            comm_bytes = n_dsa * (proj_cp - 1) * local * key_width * itemsize  # latent + indexer-key all-gather
            comm_bytes += n_kda * (proj_cp - 1) * 2 * state_bytes / tp  # two affine summaries per rank
            if tp > 1:  # o_proj and MLP all-reduces of the local hidden states
                comm_bytes += 2 * config.num_hidden_layers * 2 * (tp - 1) / tp * local * config.hidden_size * itemsize
            comm = comm_bytes / (args.link_gbps * 1e9)
            memory = n_dsa * tokens * key_width * itemsize + memory_per_local_token * local
            rows.append(
                {
                    "devices": devices,
                    "cp": proj_cp,
                    "tp": tp,
                    "tokens": tokens,
                    "ttft_s": compute + comm,
                    "indexer_share": n_dsa * a_pair * pairs / max(compute, 1e-12),
                    "comm_s": comm,
                    "memory_gib": memory / 2**30,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    parser.add_argument("--layers", type=int, default=4, help="model depth (3 KDA : 1 DSA)")
    parser.add_argument("--index-topk", type=int, default=512)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--link-gbps", type=float, default=100.0, help="GB/s per rank for the projection")
    parser.add_argument("--json", default="cp_prefill.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    result = measure(args)
    mesh, reports, config = result["mesh"], result["reports"], result["config"]
    if not mesh.is_first:
        dist.destroy_process_group()
        return
    print(f"prefill of {args.seq_len} tokens, cp={args.cp} tp={args.tp} layout={args.layout}, {args.dtype}, ")
    print(f"model: {config.num_hidden_layers} layers ({config.layer_types.count('indexed_attention')} DSA), hidden "
          f"{config.hidden_size}, index_topk {config.index_topk}, device {mesh.device}")  # fmt: skip
    print(f"\n{'rank(cp,tp)':>12} {'TTFT s':>8} {'indexer pairs':>14} {'indexer s':>10} {'KDA s':>7} {'DSA s':>7} "
          f"{'MLP s':>7} {'act. MiB':>9}")  # fmt: skip
    for r in reports:
        s = r["seconds_by_kind"]
        print(f"{'(' + str(r['cp_rank']) + ',' + str(r['tp_rank']) + ')':>12} {r['ttft_s']:8.2f} "
              f"{r['indexer_pairs']:14,d} {r['indexer_s']:10.2f} {s.get('kda', 0):7.2f} {s.get('dsa', 0):7.2f} "
              f"{s.get('mlp', 0):7.2f} {r['activation_bytes'] / 2**20:9.1f}")  # fmt: skip
    work = [r["indexer_pairs"] for r in reports]
    print(f"indexer work max/mean over ranks: {max(work) / (sum(work) / len(work)):.3f} (measured), "
          f"{result['layout'].imbalance():.3f} (causal pairs from the layout)")  # fmt: skip
    layer_bytes = per_layer_bytes(reports[0], config)
    print("\nbytes received per rank per layer (rank 0):")
    for tag, num_bytes in sorted(layer_bytes.items()):
        print(f"  {tag:32s} {num_bytes / KIB:12.1f} KiB")
    rows = projection(result, args)
    print(f"\nprojection (this run's per-layer costs, tp={args.tp}, {args.link_gbps:g} GB/s links):")
    print(f"{'devices':>8} {'cp':>4} {'tokens':>8} {'TTFT s':>10} {'indexer %':>10} {'comm s':>8} {'mem GiB/rank':>13}")
    for row in rows:
        print(f"{row['devices']:8d} {row['cp']:4d} {row['tokens'] // KIB:7d}k {row['ttft_s']:10.1f} "
              f"{100 * row['indexer_share']:9.0f}% {row['comm_s']:8.2f} {row['memory_gib']:13.2f}")  # fmt: skip
    with open(args.json, "w") as handle:
        json.dump(
            {
                "args": vars(args),
                "ranks": reports,
                "bytes_per_layer_rank0": layer_bytes,
                "projection": rows,
            },
            handle,
            indent=2,
        )
    print(f"\nwrote {args.json}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
