"""A mixture of experts' router kept in balance while training: the load-balancing
auxiliary loss in the loss, and each step's expert load in the metrics.

transformers' MoE models compute the auxiliary loss (``output_router_logits``; Switch
Transformer's: experts x the sum over experts of the fraction of routing choices sent to it
times its mean router probability, over the micro batch's tokens and every MoE layer) and
add ``router_aux_loss_coef`` times it to their loss. Under the trainer that loss is then
scaled for the token-balanced cross-entropy (times the ranks, gradients summed over the
micro batches of a step), which would weigh the auxiliary term ranks x accumulation times
too much. So the model's own addition is switched off and the term is added here at
coefficient / accumulation per micro batch: what the step optimises, and the ``aux_loss``
it logs, is the cross-entropy's token mean plus the coefficient times the mean of the
micro batches' auxiliary losses over every rank (tests/test_moe.py checks both against a
computation written out from the router's logits).

``router_aux_loss_coef`` (the run's key): `auto` is the model's config.json value; 0 turns
the term off (the load is still logged).
"""

from __future__ import annotations

from typing import Any


def trl_coef(run: dict[str, Any], model) -> float | None:
    """The ``router_aux_loss_coef`` a TRL preference trainer (DPO's, KTO's) takes, which adds
    coefficient x the router's loss per micro batch itself: None (the model's own) for
    ``auto`` or a model without router logits, else the run's."""
    setting = run["router_aux_loss_coef"]
    if setting == "auto" or not hasattr(model.config, "output_router_logits"):
        return None
    return setting


class Router:
    """The auxiliary loss and the expert load of one training job's MoE model."""

    def __init__(self, coef: float, experts: int, top_k: int, accumulation: int):
        self.coef, self.experts, self.top_k = coef, experts, top_k
        self.accumulation = accumulation

    @classmethod
    def prepare(cls, model, run: dict[str, Any]) -> Router | None:
        """Router logits on for ``model`` (its own addition of the term off); None for a
        dense model."""
        config = model.config
        top_k = getattr(config, "num_experts_per_tok", None)
        if not top_k or not hasattr(config, "output_router_logits"):
            return None
        setting = run.get("router_aux_loss_coef", "auto")
        coef = getattr(config, "router_aux_loss_coef", 0.0) if setting == "auto" else setting
        config.output_router_logits = True
        for module in model.modules():  # the causal LM reads its coefficient at build time
            if hasattr(module, "router_aux_loss_coef"):
                module.router_aux_loss_coef = 0.0
        from snaketune.core.modelshape import experts_of

        experts = experts_of(config.to_dict())
        return cls(float(coef), int(experts), int(top_k), run["gradient_accumulation_steps"])

    def term(self, outputs):
        """What one micro batch adds to the loss the trainer returns."""
        return self.coef * outputs.aux_loss / self.accumulation

    def load(self, outputs, mask=None):
        """Routing choices per expert over the micro batch's tokens (padding left out) and
        every MoE layer."""
        import torch

        counts = torch.zeros(self.experts, device=outputs.aux_loss.device)
        keep = None if mask is None else mask.reshape(-1).bool()
        for logits in outputs.router_logits or ():
            chosen = logits.topk(self.top_k, dim=-1).indices
            if keep is not None and chosen.shape[0] == keep.shape[0]:
                chosen = chosen[keep]
            counts += torch.bincount(chosen.reshape(-1), minlength=self.experts).to(counts)
        return counts

    def record(self, trainer, outputs, inputs) -> None:
        """The micro batch's auxiliary loss (mean over ranks) and expert load (summed over
        ranks: the busiest expert's share over an even share, 1.0 balanced) into the
        trainer's metrics, which TRL's log averages over the step's micro batches."""
        aux = trainer.accelerator.gather(outputs.aux_loss.detach().float().reshape(1))
        counts = trainer.accelerator.gather(self.load(outputs, inputs.get("attention_mask"))[None])
        total = counts.reshape(-1, self.experts).sum(0)
        even = total.sum() / self.experts
        metrics = trainer._metrics["train"]
        metrics["aux_loss"].append(aux.mean().item())
        metrics["expert_load"].append((total.max() / even).item() if even > 0 else 0.0)


STEP_FIELDS = ("aux_loss", "expert_load")  # the step's metrics.jsonl fields of an MoE run
