"""Whether a run can learn, from its first steps' figures: a loss that is not a number or
that stays the same to the sixth digit (different batches give different losses), no
gradient, a learning rate that stays zero, GRPO rewards equal within every group (no
advantage, so no gradient) and completions all cut at their maximum length. Each is
warned about once, within the first WINDOW steps, in the train log (naming the figure,
the likely cause and the key to change) and in results/<run>/train/warnings.jsonl, which
`snaketune status`, summary.tsv, the report and the merge's refusal of an unchanged
adapter read."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from snaketune.methods import method_of
from snaketune.methods.outputs import WINDOW, holds

FILE = "warnings.jsonl"  # results/<run>/train/: one JSON line per warning


def checks(run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, str]:
    """The warnings the first steps' metrics rows (``rows``, oldest first) call for, by
    name: what the figure is, what it means, what to change."""
    out: dict[str, str] = {}
    bad = [r for r in rows if r.get("loss") is not None and not math.isfinite(r["loss"])]
    if bad:
        out["loss"] = (
            f"loss is {bad[0]['loss']} at step {bad[0]['step']}: training diverged or a batch "
            "has no label; lower learning_rate, train in bf16 rather than fp16 (precision), "
            "and check that max_length leaves room for the answers"
        )
    first = rows[:WINDOW]
    own = method_of(run).vitals(run, first)  # the method's own (GRPO: its rewards, its cut)
    out.update(own)
    if not own and holds(first, "grad_norm", lambda v: v == 0):
        out["grad_norm"] = (
            f"grad_norm 0 in each of the first {WINDOW} steps: nothing is trained; check "
            "that the trainable weights get a loss (lora.target_modules, the data's labels)"
        )
    if holds(first, "lr", lambda v: v == 0):
        out["lr"] = (
            f"learning rate 0 in each of the first {WINDOW} steps: the weights never move; "
            "check learning_rate and warmup_ratio"
        )
    losses = [r.get("loss") for r in first]
    if (
        not own
        and not out.keys() & {"loss", "grad_norm", "lr"}  # a cause named already
        and method_of(run).heldout_metric == "loss"  # its loss tracks learning (not RL's)
        and holds(first, "loss", math.isfinite)
        and max(losses) - min(losses) <= 1e-6 * max(1.0, abs(losses[0]))
    ):
        out["loss_flat"] = (
            f"loss {losses[0]:.6g} in each of the first {WINDOW} steps, on different batches: "
            "the weights do not move or no example carries a label; check learning_rate, "
            "lora.target_modules and that max_length leaves room for the answers"
        )
    return out


class Vitals:
    """Rank 0's watch over the metrics rows as they are written: ``see`` returns the
    warnings due now (each once) and appends them to ``folder``/warnings.jsonl (started
    afresh by a run that starts from step 0, kept by one that resumes)."""

    def __init__(self, run: dict[str, Any], folder: Path, fresh: bool):
        self.run, self.path = run, folder / FILE
        if fresh:
            self.path.unlink(missing_ok=True)
        self.rows: list[dict[str, Any]] = []  # the first WINDOW rows of this start
        self.said: set[str] = set(read(folder))

    def see(self, record: dict[str, Any]) -> list[str]:
        if len(self.rows) < WINDOW:
            self.rows.append(record)
            found = checks(self.run, self.rows)
        else:  # past the first steps only a loss that is not a number is news
            found = {k: v for k, v in checks(self.run, [record]).items() if k == "loss"}
        new = {k: v for k, v in found.items() if k not in self.said}
        if new:
            with open(self.path, "a") as fh:
                for name, line in new.items():
                    fh.write(
                        json.dumps({"step": record.get("step"), "check": name, "warning": line})
                        + "\n"
                    )
        self.said |= set(new)
        return list(new.values())


def read(folder: Path) -> dict[str, str]:
    """The warnings a run's train folder holds: check name -> its line (empty: none)."""
    path = folder / FILE
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        out.setdefault(record["check"], record["warning"])
    return out
