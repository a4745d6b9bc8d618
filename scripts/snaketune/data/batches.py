"""This rank's share of the data plan, as a method trains on it: its rows of the node's
shard, its micro batches in the planned order (``PlanBatches``: which examples form global
step k was fixed by shard_dataset; later epochs permute the steps with (seed, epoch)), the
DataLoader every method's trainer reads them through, and the log of example ids trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Sampler

from snaketune.core.errors import UserError


class PlanBatches(Sampler[list[int]]):
    """This rank's micro batches in the planned order: for each step of the epoch, its
    ``accumulation`` micro batches (row indices into this rank's table).

    Epoch 0 runs the steps as planned; epoch e > 0 runs the same steps in an order permuted
    with (seed, e), the same on every rank, so each kept example is trained once per epoch.
    ``start_epoch`` is the epoch a resumed run continues in; each ``iter()`` moves to the
    next epoch, as Trainer calls it once per epoch.
    """

    def __init__(
        self,
        step: np.ndarray,
        micro: np.ndarray,
        steps: int,
        accumulation: int,
        seed: int,
        start_epoch: int = 0,
    ):
        self.steps, self.accumulation, self.seed, self.epoch = (
            steps,
            accumulation,
            seed,
            start_epoch,
        )
        self.batches: list[list[list[int]]] = [
            [[] for _ in range(accumulation)] for _ in range(steps)
        ]
        for i, (s, m) in enumerate(zip(step.tolist(), micro.tolist(), strict=True)):
            self.batches[s][m].append(i)
        empty = [
            (s, m) for s in range(steps) for m in range(accumulation) if not self.batches[s][m]
        ]
        if empty:
            raise UserError(
                f"the shard plans no example for step {empty[0][0]} micro batch {empty[0][1]} "
                "of this rank; rerun shard_dataset with this run's settings"
            )

    def order(self, epoch: int) -> list[int]:
        if epoch == 0:
            return list(range(self.steps))
        return np.random.default_rng([self.seed, epoch]).permutation(self.steps).tolist()

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        return (micro for s in self.order(epoch) for micro in self.batches[s])

    def __len__(self) -> int:
        return self.steps * self.accumulation


@dataclass
class Data:
    """What a method trains on: this rank's rows, their batches and the collator (what the
    step callback counts: tokens, padding, samples, attention work)."""

    table: Any  # datasets.Dataset of this rank's rows
    batches: PlanBatches
    collator: Any


def read_rank_rows(shards: Path, node: int, rank: int):
    """The rows node ``node``'s shard plans for global ``rank``, as a datasets.Dataset."""
    import datasets

    from snaketune.core import parts
    from snaketune.data.kinds import kind_of_columns

    shard = shards / f"node-{node}.parquet"
    columns = [*kind_of_columns(parts.names(shard)).read_columns, "step", "micro"]
    return datasets.Dataset(parts.read_table(shard, columns, filters=[("rank", "==", rank)]))


def planned_loader(table, batch_sampler, collate_fn) -> DataLoader:
    """The DataLoader a method's trainer reads this rank's planned batches through (in
    place of Trainer's own sampler over a shared dataset)."""
    import torch

    return DataLoader(
        table,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=0,
        pin_memory=torch.cuda.is_available(),
    )
