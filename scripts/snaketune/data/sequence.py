"""Sequence parallelism (``sequence_parallel: N``): each sequence split across N GPUs of a
node with DeepSpeed's Ulysses attention (ALST, ``deepspeed.runtime.sequence_parallel``).

What each piece does, and what we chose:

- **Groups.** The N GPUs of a group are consecutive ranks of one node (DeepSpeed's
  ``initialize_sequence_parallel``). The shard plan deals examples to data-parallel ranks
  (nodes x gpus_per_node / N of them, snaketune.data.shard); every GPU of a group reads the
  rows of data-parallel rank ``rank // N``: the same examples, in the same order.
- **The split.** A group's micro batch is one packed row (``packing: true``: every example
  side by side, position ids restarting at 0 per example). :func:`split` pads it to a
  multiple of N (the padding a separate segment, label -100), shifts the labels over the
  whole row (``shift_labels``: the last token of a slice predicts the first of the next),
  and keeps this GPU's 1/N of every tensor. Nothing is gathered: each GPU cuts its own
  slice from the same rows, where DeepSpeed's ``UlyssesSPDataLoaderAdapter`` would gather
  different rows from each GPU and make N micro batches of them (N times the steps'
  micro batches, which Trainer then counts apart from the plan).
- **Attention.** :func:`register` wraps the run's kernel with DeepSpeed's
  ``UlyssesSPAttentionHF``: an all-to-all trades the sequence slices for attention heads,
  the kernel sees whole sequences for 1/N of the heads, and the position ids gathered from
  the group mark where each packed example starts, so no example attends to another:
  flash-attention 2's variable-length path on GPU, ``sdpa_segments`` (PyTorch's sdpa one
  example at a time, snaketune.data.kernels) elsewhere, on GPUs without flash-attn too.
  DeepSpeed drops 4-D masks, so the ``rows`` layout (a block-diagonal mask) and eager
  attention cannot run split; the check refuses them.
- **The loss.** Each GPU's loss is the sum of its slice's label NLL over the step's label
  tokens, counted once across every GPU (Trainer's ``num_items_in_batch`` counts
  ``shift_labels``); DeepSpeed sums every GPU's gradient (averaged over the world, which
  Trainer's loss scale undoes), the all-to-all carries each slice's share to the others.
  A slice of padding only adds 0: no NaN. Steps, epochs and the loss are those of the same
  global batch without the split (tests/test_sequence.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SPLIT_KEYS = ("input_ids", "position_ids", "shift_labels")
# one packed row's sequence bounds, for the whole row: dropped, the kernel finds each
# example's start from the position ids gathered across the group
ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def size(run: dict[str, Any]) -> int:
    return int(run.get("sequence_parallel", 1))


def check_run(where: str, run: dict[str, Any], splits: bool) -> str | None:
    """Config-time: what ``sequence_parallel`` needs of the run (one line, or None);
    ``splits``: whether the run's method may split its sequences (Method.splits_sequences)."""
    n = size(run)
    if n == 1:
        return None
    key = f"{where}.sequence_parallel"
    if not splits:
        return (
            f"{key}: {n} splits supervised fine-tuning's sequences (method lora or full); "
            f"method {run['method']} scores whole sequences (pairs, rollouts) that the "
            "split would cut: remove the key"
        )
    if not run.get("packing"):
        return (
            f"{key}: {n} needs packing: true (each micro batch one row, split along the "
            "sequence); set packing: true (the loss is the same as unpacked)"
        )
    if run["gpus_per_node"] % n:
        return (
            f"{key}: {n} must divide gpus_per_node ({run['gpus_per_node']}): a sequence is "
            "split across GPUs of one node"
        )
    if run.get("attn_implementation") == "eager":
        return (
            f"{key}: {n} cannot split eager attention (it needs a full 4-D mask); set "
            "attn_implementation: auto"
        )
    return None


def check_model(where: str, run: dict[str, Any], heads: int, kv_heads: int) -> str | None:
    """Against the model (config.json): N divides the attention heads, and the KV heads
    divide by N or N by them (DeepSpeed then repeats each KV head)."""
    n = size(run)
    if n == 1:
        return None
    if heads % n or (kv_heads % n and n % kv_heads):
        return (
            f"{where}.sequence_parallel: {n} does not fit model {run['model']}'s "
            f"{heads} attention heads / {kv_heads} KV heads (N must divide the heads, and "
            "divide the KV heads or be a multiple of them); choose another N"
        )
    return None


