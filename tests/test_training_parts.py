"""What every method's trainer is built from (snaketune.methods.training), each part in
this process in milliseconds, against the run's own values and computations written out
here: the shared training arguments, the LoRA config, the FLOP count and its store, the
planned pairs' weighting, and a mixture of experts' router (its coefficient, its
auxiliary term, its expert load with padding left out, the step's figures)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from snaketune.plan.config import load_yaml, validate_config


def demo_run() -> dict:
    return validate_config(load_yaml(ROOT / "config" / "config.yaml"))["runs"]["demo"]


def context(tmp_path, run, **kw):
    from snaketune.methods.training import Context

    made = {"run": run, "env": None, "model_dir": tmp_path / "model",
            "deepspeed": ROOT / "config/deepspeed/zero2.json", "ckpt_dir": tmp_path / "ckpt",
            "out": tmp_path / "out", "precision": "bf16", "liger": True, "tokenizer": None}  # fmt: skip
    return Context(**{**made, **kw})


def test_the_shared_training_arguments_are_the_run_s_settings(tmp_path, monkeypatch):
    """Each setting from its own key of the run (every value distinct, so a key read for
    another shows), precision as one flag, the held-out pass's settings, the method's own
    arguments passed on, and wandb's settings only where it is enabled."""
    from snaketune.evaluation.model import load_deepspeed
    from snaketune.methods.training import training_args

    for name in ("TENSORBOARD_LOGGING_DIR", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    run = demo_run()
    run.update(micro_batch_size=3, gradient_accumulation_steps=5, epochs=7, max_steps=11,
               learning_rate=0.0123, lr_scheduler="linear", warmup_ratio=0.07,
               weight_decay=0.011, max_grad_norm=0.9, seed=1234, gradient_checkpointing=True,
               save_steps=17, logging_steps=3, timeout_minutes=2.5, eval_at_start=True)  # fmt: skip
    run["wandb"] = {"enabled": True, "mode": "offline", "project": "proj"}
    heldout = SimpleNamespace(metric="loss", batch_size=6)
    got = training_args(context(tmp_path, run, heldout=heldout), dict, beta=0.25)
    want = {
        "output_dir": str(tmp_path / "ckpt"), "per_device_train_batch_size": 3,
        "gradient_accumulation_steps": 5, "num_train_epochs": 7, "max_steps": 11,
        "learning_rate": 0.0123, "lr_scheduler_type": "linear", "warmup_steps": 0.07,
        "weight_decay": 0.011, "max_grad_norm": 0.9, "seed": 1234, "data_seed": 1234,
        "bf16": True, "fp16": False, "use_cpu": not torch.cuda.is_available(),
        "use_liger_kernel": True, "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False}, "save_strategy": "steps",
        "save_steps": 17, "save_total_limit": None, "logging_steps": 3,
        "report_to": ["tensorboard", "wandb"],
        "deepspeed": load_deepspeed(ROOT / "config/deepspeed/zero2.json"),
        "disable_tqdm": True, "dataloader_num_workers": 0, "remove_unused_columns": False,
        "average_tokens_across_devices": True, "ddp_timeout": 150, "log_level": "warning",
        "log_level_replica": "warning", "metric_for_best_model": "eval_loss",
        "greater_is_better": False, "eval_on_start": True, "per_device_eval_batch_size": 6,
        "beta": 0.25,
    }  # fmt: skip
    assert got == want
    import os

    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "out/tensorboard")
    assert (os.environ["WANDB_MODE"], os.environ["WANDB_PROJECT"]) == ("offline", "proj")
    # a resumed job does not evaluate at its start again; no max_steps, no epochs: one epoch
    del run["max_steps"], run["epochs"]
    run["wandb"] = {"enabled": False, "mode": "online", "project": "other"}
    monkeypatch.delenv("WANDB_MODE")
    again = training_args(context(tmp_path, run, heldout=heldout, start_step=4, precision="fp16",
                                  liger=False), dict)  # fmt: skip
    assert (again["max_steps"], again["num_train_epochs"]) == (-1, 1)
    assert again["eval_on_start"] is False and "beta" not in again
    assert (again["bf16"], again["fp16"], again["use_liger_kernel"]) == (False, True, False)
    assert again["report_to"] == ["tensorboard"] and "WANDB_MODE" not in os.environ
    plain = training_args(context(tmp_path, run, precision="fp32"), dict)
    assert (plain["bf16"], plain["fp16"]) == (False, False)
    assert "metric_for_best_model" not in plain  # no held-out set


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    return LlamaForCausalLM(config)


def tiny_mixtral(**kw):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2, **kw)  # fmt: skip
    return MixtralForCausalLM(config)


