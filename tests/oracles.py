"""Independent computations the tests check the product's figures against: plain
transformers forward passes on the tokenized rows (the parquet files are the shared ground
truth), one example at a time, no padding, no batching, no snaketune helper.

A labelled token t (labels[t] != -100) is predicted from position t - 1, as in every causal
LM loss: its log-prob is log_softmax(logits[t - 1])[input_ids[t]].
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import torch

IGNORE = -100


def token_logps(model, input_ids: list[int], labels: list[int]) -> list[float]:
    """The log-prob of each labelled token of one sequence (float64)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[t - 1, input_ids[t]].item() for t in range(1, len(input_ids))
            if labels[t] != IGNORE]  # fmt: skip


def summed_logp(model, input_ids: list[int], labels: list[int]) -> float:
    """A sequence's summed log-prob of its labelled tokens (a DPO side's log-prob)."""
    return math.fsum(token_logps(model, input_ids, labels))


def mean_nll(model, rows: list[dict]) -> tuple[float, int]:
    """The token mean of the labelled tokens' NLL over ``rows`` (input_ids, labels), and the
    token count: a held-out loss."""
    total, count = [], 0
    for row in rows:
        got = token_logps(model, row["input_ids"], row["labels"])
        total += [-x for x in got]
        count += len(got)
    return math.fsum(total) / count, count


def dpo_sigmoid_loss(model, reference, pairs: list[dict], beta: float,
                     ref_logps: dict[str, tuple[float, float]] | None = None) -> float:  # fmt: skip
    """The DPO loss of ``pairs`` (tokenized rows: input_ids/labels chosen,
    rejected_input_ids/rejected_labels) as the paper writes it, averaged over the pairs:
    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))). The reference's log-probs from
    ``reference`` (a model) or given by example id in ``ref_logps``."""
    losses = []
    for p in pairs:
        pc = summed_logp(model, p["input_ids"], p["labels"])
        pr = summed_logp(model, p["rejected_input_ids"], p["rejected_labels"])
        if ref_logps is not None:
            rc, rr = ref_logps[p["example_id"]]
        else:
            rc = summed_logp(reference, p["input_ids"], p["labels"])
            rr = summed_logp(reference, p["rejected_input_ids"], p["rejected_labels"])
        margin = (pc - rc) - (pr - rr)
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(beta * margin)).item())
    return math.fsum(losses) / len(losses)


def simpo_loss(model, pairs: list[dict], beta: float, gamma: float) -> float:
    """SimPO's loss of ``pairs`` as the paper writes it (Meng et al. 2024, eq. 6), averaged
    over the pairs: -log sigmoid(beta * (mean log-prob of the chosen response's tokens - the
    rejected's) - gamma); no reference model."""
    losses = []
    for p in pairs:
        c = token_logps(model, p["input_ids"], p["labels"])
        r = token_logps(model, p["rejected_input_ids"], p["rejected_labels"])
        margin = beta * (math.fsum(c) / len(c) - math.fsum(r) / len(r)) - gamma
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(margin, dtype=torch.float64)))
    return math.fsum(x.item() for x in losses) / len(losses)


def orpo_loss(model, micro_batches: list[list[dict]], lam: float) -> float:
    """ORPO's loss of a step (Hong, Lee and Thorne 2024, eq. 6-7) over its ``micro_batches``
    of pairs, with TRL's NLL term (each micro batch's mean NLL over its chosen sides' tokens,
    prompt included) weighted by the micro batch's share of the step's pairs, minus lambda x
    the mean over every pair of log sigmoid(log odds(chosen) - log odds(rejected)); log
    odds(y) = a - log(1 - exp(a)), a the mean log-prob of y's response tokens. Float64."""
    pairs = sum(len(m) for m in micro_batches)
    nll, ratio = [], []
    for micro in micro_batches:
        tokens = [x for p in micro for x in token_logps(model, p["input_ids"], p["input_ids"])]
        nll.append(len(micro) / pairs * -math.fsum(tokens) / len(tokens))
        for p in micro:
            odds = []
            for ids, labels in ((p["input_ids"], p["labels"]),
                                (p["rejected_input_ids"], p["rejected_labels"])):  # fmt: skip
                lp = token_logps(model, ids, labels)
                a = math.fsum(lp) / len(lp)
                odds.append(a - math.log(-math.expm1(a)))
            ratio.append(-math.log1p(math.exp(-(odds[0] - odds[1]))))  # log sigmoid
    return math.fsum(nll) - lam * math.fsum(ratio) / pairs


