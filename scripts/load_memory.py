"""Memory while loading a model sharded (`from_pretrained(path, distributed_config=DistributedConfig(tp_size=N))`,
docs/parallel.md §10) against
loading it whole in one process: what each rank holds and how far its memory rises on the way.

    torchrun --nproc-per-node 2 scripts/load_memory.py --out /tmp/load_memory.json

Rank 0 saves a randomly initialised KDSA model of `--layers` layers and `--hidden` width (fp32, about 270 MiB at the
defaults) into a temporary folder; every rank then loads it sharded and reads every tensor it holds while a thread
samples /proc/self/status every 2 ms, and afterwards does the same with the whole model (one process's load, for
comparison). Per load it reports the parameter and buffer bytes held and the peak growth over the values before the
load of anonymous memory (`RssAnon`: copies) and of file-backed memory (`RssFile`: pages of the memory-mapped
safetensors file, resident once read).
Linux only (/proc). Rank 0 prints the table and writes the JSON.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from bench_verify_cost import cpu_name
from launcher_common import held_bytes
from transformers.distributed import DistributedConfig

from modeling_kdsa import KDSAConfig, KDSAForCausalLM

MIB = 2**20
SAMPLE_S = 0.002


def _status_kib() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                fields[name] = int(value.split()[0])
    return fields


class PeakMemory:
    """Peak growth of `RssAnon` and `RssFile` over their values at entry, sampled every `SAMPLE_S` by a thread."""

    def __enter__(self):
        self.before = _status_kib()
        self.peak = dict(self.before)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            for name, value in _status_kib().items():
                self.peak[name] = max(self.peak[name], value)
            time.sleep(SAMPLE_S)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        for name, value in _status_kib().items():
            self.peak[name] = max(self.peak[name], value)

    def growth_mib(self, name: str) -> float:
        return (self.peak[name] - self.before[name]) * 1024 / MIB


def _config(layers: int, hidden: int) -> KDSAConfig:
    """KDA and DSA layers in turn, dense MLPs: every weight cut by tp (heads, intermediate dim, vocabulary rows)."""
    heads = hidden // 128
    return KDSAConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, linear_num_heads=heads, linear_head_dim=128, kv_lora_rank=256, q_lora_rank=512,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=4, index_head_dim=64,
        layer_types=["linear_attention", "indexed_attention"] * (layers // 2), mlp_layer_types=["dense"] * layers,
        num_mtp_layers=0, tie_word_embeddings=False,
    )  # fmt: skip


def _load(folder: str, **kwargs) -> dict:
    """One load, then one read of every held tensor: a tensor that is a view of the memory-mapped file is resident
    only once read, so the peak covers what using the model costs."""
    with PeakMemory() as memory:
        model = KDSAForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.sum()
    row = {
        "held_mib": held_bytes(model) / MIB,
        "peak_anon_growth_mib": memory.growth_mib("RssAnon"),
        "peak_file_growth_mib": memory.growth_mib("RssFile"),
    }
    del model
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--out", help="write the JSON here (rank 0)")
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        sys.exit("launch with torchrun --nproc-per-node N (see the docstring)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as scratch:
        holder = [os.path.join(scratch, "model")]
        if rank == 0:
            torch.manual_seed(0)
            KDSAForCausalLM(_config(args.layers, args.hidden)).save_pretrained(holder[0])
        dist.broadcast_object_list(holder)  # rank 0's folder: one file system, as torchrun on one node gives
        folder = holder[0]
        file_mib = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / MIB
        sharded = _load(folder, distributed_config=DistributedConfig(tp_size=world))
        dist.barrier()
        whole = _load(folder)
        rows = [None] * world
        dist.all_gather_object(rows, {"rank": rank, "sharded": sharded, "whole": whole})
        dist.barrier()  # rank 0 removes the folder on leaving the block
    if rank == 0:
        table = [{"load": f"tp_size={world}, rank {r['rank']}", **r["sharded"]} for r in rows] + [
            {"load": "whole, one process (rank 0)", **rows[0]["whole"]}
        ]
        print(f"checkpoint folder {file_mib:.1f} MiB, {world} ranks")
        print(f"{'load':32} {'held MiB':>9} {'peak anon +MiB':>15} {'peak file +MiB':>15}")
        for row in table:
            print(f"{row['load']:32} {row['held_mib']:9.1f} {row['peak_anon_growth_mib']:15.1f} "
                  f"{row['peak_file_growth_mib']:15.1f}")  # fmt: skip
        if args.out:
            report = {
                "date": datetime.date.today().isoformat(),
                "cpu_model": cpu_name(),
                "torch_threads": torch.get_num_threads(),
                "command": f"torchrun --nproc-per-node {world} scripts/load_memory.py " + " ".join(sys.argv[1:]),
                "checkpoint_mib": file_mib,
                "ranks": world,
                "rows": table,
            }
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