def check_kernel(kernel: str, run: dict[str, Any], model_config: dict[str, Any]) -> None:
    """A split run trains with flash-attention 2 or ``sdpa_segments``
    (snaketune.data.kernels.training_kernel chooses it for a split run on GPU too): any
    other kernel takes the ``rows`` layout, whose mask DeepSpeed drops."""
    from snaketune.core.errors import UserError
    from snaketune.data.kernels import SEGMENTS, segments_problem

    if size(run) > 1 and kernel not in ("flash_attention_2", SEGMENTS):
        raise UserError(
            f"sequence_parallel: {size(run)} needs attention per example, which "
            f"this model's {segments_problem(model_config) or kernel} rules out without "
            "flash-attention 2; install flash-attn on the GPU nodes or remove sequence_parallel"
        )


def register(model, run: dict[str, Any], kernel: str) -> None:
    """Wrap the run's attention kernel with DeepSpeed's Ulysses attention for groups of
    ``sequence_parallel`` ranks (after deepspeed.init_distributed, before training). The
    held-out pass while training (the model in eval mode) runs unsplit."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from snaketune.core.errors import UserError

    try:
        UlyssesSPAttentionHF.register_with_transformers(
            model,
            kernel,
            size(run),
            micro_batch_size=1,
            seq_length_is_variable=True,
            disable_in_eval=True,
        )
    except ValueError as exc:  # heads that do not divide (the plan checks it first)
        raise UserError(f"sequence_parallel: {size(run)}: {exc}") from None


def split(batch: dict[str, Any], n: int, rank: int, pad_id: int) -> dict[str, Any]:
    """This GPU's slice (``rank`` of ``n``) of a packed one-row batch; see the module
    docstring. ``labels`` becomes the slice's shifted labels too (the model computes a loss
    only when given labels; with ``shift_labels`` it does not shift them again)."""
    import torch

    ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    if ids.shape[0] != 1:
        raise RuntimeError("sequence parallelism takes one packed row per micro batch")
    pad = (-ids.shape[1]) % n

    def padded(t: torch.Tensor, value: int | torch.Tensor) -> torch.Tensor:
        if not pad:
            return t
        tail = value if torch.is_tensor(value) else torch.full((1, pad), value, dtype=t.dtype)
        return torch.cat([t, tail.to(t.dtype)], dim=1)

    full = {
        "input_ids": padded(ids, pad_id),
        "position_ids": padded(positions, torch.arange(pad)[None]),  # a segment of its own
        "shift_labels": torch.nn.functional.pad(padded(labels, -100)[:, 1:], (0, 1), value=-100),
    }
    chunk = full["input_ids"].shape[1] // n
    out = {
        k: v
        for k, v in batch.items()
        if k not in (*SPLIT_KEYS, *ROW_KEYS, "labels", "attention_mask")
    }
    for key, tensor in full.items():
        out[key] = tensor[:, chunk * rank : chunk * (rank + 1)].contiguous()
    out["labels"] = out["shift_labels"]
    return out


class Slices:
    """A collator whose batches are this GPU's slices (``split``). Only the group's first
    GPU reports the counts the step callback sums over ranks (tokens, samples, padding),
    so each example counts once."""

    def __init__(self, collator, n: int, rank: int, pad_id: int):
        self._inner, self._n, self._rank, self._pad = collator, n, rank, pad_id
        self.layout = collator.layout

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return split(self._inner(examples), self._n, self._rank % self._n, self._pad)

    def __getattr__(self, name: str):
        value = getattr(self._inner, name)
        if name in ("tokens", "padded", "samples", "squares") and self._rank % self._n:
            return 0
        return value


def apply(run: dict[str, Any], rank: int, model, data, kernel: str, tokenizer):
    """A split run's model and data made ready (nothing for N = 1): the attention wrapped,
    the collator cutting this GPU's slices. Returns the data."""
    from dataclasses import replace

    from snaketune.core.rows import pad_id

    n = size(run)
    if n == 1:
        return data
    register(model, run, kernel)
    return replace(data, collator=Slices(data.collator, n, rank, pad_id(tokenizer)))


def devices(run: dict[str, Any], per_node: int) -> str:
    """The global batch line's devices: ``4 devices``, or with a split ``2 groups of 2 devices
    (sequence_parallel 2)``."""
    n = size(run)
    if n == 1:
        return f"{per_node} devices"
    return f"{per_node // n} groups of {n} devices (sequence_parallel {n})"