def _prompt_and_response(ids: list[int], labels: list[int]):
    """A side's prompt tokens (before its first labelled token) and the rest, with labels."""
    start = next(t for t, x in enumerate(labels) if x != IGNORE)
    return list(ids[:start]), list(ids[start:]), list(labels[start:])


def kto_loss(model, reference, passes: list[list[list[dict]]], partner, beta: float,
             desirable: float = 1.0, undesirable: float = 1.0) -> float:  # fmt: skip
    """KTO's loss (Ethayarajh et al. 2024, eq. 7-8) of a step's examples, averaged over
    every response: weight x (1 - sigmoid(beta (r - z))) for a desirable one, weight x (1 -
    sigmoid(beta (z - r))) for an undesirable one, r = log p - log p_ref summed over the
    response. An example is a labelled response (``desirable``: its label) or a pair (its
    chosen side desirable, its rejected side not). z, the reference point, of each pass (the
    ranks' micro batches taken together, ``passes``): the mean over its micro batches of
    their KL sequences' mean log p - log p_ref, not below 0; a KL sequence is a response's
    prompt with the same side's response of ``partner(example)``. Summed log-probs in
    float64 under ``model`` and ``reference``."""

    def ratio(ids, labels) -> float:
        return summed_logp(model, ids, labels) - summed_logp(reference, ids, labels)

    def responses(p) -> list[tuple[str, str, bool]]:  # (ids, labels, desirable) keys
        if "desirable" in p:
            return [("input_ids", "labels", bool(p["desirable"]))]
        return [("input_ids", "labels", True), ("rejected_input_ids", "rejected_labels", False)]

    losses = []
    for micro_batches in passes:
        means = []
        for micro in micro_batches:
            kl = []
            for p in micro:
                for ids, labels, _ in responses(p):
                    prompt, _, _ = _prompt_and_response(p[ids], p[labels])
                    _, other, other_labels = _prompt_and_response(partner(p)[ids],
                                                                  partner(p)[labels])  # fmt: skip
                    kl.append(ratio(prompt + other, [IGNORE] * len(prompt) + other_labels))
            means.append(math.fsum(kl) / len(kl))
        z = max(math.fsum(means) / len(means), 0.0)
        for micro in micro_batches:
            for p in micro:
                for ids, labels, good in responses(p):
                    r = ratio(p[ids], p[labels])
                    margin = beta * (r - z) if good else beta * (z - r)
                    losses.append((desirable if good else undesirable)
                                  * (1 - 1 / (1 + math.exp(-margin))))  # fmt: skip
    return math.fsum(losses) / len(losses)


def planned_steps(shards: Path, steps: int, nodes: int = 2) -> list[list[list[dict]]]:
    """The rows of each of the first ``steps`` planned steps, by global rank, read from the
    shards (``node-<k>.parquet``: the plan the trainers execute, one file per node)."""
    rows = []
    for node in range(nodes):
        rows += pq.read_table(shards / f"node-{node}.parquet").to_pylist()
    ranks = 1 + max(r["rank"] for r in rows)
    return [[[r for r in rows if r["step"] == k and r["rank"] == q] for q in range(ranks)]
            for k in range(steps)]  # fmt: skip


def sequence_score(model, input_ids: list[int]) -> float:
    """A reward model's score of one sequence: its logit at the last token (one sequence,
    no padding, so no pad handling enters)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([input_ids]))
    return out.logits.reshape(-1)[-1].double().item()


def reward_pair_loss(model, pairs: list[dict], centre: float | None = None,
                     margins: dict[str, float] | None = None) -> float:  # fmt: skip
    """A reward model's pairwise loss over ``pairs`` as the RewardTrainer's papers write it,
    averaged over the pairs: -log sigmoid(r_c - r_r - margin), plus ``centre`` x (r_c +
    r_r)^2 (centring), each side scored alone (``sequence_score``)."""
    losses = []
    for p in pairs:
        c, r = sequence_score(model, p["input_ids"]), sequence_score(model, p["rejected_input_ids"])
        m = (margins or {}).get(p["example_id"], 0.0)
        loss = math.log1p(math.exp(-(c - r - m)))
        losses.append(loss + (centre or 0.0) * (c + r) ** 2)
    return math.fsum(losses) / len(losses)


def completion_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The summed log-probability of ``completion`` after ``prompt`` (one sequence, no
    padding), with its graph."""
    ids = torch.tensor([prompt + completion])
    logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logps[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None])
    return picked.sum()