def test_the_lora_config_is_the_run_s_and_a_full_run_has_none():
    from snaketune.methods.training import peft_config

    run = demo_run()
    run["lora"].update(r=5, alpha=7, dropout=0.125, modules_to_save=["lm_head"])
    config = peft_config(run, tiny_llama())
    assert (config.r, config.lora_alpha, config.lora_dropout) == (5, 7, 0.125)
    assert config.task_type == "CAUSAL_LM" and config.modules_to_save == ["lm_head"]
    assert config.target_modules == "all-linear"  # peft's own, on a dense model
    run["lora"]["modules_to_save"] = []
    assert peft_config(run, tiny_llama()).modules_to_save is None
    run["method"] = "full"
    assert peft_config(run, tiny_llama()) is None


def test_a_reward_model_s_lora_trains_a_score_head_and_fused_experts_take_no_dropout():
    """A reward model's adapters are a sequence classifier's (peft trains the new score head
    whole); on a mixture of experts with fused expert parameters the config carries no
    dropout (peft refuses one there), on a dense model the run's."""
    from snaketune.methods.training import peft_config

    run = demo_run()
    run["lora"]["dropout"] = 0.125
    run["method"] = "reward"
    assert peft_config(run, tiny_llama()).task_type == "SEQ_CLS"
    run["method"] = "lora"
    moe = peft_config(run, tiny_mixtral())
    assert moe.target_parameters and moe.lora_dropout == 0.0
    assert peft_config(run, tiny_llama()).lora_dropout == 0.125


def test_the_settings_read_from_yaml_compare_by_value(tmp_path):
    """Strings built at run time (as YAML's are), not the interned literals of the code:
    the precision, ``auto`` of the router's coefficient."""
    from snaketune.methods.training import Router, training_args, trl_coef

    bf16, auto = "".join(["bf", "16"]), "".join(["au", "to"])
    args = training_args(context(tmp_path, demo_run(), precision=bf16), dict)
    assert (args["bf16"], args["fp16"]) == (True, False)
    fp16 = "".join(["fp", "16"])
    assert training_args(context(tmp_path, demo_run(), precision=fp16), dict)["fp16"] is True
    model = tiny_mixtral(router_aux_loss_coef=0.02)
    assert trl_coef({"router_aux_loss_coef": auto}, model) is None
    assert Router.prepare(model, {"router_aux_loss_coef": auto,
                                  "gradient_accumulation_steps": 1}).coef == 0.02  # fmt: skip


def test_the_flop_count_reads_the_parameters_once_and_is_stored_without_a_broadcast():
    from snaketune.methods.training import Lean

    class Base:
        def store_flos(self):
            self.broadcast = True

    class Trainer(Lean, Base):
        pass

    asked = []

    def num_parameters(exclude_embeddings=False):
        asked.append(exclude_embeddings)
        return 1000 if exclude_embeddings else 5000

    t = Trainer()
    t.model = SimpleNamespace(main_input_name="input_ids", num_parameters=num_parameters)
    assert t.floating_point_ops({"input_ids": torch.zeros(2, 7)}) == 6 * 14 * 1000
    assert t.floating_point_ops({"input_ids": torch.zeros(1, 3)}) == 6 * 3 * 1000
    assert asked == [True]  # counted once
    assert t.floating_point_ops({"pixel_values": torch.zeros(2, 7)}) == 0
    t.model = SimpleNamespace(main_input_name="pixel_values")
    assert t.floating_point_ops({"pixel_values": torch.zeros(2, 7)}) == 0  # no count there
    t.args, t.state, t.current_flos = (
        SimpleNamespace(world_size=1),
        SimpleNamespace(total_flos=5),
        7,
    )
    t.store_flos()
    assert (t.state.total_flos, t.current_flos) == (12, 0) and not hasattr(t, "broadcast")
    t.args.world_size = 2
    t.store_flos()
    assert t.broadcast


