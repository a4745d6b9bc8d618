"""Run by tests/test_sequence.py on 2 gloo ranks (torchrun): a packed row split across the
ranks by snaketune.data.sequence, under DeepSpeed's Ulysses attention wrapping
``sdpa_segments``, against plain transformers on each document alone (the oracle: no
packing, no split, no product code).

1. Per-token NLL of the split row (gathered) equals each document's own, so no document
   attends to another; the summed loss equals the oracle's token mean.
2. Changing the third document's tokens leaves the first two documents' NLL unchanged.
3. A row whose second half is padding: rank 1's slice holds no label, its loss is 0 (not
   NaN) and the total is still the oracle's.
Prints ``probe: ok`` on rank 0.
"""

from __future__ import annotations

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from snaketune.data.kernels import SEGMENTS, register_segment_attention
from snaketune.data.sequence import register, split

N = 2


def packed(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.cat(docs)
    positions = torch.cat([torch.arange(len(d)) for d in docs])
    labels = ids.clone()
    start = 0
    for d in docs:  # an example's first token is never a target (snaketune.data.packing)
        labels[start] = -100
        start += len(d)
    return {"input_ids": ids[None], "position_ids": positions[None], "labels": labels[None]}


def oracle(model, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each document alone: NLL of tokens 1.. from the plain model."""
    out = []
    with torch.no_grad():
        for d in docs:
            logits = model(input_ids=d[None]).logits[0, :-1]
            out.append(torch.nn.functional.cross_entropy(logits, d[1:], reduction="none"))
    return out


def split_nll(model, row: dict[str, torch.Tensor], rank: int) -> tuple[torch.Tensor, float]:
    """Per-token NLL of this rank's slice of ``row`` (target order), gathered across ranks,
    and this rank's summed loss."""
    part = split(dict(row), N, rank, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits[0]
    target = part["shift_labels"][0]
    nll = torch.nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
    nll = torch.where(target == -100, torch.full_like(nll, float("nan")), nll)
    pieces = [torch.empty_like(nll) for _ in range(N)]
    dist.all_gather(pieces, nll)
    return torch.cat(pieces), float(nll.nan_to_num().sum())


def main(model_dir: str) -> None:
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    register_segment_attention()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=SEGMENTS)  # fmt: skip
    register(model, {"sequence_parallel": N}, SEGMENTS)
    model.train()  # the split runs in training mode (evaluation runs unsplit)
    vocab = model.config.vocab_size
    docs = [torch.randint(3, vocab, (n,)) for n in (23, 40, 17)]  # 80 tokens, 3 documents

    got, _ = split_nll(model, packed(docs), rank)
    want = oracle(plain, docs)
    flat = torch.cat([torch.cat([w, torch.tensor([float("nan")])]) for w in want])
    # the row's targets: each document's tokens 1.., then none (the next one's start)
    expected = flat[: len(got)]
    both = ~expected.isnan()
    assert torch.equal(both, ~got.isnan()), (both, got)
    worst = (got[both] - expected[both]).abs().max().item()
    assert worst < 1e-4, worst

    changed = [docs[0], docs[1], torch.randint(3, vocab, (17,))]
    again, _ = split_nll(model, packed(changed), rank)
    first_two = slice(0, len(docs[0]) + len(docs[1]))
    assert torch.equal(again[first_two].nan_to_num(), got[first_two].nan_to_num())
    assert not torch.equal(again.nan_to_num(), got.nan_to_num())

    short = docs[0][:20]  # 20 real tokens then 20 of padding: rank 1 holds only padding
    row = packed([short])
    row = {"input_ids": torch.cat([row["input_ids"], torch.zeros(1, 20, dtype=torch.long)], 1),
           "position_ids": torch.cat([row["position_ids"], torch.arange(20)[None]], 1),
           "labels": torch.cat([row["labels"], torch.full((1, 20), -100)], 1)}  # fmt: skip
    part = split(dict(row), N, rank, pad_id=0)
    count = int((part["shift_labels"] != -100).sum())
    out = model(**part, num_items_in_batch=19)
    assert torch.isfinite(out.loss), out.loss
    if rank == 1:
        assert count == 0 and out.loss.item() == 0.0, (count, out.loss)
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    alone = oracle(plain, [short])[0].mean().item()
    assert abs(total.item() - alone) < 1e-4 * alone, (total.item(), alone)
    if rank == 0:
        print(f"probe: ok (worst NLL difference {worst:.1e}; padding rank loss 0)")


if __name__ == "__main__":
    main(sys.argv[1])