def rloo_grad_norm(model, reference, ranks: list[dict], weights: dict[str, float], beta: float,
                   generations: int) -> float:  # fmt: skip
    """The norm of the gradient of one RLOO step as the paper writes it (Ahmadian et al.,
    2024) with TRL's KL penalty, over data-parallel ``ranks`` (each one rank's rollouts:
    prompt_ids, completion_ids, rewards by function): each completion's reward is the
    weighted sum of its functions' values (those that gave one) less beta x its summed
    log-ratio to ``reference``; its advantage is that reward less the mean of the other
    completions of its prompt (``generations`` in a row, over the ranks' completions in rank
    order); each rank's loss is minus the mean of advantage x ratio (1 in value, the
    log-probability's gradient), and the step's gradient the mean of the ranks'."""
    logps, rewards = [], []
    for rank in ranks:
        for i, (prompt, completion) in enumerate(zip(rank["prompt_ids"], rank["completion_ids"],
                                                     strict=True)):  # fmt: skip
            logp = completion_logp(model, prompt, completion)
            with torch.no_grad():
                kl = logp - completion_logp(reference, prompt, completion) if beta else 0.0
            given = [(weights[k], v[i]) for k, v in rank["rewards"].items() if v[i] is not None]
            reward = sum(w * v for w, v in given) if given else math.nan
            logps.append(logp)
            rewards.append(reward - beta * float(kl))
    advantages = []
    for g in range(0, len(rewards), generations):
        group = rewards[g : g + generations]
        scored = [r for r in group if not math.isnan(r)]
        for r in group:
            if math.isnan(r) or len(scored) < 2:
                advantages.append(0.0)
            else:
                advantages.append(r - (sum(scored) - r) / (len(scored) - 1))
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    start = 0
    for rank in ranks:
        n = len(rank["completion_ids"])
        loss = -sum(a * torch.exp(lp - lp.detach())
                    for a, lp in zip(advantages[start : start + n], logps[start : start + n],
                                     strict=True)) / n  # fmt: skip
        for t, grad in zip(total, torch.autograd.grad(loss, params, allow_unused=True),
                           strict=True):  # fmt: skip
            if grad is not None:
                t += grad / len(ranks)
        start += n
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in total))


def teacher_topk(model, input_ids: list[int], labels: list[int], k: int):
    """The teacher's k most likely next tokens at each labelled token of one sequence:
    (ids [targets, k], log-probs [targets, k], float64), from log_softmax(logits[t - 1])."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    at = [t - 1 for t in range(1, len(input_ids)) if labels[t] != IGNORE]
    top = logp[at].topk(k, dim=-1)
    return top.indices, top.values


def distill_sums(
    model,
    row: dict,
    ids,
    logps,
    temperature: float,
    kind: str = "forward",
    forward_share: float = 0.5,
) -> tuple[float, float, int]:
    """One row's summed cross-entropy on its labelled tokens, its summed divergence from the
    teacher's stored top-k (``ids``, ``logps`` [targets, k]) as the distillation papers
    write it (Hinton et al.: both softened by the temperature, times its square), and its
    target count; float64. Forward: sum_k p_k (log p_k - log q_k), p the teacher's top-k
    renormalised at T, q the student's softmax at T over the whole vocabulary; reverse:
    sum_k r_k (log r_k - log p_k), r the student's top-k probabilities renormalised."""
    input_ids, labels = row["input_ids"], row["labels"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
    at = [t for t in range(1, len(input_ids)) if labels[t] != IGNORE]
    ce, div = [], []
    for j, t in enumerate(at):
        z = logits[t - 1]
        ce.append(-(z[labels[t]] - torch.logsumexp(z, 0)).item())
        teacher = [float(x) / temperature for x in logps[j]]
        norm = math.log(math.fsum(math.exp(x) for x in teacher))
        p = [x - norm for x in teacher]  # log p_k
        zt = z / temperature
        q = [(zt[int(i)] - torch.logsumexp(zt, 0)).item() for i in ids[j]]  # log q_k
        fwd = math.fsum(math.exp(a) * (a - b) for a, b in zip(p, q, strict=True))
        qn = math.log(math.fsum(math.exp(b) for b in q))
        rev = math.fsum(math.exp(b - qn) * (b - qn - a) for a, b in zip(p, q, strict=True))
        d = {
            "forward": fwd,
            "reverse": rev,
            "mixed": forward_share * fwd + (1 - forward_share) * rev,
        }[kind]
        div.append(d * temperature**2)
    return math.fsum(ce), math.fsum(div), len(at)
