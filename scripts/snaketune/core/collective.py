"""Collectives the workers make outside the trainer's own: a barrier, "on any rank?", and
one all-gather of a step's numbers. Each works off a job too, and in a job of one rank makes
no collective at all (its own values: a gloo call per step there is time for nothing).
"""

from __future__ import annotations

import torch


def is_distributed() -> bool:
    """Whether this process has other ranks to agree with (a process group of more than one)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    import torch.distributed as dist

    if is_distributed():
        dist.barrier()


def collective_device() -> torch.device:
    """Where a collective's tensors must live: this process's GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (one all-reduce; this rank's flag off a job)."""
    import torch.distributed as dist

    if not is_distributed():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_combined(values: list[float], how: tuple[str, ...]) -> list[float]:
    """Every rank's ``values``, combined position by position by ``how`` ("sum" or "max"):
    one all-gather."""
    import torch.distributed as dist

    rows = [values]
    if is_distributed():
        mine = torch.tensor(values, dtype=torch.float64, device=collective_device())
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        rows = torch.stack(parts).cpu().tolist()
    return [(sum if h == "sum" else max)(r[i] for r in rows) for i, h in enumerate(how)]


def ragged_gather(gather):
    """``gather`` (an accelerate all-gather) made safe for tensors whose first dimension
    differs across ranks: a token-balanced plan gives ranks unequal pair or example counts in
    a step, and an all-gather needs equal shapes (gloo refuses, NCCL hangs). The sizes are
    gathered first; each rank's tensor is padded to the largest and the padding dropped
    again, so the result is every rank's rows in rank order. Scalars (0-d) and non-tensors
    go through ``gather`` as they are."""

    def gathered(data):
        if not isinstance(data, torch.Tensor) or data.dim() == 0:
            return gather(data)
        sizes = gather(torch.tensor([data.shape[0]], device=data.device)).tolist()
        width = max(sizes)
        if min(sizes) == width:
            return gather(data)
        pad = data.new_zeros((width - data.shape[0], *data.shape[1:]))
        rows = gather(torch.cat([data, pad])).split(width)
        return torch.cat([part[:n] for part, n in zip(rows, sizes, strict=True)])

    return gathered
