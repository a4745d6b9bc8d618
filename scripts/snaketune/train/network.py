"""Know the network before the week: the all-reduce bus bandwidth of a multi-node job.

At the start of every multi-node train job, before the model is loaded, every rank times
the same all-reduce (256 MiB on GPU with NCCL, 4 MiB on CPU with gloo; two warm-up rounds,
then ``ITERATIONS``). The slowest rank's mean time gives the algorithm bandwidth
(bytes / time) and the bus bandwidth, nccl-tests' figure that compares across rank
counts: ``busbw = algbw x 2 (n - 1) / n``. Rank 0 writes it to
``<checkpoints>/network.json``; the launcher puts it in the provenance and the report, and
the first metrics line of the job carries it.

``preflight.min_busbw_gbps`` (unset by default; a cluster profile sets it for its fabric)
fails the job there, with one line, when the fabric is slower: the usual cause is NCCL
talking over TCP sockets instead of InfiniBand.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

GPU_BYTES = 256 * 2**20
CPU_BYTES = 4 * 2**20
WARMUP, ITERATIONS = 2, 5
RESULT = "network.json"


def allreduce_busbw(nbytes: int | None = None, iterations: int = ITERATIONS) -> dict:
    """Time an all-reduce of ``nbytes`` (fp32) across every rank of the default group."""
    import torch
    import torch.distributed as dist

    from snaketune.core.collective import collective_device

    device = collective_device()
    cuda = device.type == "cuda"
    nbytes = nbytes or (GPU_BYTES if cuda else CPU_BYTES)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(WARMUP):
        dist.all_reduce(x)
    sync()
    dist.barrier()
    began = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(x)
    sync()
    took = torch.tensor(
        [(time.perf_counter() - began) / iterations], dtype=torch.float64, device=device
    )
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time
    seconds, n = float(took.item()), dist.get_world_size()
    algbw = nbytes / seconds / 1e9
    return {
        "bytes": nbytes,
        "ranks": n,
        "backend": dist.get_backend(),
        "seconds": round(seconds, 6),
        "algbw_gbps": round(algbw, 3),
        "busbw_gbps": round(algbw * 2 * (n - 1) / n, 3),
    }


def too_slow(result: dict, min_gbps: float | None) -> str | None:
    """The one line failing the job when the bus bandwidth is under ``min_gbps``."""
    if min_gbps is None or result["busbw_gbps"] >= min_gbps:
        return None
    return (
        f"network: all-reduce bus bandwidth {result['busbw_gbps']:.2f} GB/s across "
        f"{result['ranks']} ranks ({result['bytes'] // 2**20} MiB, {result['backend']}) is "
        f"under preflight.min_busbw_gbps {min_gbps:g}: the nodes likely talk over TCP "
        "sockets instead of InfiniBand; check NCCL_IB_DISABLE (unset it), "
        "NCCL_SOCKET_IFNAME and NCCL_IB_HCA, and NCCL_DEBUG=INFO's transport "
        "lines"
    )


def read_result(ckpt_dir: Path) -> dict | None:
    path = ckpt_dir / RESULT
    return json.loads(path.read_text()) if path.is_file() else None
