"""A data-parallel scoring stage (the reference log-probs of a DPO run, a teacher's top-k for
distillation): one worker per device over the run's nodes, each writing its chunks to
``parts/`` beside the output as it finishes them, started as one attempt of the stage by the
train job's launcher (snaketune.train.agents: torchrun agents on this machine, or one srun
task per node inside a SLURM job after the preflight); the stall watch reads the workers'
heartbeats (``heartbeat/`` beside the output), a worker that fails takes the others down,
each start keeps its own log (``logs/attempt-<n>.log``, snaketune.train.attempts), and the
output is written once every chunk is there. A rerun after a kill computes only the chunks
missing.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One scoring stage's job: its name (rule and logs), the entry script and the flags
    every worker gets (``--worker`` added), the output, the layout and the stall timeout."""

    name: str
    script: str
    flags: list[str]
    out: Path
    nodes: int
    gpus_per_node: int
    timeout_minutes: float | None

    @property
    def parts(self) -> Path:
        return self.out.parent / "parts"


def worker(parts: Path, compute: Callable[[int, int, Callable[[int], None]], int]) -> int:
    """One device's share: worker RANK of WORLD_SIZE (torchrun's) runs ``compute(rank,
    workers, on_batch)`` with its heartbeat moved before each batch (``on_batch(chunk)``)."""
    from snaketune.core.heartbeat import DONE, FOLDER, Heartbeat
    from snaketune.core.runlock import die_with_parent

    die_with_parent()  # never outlive the agent that started it
    rank, workers = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    beat = Heartbeat(parts.parent / FOLDER, rank, int(os.environ.get("GROUP_RANK", 0))).start()
    parts.mkdir(parents=True, exist_ok=True)
    done = compute(rank, workers, lambda chunk: beat.move("forward", chunk))
    beat.move(DONE)
    beat.write()
    beat.stop()
    log.info("worker %d: %d chunks computed", rank, done)
    return 0


def start_workers(stage: Stage) -> tuple[int, str | None]:
    """Every worker through the shared launcher: (exit code, why it ended where it failed:
    a stall or a signal)."""
    from snaketune.evaluation.logps import threads_per_worker
    from snaketune.train.agents import Workers, choose_launcher, start, worker_environment

    folder = stage.out.parent
    timeout = stage.timeout_minutes
    if timeout is None:  # run by hand: the run's default
        from snaketune.plan.schema import run_default

        timeout = run_default("timeout_minutes")
    workers = Workers(
        [stage.script, *stage.flags, "--worker"],
        stage.nodes,
        stage.gpus_per_node,
        f"{stage.name.split('_')[0]}-{folder.name}",
        stage.name,
        folder,
        folder,
        timeout * 60,
    )
    env = worker_environment()
    here = choose_launcher(workers.launcher, stage.nodes, workers.rule) == "local"
    # the cores of this machine (every emulated node) or of each node, shared out
    local = stage.nodes * stage.gpus_per_node if here else stage.gpus_per_node
    env["OMP_NUM_THREADS"] = str(threads_per_worker(local))
    code, signalled = start(workers, env)
    if code == 0:
        return 0, None
    from snaketune.core.heartbeat import stall_verdict

    stalled = stall_verdict(folder)
    log.error(
        "a worker failed (exit %d); the chunks written are kept, a rerun computes the rest", code
    )
    return code, f"stalled: {stalled}" if stalled else (
        f"stopped by {signalled}" if signalled else None
    )


def launch(
    stage: Stage, finish: Callable[[], str], settings: dict[str, Any], inputs: dict[str, str]
) -> int:
    """Every worker as one attempt of the stage (``start_workers``); then ``finish()`` (the
    merge: what it made, in a few words), the provenance (``settings``, ``inputs``) and the
    parts removed."""
    from snaketune.core.errors import UserError, error_lines
    from snaketune.core.provenance import NAME, output_hashes, record, write_provenance
    from snaketune.train.attempts import Attempt

    folder = stage.out.parent
    stage.parts.mkdir(parents=True, exist_ok=True)
    attempt = Attempt(folder, stage=stage.name, name=folder.name)
    try:
        code, reason = start_workers(stage)
        if code != 0:
            attempt.finish(code, reason)
            return code
        made = finish()
    except UserError as exc:
        from snaketune.core.errors import print_error

        print_error(exc)
        attempt.finish(2, "; ".join(error_lines(exc)))
        return 2
    except BaseException as exc:  # recorded as this attempt's end, then raised
        attempt.finish(1, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        raise
    prov = record(
        stage.name, str(stage.out), settings, inputs, output_hashes(folder, [stage.out.name])
    )
    write_provenance(folder / NAME, prov)
    shutil.rmtree(stage.parts, ignore_errors=True)
    log.info("%s -> %s", made, stage.out)
    attempt.finish(0, made)
    return 0
