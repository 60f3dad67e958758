"""Run a test scenario on several gloo processes (torch.multiprocessing, spawn) and collect each rank's results.

A scenario is a module-level function `scenario(rank, results)` of a test module (or a `functools.partial` of one):
it fills the `results` dict; an exception is caught and reported with the rank's traceback. A run that does not finish
in `SPAWN_TIMEOUT_S` is killed and fails the test (a hang is a failure)."""

import functools
import os
import socket
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, scenario, out_dir: str, tests_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    sys.path.insert(0, tests_dir)
    torch.set_num_threads(1)
    results = {}
    try:
        scenario(rank, results)
    except Exception:
        results["worker_exception"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_on_ranks(scenario, world_size: int, timeout_s: float = SPAWN_TIMEOUT_S) -> list[dict]:
    """`scenario` on `world_size` processes: each rank's results, after asserting that no rank raised. A scenario
    that does many loads in one spawn may pass a longer `timeout_s`."""
    with tempfile.TemporaryDirectory() as out_dir:
        args = (world_size, free_port(), scenario, out_dir, os.path.dirname(__file__))
        context = mp.start_processes(_worker, args=args, nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{scenario!r} on {world_size} processes did not finish in {timeout_s} s")
        results = [
            torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)
        ]
    failures = [f"rank {rank} failed:\n{result['worker_exception']}" for rank, result in enumerate(results)
                if "worker_exception" in result]  # fmt: skip
    assert not failures, "\n".join(failures)
    return results


def run_on_ranks_in_folder(scenario, world_size: int, timeout_s: float = SPAWN_TIMEOUT_S) -> list[dict]:
    """`run_on_ranks` for a scenario `scenario(rank, results, out_dir)`: `out_dir` is one temporary folder all ranks
    share (rank 0 writes checkpoints there, every rank reads them), removed afterwards."""
    with tempfile.TemporaryDirectory() as folder:
        return run_on_ranks(functools.partial(scenario, out_dir=folder), world_size, timeout_s)
