"""Preflight of a multi-node training job, run inside the allocation before torchrun.

One task per node (``srun --ntasks-per-node=1``) runs :func:`node_check`, then the batch
shell runs :func:`gather`:

- devices: the task sees ``gpus_per_node`` devices (CUDA devices when CUDA is present;
  else the GPUs SLURM bound to the task, CUDA_VISIBLE_DEVICES, and the job falls back to
  the CPU);
- shared filesystem: every task writes ``<run dir>/preflight/node-<id>.json``; the batch
  shell, on the first node, must see all of them (a node whose run directory is a local
  disk writes its file where nobody reads it);
- rendezvous: the head host resolves on every node, and its port accepts a connection
  from every node (node 0 listens on it for the check, before torchrun takes it).

    srun --nodes 2 --ntasks 2 --ntasks-per-node=1 python -m snaketune.train.preflight \
        --run-dir results/demo/train --gpus-per-node 4 --head tupi1 --port 29517 --nodes 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from snaketune.core.errors import UserError
from snaketune.core.io import host_name


def cuda_available() -> bool:
    """Whether this node's torch sees a GPU, as ``torch.cuda.is_available()`` answers, for a
    process that needs nothing else of torch (the train job's launcher: importing torch
    costs it 2-3 CPU-seconds at every start). Torch's own answer once it is loaded; else a
    GPU the driver lists (NVIDIA; /dev/kfd for ROCm), none hidden by CUDA_VISIBLE_DEVICES,
    and an installed torch built for it (a +cpu wheel sees none)."""
    import sys
    from importlib import metadata

    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.is_available()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return False
    try:
        build = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False
    if "+rocm" in build:
        return Path("/dev/kfd").exists()
    return "+cpu" not in build and any(Path("/proc/driver/nvidia/gpus").glob("*"))


def visible_devices(gpus_per_node: int) -> tuple[int, str]:
    """(count, what was counted) of the devices this task may use."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "cuda"
    except ImportError:
        pass
    bound = os.environ.get("CUDA_VISIBLE_DEVICES")
    if bound is None:
        return gpus_per_node, "cpu (no GPU bound by SLURM; CPU fallback)"
    ids = [d for d in bound.split(",") if d.strip()]
    return len(ids), "gpus bound by SLURM (no CUDA here: CPU fallback)"


def check_port(head: str, port: int, node_id: int, nodes: int, timeout: float) -> str:
    """Node 0 listens on ``port`` until every other node has connected; the others connect."""
    address = socket.gethostbyname(head)
    if node_id == 0:
        with socket.create_server(("", port), reuse_port=False) as server:
            server.settimeout(timeout)
            for _ in range(nodes - 1):
                conn, _addr = server.accept()
                with conn:  # the peer closes first, so TIME_WAIT does not hold the port
                    conn.settimeout(timeout)
                    conn.recv(1)
        return address
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=5):
                return address
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def node_check(
    run_dir: Path, gpus_per_node: int, head: str, port: int, nodes: int, timeout: float = 60.0
) -> dict:
    """This node's checks; written to ``run_dir/preflight/node-<id>.json``."""
    node_id = int(os.environ.get("SLURM_NODEID", "0"))
    host = host_name()
    result: dict = {"node_id": node_id, "host": host, "problems": []}
    count, kind = visible_devices(gpus_per_node)
    result["devices"] = {"count": count, "kind": kind}
    if count != gpus_per_node:
        result["problems"].append(
            f"sees {count} devices ({kind}), the run asks for {gpus_per_node}"
        )
    try:
        result["head_address"] = check_port(head, port, node_id, nodes, timeout)
    except OSError as exc:
        result["problems"].append(f"rendezvous {head}:{port} not reachable: {exc}")
    out = run_dir / "preflight"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"node-{node_id}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def gather(run_dir: Path, nodes: int) -> dict:
    """Read every node's result; raise UserError with one line naming the first problem."""
    out = run_dir / "preflight"
    results, missing = {}, []
    for node_id in range(nodes):
        f = out / f"node-{node_id}.json"
        if f.is_file():
            results[node_id] = json.loads(f.read_text())
        else:
            missing.append(node_id)
    summary = {"nodes": nodes, "results": results, "missing": missing}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if missing:
        raise UserError(
            f"preflight: node(s) {missing} did not write to {out.resolve()}: the run directory "
            "is not on a filesystem shared by all nodes; run from a shared directory"
        )
    for r in results.values():
        if r["problems"]:
            raise UserError(f"preflight: {r['host']} (node {r['node_id']}) {r['problems'][0]}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="the train output directory")
    parser.add_argument(
        "--gpus-per-node", type=int, required=True, help="devices each node must see"
    )
    parser.add_argument("--head", required=True, help="rendezvous host (the first node)")
    parser.add_argument("--port", type=int, required=True, help="rendezvous port")
    parser.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for peers")
    args = parser.parse_args(argv)
    node_check(args.run_dir, args.gpus_per_node, args.head, args.port, args.nodes, args.timeout)
    return 0  # problems go to the file: a failing task would make srun kill the others


if __name__ == "__main__":
    raise SystemExit(main())
