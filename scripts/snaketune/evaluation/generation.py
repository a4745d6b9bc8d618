"""Generation for the evaluation: each eval prompt's greedy answer (batched, left-padded,
stopped at the model's end-of-turn and end-of-text tokens), as the samples record it."""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta

import torch

from snaketune.core.rows import pad_id, prompt_length

log = logging.getLogger(__name__)


def stop_ids_of(model, tokenizer) -> list[int]:
    """What plain ``generate`` stops on: the model's generation_config eos_token_id (the
    tokenizer's eos when it has none)."""
    ids = model.generation_config.eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids)


def generate(
    model,
    tokenizer,
    rows: list[dict],
    batch_size: int,
    max_new_tokens: int,
    calls: int | None = None,
) -> tuple[list[str], list[bool]]:
    """Greedy continuations of each example's prompt (the tokens before its first label), in
    batches with left padding and the KV cache, stopping where the model's generation_config
    stops (as any application loading the model does); a progress line per batch. Returns
    the texts and, for each, whether it ended on a stop id (not at ``max_new_tokens``).

    ``calls``: a sharded model's ranks generate together (``synced_gpus``), each making
    this many generate calls (the ones past its own rows on a dummy prompt, kept nowhere)."""
    prompts = [r["input_ids"][: prompt_length(r["labels"])] for r in rows]
    pad = pad_id(tokenizer)
    stops = stop_ids_of(model, tokenizer)
    out: list[str] = []
    stopped: list[bool] = []
    began = time.monotonic()
    for i in range(0, len(prompts), batch_size):
        rows_i = rows[i : i + batch_size]
        new = greedy(model, prompts[i : i + batch_size], pad, stops, max_new_tokens, calls, rows_i)
        out += tokenizer.batch_decode(new, skip_special_tokens=True)
        stopped += torch.isin(new, torch.tensor(stops)).any(dim=1).tolist()
        rate = len(out) / max(time.monotonic() - began, 1e-9)
        log.info(
            "generated %d/%d examples, %.1f examples/s, ETA %s",
            len(out),
            len(prompts),
            rate,
            timedelta(seconds=int((len(prompts) - len(out)) / rate)),
        )
    for _ in range(max((calls or 0) - math.ceil(len(prompts) / batch_size), 0)):
        greedy(model, [[pad]], pad, stops, max_new_tokens, calls)  # in step with the others
    return out, stopped


def greedy(
    model,
    batch: list[list[int]],
    pad: int,
    stops: list[int],
    max_new_tokens: int,
    calls: int | None,
    rows: list[dict] = (),
) -> torch.Tensor:
    """The new tokens of one generate call on ``batch`` (left padded, so every continuation
    starts at the same column); ``calls`` set: synchronised with the other ranks; ``rows``:
    the batch's rows, whose pictures (a picture set's) go in beside their tokens."""
    from snaketune.data.pictures import inputs_of

    n = max(len(p) for p in batch)
    ids = torch.full((len(batch), n), pad)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for j, p in enumerate(batch):
        ids[j, n - len(p) :] = torch.tensor(p)
        mask[j, n - len(p) :] = 1
    synced = {} if calls is None else {"synced_gpus": True}
    synced.update(inputs_of(model, list(rows), ids))
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=stops,
            **synced,
        )
    return gen[:, n:].cpu()
