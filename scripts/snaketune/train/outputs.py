"""What a finished training writes (every rank takes part, rank 0 writes the files): the
final DeepSpeed checkpoint, the model (or adapter) folder, the probe logits later stages
check their models against, and the metrics; each to its staged name (snaketune.core.job), which
the launcher renames into place once every worker has exited 0.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch

from snaketune.core.collective import barrier
from snaketune.core.job import WorkerEnv, staged

PROBE_ROWS, PROBE_TOKENS = 2, 32


def probe_inputs(shards: Path) -> torch.Tensor:
    """Fixed probe input ids: the first tokens of the first rows of node 0's shard."""
    import pyarrow.parquet as pq

    rows = pq.read_table(shards / "node-0.parquet", columns=["input_ids"]).slice(0, PROBE_ROWS)
    ids = [r[:PROBE_TOKENS] for r in rows.column("input_ids").to_pylist()]
    n = min(len(r) for r in ids)
    return torch.tensor([r[:n] for r in ids], dtype=torch.long)


def record_probe(engine, probe: torch.Tensor, path: Path, rank: int, precision: str) -> None:
    """Logits of the trained model on the probe inputs (every rank runs the forward pass:
    under ZeRO-3 the parameters are gathered layer by layer). Later stages compare the
    converted and merged models against these."""
    from safetensors.torch import save_file

    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe.to(engine.device)).logits.float().cpu()
    if rank == 0:
        save_file(
            {"input_ids": probe, "logits": logits.contiguous()},
            str(path),
            metadata={"precision": precision},
        )


def save_outputs(
    trainer,
    env: WorkerEnv,
    out: Path,
    live_metrics: Path,
    probe: torch.Tensor,
    precision: str,
    records: dict[str, dict] | None = None,
) -> None:
    """Final DeepSpeed checkpoint, model (adapter) directory with ``records`` (JSON files
    beside the model: a 4-bit base's quantization.json), probe logits and metrics, each
    written to its staged name (see :func:`staged`)."""
    final_tmp, model_tmp = staged(out, "final_checkpoint"), staged(out, "model")
    probe_tmp, metrics_tmp = staged(out, "probe.safetensors"), staged(out, "metrics.jsonl")
    if env.rank == 0:
        for p in (final_tmp, model_tmp, probe_tmp, metrics_tmp):
            if p.is_dir():
                shutil.rmtree(p)
            p.unlink(missing_ok=True)
    barrier()
    trainer.model_wrapped.save_checkpoint(str(final_tmp), tag="final")
    trainer.save_model(str(model_tmp))
    record_probe(trainer.model_wrapped, probe, probe_tmp, env.rank, precision)
    if env.rank == 0:
        shutil.copyfile(live_metrics, metrics_tmp)
        for name, record in (records or {}).items():
            (model_tmp / name).write_text(json.dumps(record, indent=2) + "\n")
    barrier()
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()