def test_planned_pairs_weigh_each_micro_batch_by_its_pairs():
    from snaketune.methods.training import PlannedPairs

    class Base:
        def __init__(self, *args, **kwargs):
            self.given = (args, kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return torch.tensor(2.0) if not return_outputs else ("loss", "outputs")

    class Trainer(PlannedPairs, Base):
        pass

    t = Trainer("model", planned="data", run={"micro_batch_size": 4}, args="a")
    assert (t.planned, t.micro_batch_size, t.given) == ("data", 4, (("model",), {"args": "a"}))
    three_pairs = {"input_ids": torch.zeros(6, 5)}
    assert t.pairs_in(three_pairs) == 3 and t.pairs_in({"input_ids": torch.zeros(7, 1)}) == 3
    assert t.compute_loss(None, three_pairs).item() == pytest.approx(2.0 * 3 / 4)
    assert t.compute_loss(None, three_pairs, return_outputs=True) == ("loss", "outputs")
    assert t._prepare_dataset("rows", "x") == "rows"


def test_the_router_s_coefficient_term_load_and_figures():
    """prepare: the model's coefficient under ``auto``, the run's otherwise (0 kept as 0),
    none where the model's config has none (a bias balances it), the model's own addition
    off; a dense model has no router. load: each layer's top-k choices per expert, padding
    left out, counted here by hand; term: coefficient x aux / accumulation, nothing at 0;
    record: the mean over ranks, the busiest expert's share over an even one."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from snaketune.methods.training import Router, trl_coef

    run = {"router_aux_loss_coef": "auto", "gradient_accumulation_steps": 3}
    assert Router.prepare(tiny_llama(), run) is None
    model = tiny_mixtral(router_aux_loss_coef=0.02)
    router = Router.prepare(model, run)
    assert (router.coef, router.experts, router.top_k, router.accumulation) == (0.02, 4, 2, 3)
    assert model.config.output_router_logits is True and model.router_aux_loss_coef == 0.0
    assert trl_coef(run, model) is None and trl_coef(run, tiny_llama()) is None
    assert trl_coef({"router_aux_loss_coef": 0.0}, model) == 0.0
    assert trl_coef({"router_aux_loss_coef": 0.5}, tiny_llama()) is None
    assert Router.prepare(tiny_mixtral(), {**run, "router_aux_loss_coef": 0.0}).coef == 0.0
    assert Router.prepare(tiny_mixtral(), {**run, "router_aux_loss_coef": 0.5}).coef == 0.5
    config = SimpleNamespace(num_experts_per_tok=2, output_router_logits=False,
                             router_aux_loss_coef=None, model_type="glm4_moe",
                             to_dict=lambda: {"n_routed_experts": 8})  # fmt: skip
    bias = SimpleNamespace(config=config, modules=lambda: [])  # a bias balances its experts
    assert Router.prepare(bias, run).coef == 0.0 and config.output_router_logits is True
    # experts chosen per token but no router logits to ask for; no experts chosen: no router
    no_logits = SimpleNamespace(num_experts_per_tok=2, model_type="x")
    assert Router.prepare(SimpleNamespace(config=no_logits), run) is None
    no_top_k = SimpleNamespace(num_experts_per_tok=None, output_router_logits=False)
    assert Router.prepare(SimpleNamespace(config=no_top_k), run) is None

    torch.manual_seed(0)
    layers = (torch.randn(6, 4), torch.randn(6, 4))  # 2 sequences of 3 tokens, 2 layers
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])  # the second's first token is padding
    want = [0] * 4
    for logits in layers:
        for token, row in enumerate(logits.tolist()):
            if mask.reshape(-1)[token]:
                for e in sorted(range(4), key=lambda e: -row[e])[:2]:
                    want[e] += 1
    outputs = SimpleNamespace(logits=torch.zeros(1), router_logits=layers, aux_loss=None)
    assert router.load(outputs, mask).tolist() == want
    assert router.load(outputs).sum().item() == 2 * 6 * 2  # no mask: every token
    # router logits not one row per token of the mask (fewer, more): counted whole
    for rows in (3, 9):
        odd = SimpleNamespace(logits=torch.zeros(1), router_logits=(torch.randn(rows, 4),))
        assert router.load(odd, mask).sum().item() == rows * 2
    # a long batch (shapes past the small integers Python keeps one object of)
    long_mask = torch.ones(2, 150, dtype=torch.long)
    long_mask[1, :40] = 0
    long = SimpleNamespace(logits=torch.zeros(1), router_logits=(torch.randn(300, 4),))
    assert router.load(long, long_mask).sum().item() == (300 - 40) * 2
    assert router.aux(outputs, mask) == load_balancing_loss_func(layers, 4, 2, mask)
    own = SimpleNamespace(**{**vars(outputs), "aux_loss": torch.tensor(0.6)})
    assert router.aux(own) == torch.tensor(0.6)
    assert router.term(own).item() == pytest.approx(0.02 * 0.6 / 3)
    assert Router(0.0, 4, 2, 3).term(own) == 0.0

    metrics = defaultdict(lambda: defaultdict(list))
    trainer = SimpleNamespace(_metrics=metrics, accelerator=SimpleNamespace(
        gather=lambda t: torch.cat([t, t * 0 + t])))  # two ranks alike  # fmt: skip
    router.record(trainer, own, {"attention_mask": mask})
    assert metrics["train"]["aux_loss"] == [pytest.approx(0.6)]
    assert metrics["train"]["expert_load"] == [pytest.approx(max(want) / (sum(want) / 4))]
    # an uneven total (7 choices over 4 experts: an even share 1.75, not 1) and a total of
    # one choice per expert (an even share of exactly 1)
    for counts, share in (([3.0, 2.0, 1.0, 1.0], 3 / 1.75), ([1.0, 1.0, 1.0, 1.0], 1.0)):
        one_rank = SimpleNamespace(**{**vars(trainer), "accelerator": SimpleNamespace(
            gather=lambda t: t)})  # fmt: skip
        router.load = lambda outputs, mask=None, c=counts: torch.tensor(c)
        router.record(one_rank, own, {})
        assert metrics["train"]["expert_load"][-1] == pytest.approx(share)
    del router.load
    empty = SimpleNamespace(logits=torch.zeros(1), router_logits=(), aux_loss=torch.tensor(0.0))
    router.record(trainer, empty, {})
    assert metrics["train"]["expert_load"][-1] == 0.0  # no choices: no share
