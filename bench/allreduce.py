"""All-reduce bus bandwidth, as every multi-node train job measures it at its start.

    python bench/allreduce.py                     # 2 ranks on this machine (gloo, CPU)
    python bench/allreduce.py --ranks 4 --mib 4 64

Starts ``--ranks`` processes in one gloo group on 127.0.0.1 (on a GPU machine, one NCCL
rank per GPU) and runs snaketune.train.network.allreduce_busbw for each size: 2 warm-up rounds,
5 timed, the slowest rank's mean. busbw = bytes / time x 2 (n - 1) / n (nccl-tests'
figure). The train job uses 4 MiB on CPU and 256 MiB on GPU.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module: take this folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import os

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")


def worker(rank: int, ranks: int, port: int, sizes: list[int], results) -> None:
    import torch
    import torch.distributed as dist

    from snaketune.train.network import allreduce_busbw

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= ranks
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=ranks)  # fmt: skip
    for nbytes in sizes:
        got = allreduce_busbw(nbytes)
        if rank == 0:
            results.append(got)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 64, 256])
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from snaketune.train.commands import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(worker, args=(args.ranks, free_port(), [m * 2**20 for m in args.mib], results),
                 nprocs=args.ranks)  # fmt: skip
        for r in results:
            print(f"{r['backend']}, {r['ranks']} ranks, {r['bytes'] // 2**20:4d} MiB: "
                  f"{r['seconds'] * 1e3:8.2f} ms, algbw {r['algbw_gbps']:6.2f} GB/s, "
                  f"busbw {r['busbw_gbps']:6.2f} GB/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
