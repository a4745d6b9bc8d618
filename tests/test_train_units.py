"""Fast checks of the training plumbing: sampler, checkpoint bookkeeping, launch commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file

from snaketune.core.checkpoints import COMPLETE, newest_complete, prune, truncate_metrics
from snaketune.data.batches import PlanBatches
from snaketune.evaluation.model import resolve_precision
from snaketune.train.agents import supervise
from snaketune.train.commands import RENDEZVOUS, local_commands, slurm_command


def test_plan_batches_run_each_planned_micro_batch_once_per_epoch():
    import numpy as np

    step = np.array([1, 0, 2, 1, 0, 2, 0, 1, 2, 0])
    micro = np.array([0, 0, 1, 1, 1, 0, 1, 0, 1, 0])
    batches = PlanBatches(step, micro, steps=3, accumulation=2, seed=0)
    assert len(batches) == 6
    first = list(batches)
    assert first == [[1, 9], [4, 6], [0, 7], [3], [5], [2, 8]]  # as planned, step by step
    second = list(batches)
    assert sorted(map(tuple, second)) == sorted(map(tuple, first))  # the same micro batches
    assert second == first[4:6] + first[0:2] + first[2:4]  # steps 2, 0, 1: (seed 0, epoch 1)
    resumed = PlanBatches(step, micro, steps=3, accumulation=2, seed=0, start_epoch=1)
    assert list(resumed) == second  # a resumed run continues the same order


def test_plan_batches_refuse_an_empty_micro_batch():
    import numpy as np

    with pytest.raises(Exception, match="plans no example for step 1 micro batch 0"):
        PlanBatches(np.array([0, 0]), np.array([0, 0]), steps=2, accumulation=1, seed=0)


def test_only_complete_checkpoints_count_and_are_kept(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}" / COMPLETE).write_text("{}")
    assert newest_complete(tmp_path).name == "checkpoint-6"  # checkpoint-8 is half-written
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
    ]
    (tmp_path / "checkpoint-8" / COMPLETE).write_text("{}")
    (tmp_path / "checkpoint-7").mkdir()  # older than the newest complete one: garbage
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-8"]


def test_truncate_metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"step": {i}}}\n' for i in range(1, 8)))
    truncate_metrics(path, 4)
    assert path.read_text().splitlines() == [
        '{"step": 1}',
        '{"step": 2}',
        '{"step": 3}',
        '{"step": 4}',
    ]


def test_precision_follows_the_machine():
    """auto: bf16 on a GPU that has it (fp16 on one that does not), fp32 on CPU; a half
    precision asked for on CPU falls back to fp32. CPU here, a GPU node elsewhere."""
    import torch

    if torch.cuda.is_available():
        half = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        assert resolve_precision("auto") == half
        assert resolve_precision("fp16") == "fp16"
    else:
        assert resolve_precision("auto") == "fp32"
        assert resolve_precision("bf16") == "fp32"
    assert resolve_precision("fp32") == "fp32"


def test_the_deepspeed_presets_on_cpu_drop_the_gpu_parts_and_the_per_step_buckets(monkeypatch):
    """On CPU: no DeepSpeed optimizer or offload (the Trainer's AdamW, no fused GPU kernels
    built), and ZeRO-1/2 without contiguous gradient buckets (allocated at every micro step);
    ZeRO-3's settings and every preset on a GPU as written; a universal resume marked."""
    from snaketune.evaluation.model import load_deepspeed

    presets = ROOT / "config" / "deepspeed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("zero1.json", "zero2.json", "zero3.json", "zero3_offload.json"):
        written = json.loads((presets / name).read_text())
        config = load_deepspeed(presets / name, load_universal=name == "zero1.json")
        zero, was = config["zero_optimization"], written["zero_optimization"]
        assert "optimizer" not in config and not {"offload_optimizer", "offload_param"} & set(zero)
        if was["stage"] in (1, 2):
            assert zero["contiguous_gradients"] is False, name
        else:
            assert zero.get("contiguous_gradients") == was.get("contiguous_gradients"), name
        assert {k: v for k, v in zero.items() if k != "contiguous_gradients"} == {
            k: v for k, v in was.items()
            if k not in ("contiguous_gradients", "offload_optimizer", "offload_param")
        }  # fmt: skip
        assert config.get("checkpoint", {}).get("load_universal", False) == (name == "zero1.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("zero2.json", "zero3_offload.json"):
        assert load_deepspeed(presets / name) == json.loads((presets / name).read_text())


def test_local_commands_one_agent_per_emulated_node():
    cmds = local_commands(3, 2, ["train.py", "--worker"], "run1", 29999)
    assert len(cmds) == 3
    for cmd in cmds:
        text = " ".join(cmd)
        # torchrun's own main, a stop by a signal an exit code (snaketune.train.torchrun)
        assert "-m snaketune.train.torchrun --nnodes 3 --nproc-per-node 2" in text
        assert "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29999 --rdzv-id run1" in text
        assert "--max-restarts 0" in text and "SIGUSR1" in text
        assert cmd[-2:] == ["train.py", "--worker"]


def test_slurm_command_one_task_per_node_rendezvous_on_the_first_host():
    cmd = slurm_command(4, 8, ["train.py", "--worker", "--run-spec", '{"a": 1}'], "run1")
    assert cmd[:6] == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "bash",
    ]
    inner = cmd[-1]
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in inner
    assert "PORT=$(( 29500 + SLURM_JOB_ID % 10000 ))" in inner
    assert "--rdzv-endpoint $HEAD:$PORT" in inner and "--nnodes 4 --nproc-per-node 8" in inner
    assert "'{\"a\": 1}'" in inner  # arguments stay quoted
    assert "--rdzv-conf is_host=$IS_HOST" in inner
    subprocess.run(["bash", "-n", "-c", inner], check=True)  # valid shell
    # what the task's shell makes of it on the first and the second node
    for node, host in (("0", "1"), ("1", "0")):
        env = {"SLURM_NODEID": node, "SLURM_JOB_ID": "17", "PATH": "/usr/bin:/bin",
               "SLURM_JOB_NODELIST": "n1"}  # fmt: skip
        shown = subprocess.run(
            ["bash", "-c", RENDEZVOUS + 'echo "$PORT $IS_HOST"'], env=env, capture_output=True,
            text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert shown == ["29517", host]


def test_supervise_stops_the_others_when_one_agent_fails():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    failer = [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(7)"]
    start = time.monotonic()
    code, signalled = supervise([sleeper, failer], env=None, grace=5)
    assert (code, signalled) == (7, None)
    assert time.monotonic() - start < 10


def test_write_shards_streams_a_plan_into_loadable_shards(tmp_path):
    """The streaming writer: shards bounded by max_bytes, floats cast, other dtypes kept,
    headers that safetensors and transformers' index format accept."""
    from snaketune.export.convert import write_shards

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.weight": torch.randn(100, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(10, dtype=torch.int64),
        "c.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
    }
    plan = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    out = tmp_path / "out"
    out.mkdir()
    weight_map = write_shards(plan, iter(tensors.items()), out, 64 * 32 * 2, torch.bfloat16)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == 2 and files[0] == "model-00001-of-00002.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and set(weight_map) == set(tensors)
    loaded = {}
    for f in files:
        loaded.update(load_file(str(out / f)))
    for name, t in tensors.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in loaded.values()
    )

    one = tmp_path / "one"
    one.mkdir()
    write_shards(plan, iter(tensors.items()), one, 10**9, torch.float32)
    assert sorted(p.name for p in one.iterdir()) == ["model.safetensors"]

    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(RuntimeError, match="expected b.weight"):
        write_shards(plan, iter(list(tensors.items())[::2]), bad, 10**9, torch.float32)


def test_preflight_names_the_node_that_does_not_share_the_run_dir(tmp_path, monkeypatch):
    """node_check/gather without SLURM: two nodes on loopback, node 1's file missing
    (a run directory on a node-local disk), then a device count that does not match."""
    import threading

    from snaketune.core.errors import UserError
    from snaketune.train.commands import free_port
    from snaketune.train.preflight import check_port, gather, node_check

    port = free_port()
    peer = threading.Thread(target=check_port, args=("127.0.0.1", port, 1, 2, 20.0))
    monkeypatch.setenv("SLURM_NODEID", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    peer.start()
    result = node_check(tmp_path, 2, "127.0.0.1", port, 2, timeout=20.0)
    peer.join()
    assert result["problems"] == [] and result["head_address"] == "127.0.0.1"
    with pytest.raises(UserError, match=r"node\(s\) \[1\] did not write .* not on a filesystem"):
        gather(tmp_path, 2)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    node_check(tmp_path, 2, "127.0.0.1", free_port(), 1)
    with pytest.raises(UserError, match="sees 1 devices .* the run asks for 2"):
        gather(tmp_path, 1)


def test_deadline_is_due_when_a_step_a_save_and_the_margin_no_longer_fit():
    from snaketune.train.progress import Deadline

    assert not Deadline(None, 60).due()  # no limit known
    d = Deadline(end=1000.0, margin_s=100.0, save_guess_s=40.0)
    d.steps = [5.0, 10.0, 8.0]  # the longest recent step counts: 10
    assert not d.due(now=839.0)  # 839 + 10 + 1.25 x 40 + 100 = 999
    assert d.due(now=841.0)
    d.saved(4.0)  # a measured save replaces the guess
    assert not d.due(now=880.0) and d.due(now=886.0)  # + 10 + 5 + 100


def _callback_step(signal_name, deadline):
    from types import SimpleNamespace

    from transformers import TrainerControl

    from snaketune.train.progress import StepCallback, StopRequest

    collator = SimpleNamespace(tokens=0, padded=0, samples=0, squares=0)
    stop = StopRequest()
    stop.signal = signal_name
    cb = StepCallback(0, collator, stop, None, 2, 0, deadline=deadline)
    control = cb.on_step_end(None, SimpleNamespace(global_step=7), TrainerControl())
    return cb, control


def test_usr1_or_the_deadline_stop_to_continue_sigterm_to_stop():
    from snaketune.train.progress import Deadline

    for signal_name, deadline, reason in [
        ("SIGUSR1", None, "time"),  # SLURM's warning ahead of the limit
        (None, Deadline(end=0.0, margin_s=0.0), "time"),  # our own deadline, long past
        ("SIGTERM", None, "signal"),  # scancel, preemption: stop for good
        (None, Deadline(end=None, margin_s=0.0), None),
    ]:
        cb, control = _callback_step(signal_name, deadline)
        assert cb.stop_reason == reason, (signal_name, deadline)
        assert control.should_save == control.should_training_stop == (reason is not None)
        if reason:
            assert cb.stopped_at == 7


def test_sigint_saves_and_stops_like_sigterm_and_a_repeat_is_the_same_request():
    """Ctrl-C reaches a rank from the launcher and again from its torchrun agent: the first
    asks for a save at the step's end and a stop for good, a repeat changes nothing (the
    launcher, not the rank, stops at once on a second Ctrl-C)."""
    import os
    import signal as sig

    from snaketune.train.progress import StopRequest

    cb, control = _callback_step("SIGINT", None)
    assert cb.stop_reason == "signal" and control.should_save and control.should_training_stop
    stop = StopRequest()
    previous = {s: sig.getsignal(s) for s in (sig.SIGINT, sig.SIGTERM, sig.SIGUSR1)}
    try:
        stop.install()
        os.kill(os.getpid(), sig.SIGINT)  # no KeyboardInterrupt: a request
        os.kill(os.getpid(), sig.SIGINT)
        assert stop.signal == "SIGINT"
    finally:
        for s, handler in previous.items():
            sig.signal(s, handler)


def test_slurms_time_warning_while_a_rank_loads_is_a_stop_at_its_first_step():
    """SLURM's SIGUSR1 ahead of the time limit may come up to a minute early, to every
    process of the job's step: while a rank or an agent still imports torch (a slow node, a
    short job), or to a process a rank started (the CI SLURM demo's train job failed with
    exit 138 once from the first, and once from the second: DeepSpeed's JIT build's `ninja`
    died of it). Held from the entry script's first line, it ends no process, a process
    started afterwards included, and the rank's StopRequest takes it at its step end as
    SLURM's warning (a save, a stop to continue in the next job); a stop for good stays."""
    import os
    import signal as sig
    import subprocess
    import time

    from snaketune.core import imports
    from snaketune.train.progress import StopRequest

    previous = {s: sig.getsignal(s) for s in (sig.SIGINT, sig.SIGTERM, sig.SIGUSR1)}
    try:
        imports.hold_time_warning()
        quiet = StopRequest()
        quiet.install()
        assert quiet.signal is None  # none came: no request
        child = subprocess.Popen(["sleep", "30"])  # started by a "rank": the build's ninja
        time.sleep(0.2)
        os.kill(os.getpid(), sig.SIGUSR1)  # while "loading": held, the process lives
        child.send_signal(sig.SIGUSR1)
        time.sleep(0.3)
        assert child.poll() is None, f"the child died of SIGUSR1 ({child.returncode})"
        child.kill()
        child.wait()
        stop = StopRequest()
        stop.install()
        assert stop.signal == "SIGUSR1" and stop.signal not in StopRequest.STOPS
        assert not imports.take_time_warning()  # taken once
        os.kill(os.getpid(), sig.SIGUSR1)  # a step later: the same request
        stop.poll()
        assert stop.signal == "SIGUSR1"
        stop.signal = "SIGTERM"
        os.kill(os.getpid(), sig.SIGUSR1)
        stop.poll()
        assert stop.signal == "SIGTERM"  # a stop for good is not made a stop to continue
    finally:
        imports.take_time_warning()
        sig.pthread_sigmask(sig.SIG_UNBLOCK, {sig.SIGUSR1})
        for s, handler in previous.items():
            sig.signal(s, handler)
    # the entry scripts of an agent and a rank hold it before they load anything heavy
    for script, before in ((ROOT / "scripts/snaketune/train/torchrun.py", "quiet_torchrun()"),
                           (ROOT / "scripts/train.py", "Job.read(")):  # fmt: skip
        text = script.read_text()
        assert "hold_time_warning(" in text
        assert text.rindex("hold_time_warning(") < text.rindex(before), script


def test_a_run_that_cannot_learn_is_warned_about_in_its_first_steps(tmp_path):
    """Each check on the metrics rows a run writes, against rows made here: GRPO rewards
    equal in every group with every completion clipped, a zero gradient, a learning rate
    that stays 0, a loss that is not a number or does not change; each said once, kept in warnings.jsonl and
    dropped when a run starts afresh."""
    from snaketune.train.vitals import WINDOW, Vitals, checks, read

    grpo = {"method": "grpo", "grpo": {"max_completion_length": 64}}
    flat = [{"step": i, "loss": 0.0, "lr": 1e-5, "grad_norm": 0.0, "reward_std": 0.0,
             "completion_clipped": 1.0} for i in range(1, WINDOW + 1)]  # fmt: skip
    assert checks(grpo, flat[:-1]) == {}  # not yet: one step short of the window
    found = checks(grpo, flat)
    assert list(found) == ["reward_std"]  # the zero gradient is its consequence
    assert found["reward_std"].startswith(f"no learning signal: reward_std 0 in each of the "
                                          f"first {WINDOW} steps")  # fmt: skip
    assert "every completion is cut at grpo.max_completion_length (64) (completion_clipped " in (
        found["reward_std"])  # fmt: skip
    moving = [{**r, "reward_std": 0.3, "grad_norm": 0.5} for r in flat]
    assert list(checks(grpo, moving)) == ["completion_clipped"]
    one_varies = [*flat[:-1], {**flat[-1], "reward_std": 0.1, "grad_norm": 0.2}]
    assert "reward_std" not in checks(grpo, one_varies)
    sft = [{"step": i, "loss": 2.0, "lr": 0.0, "grad_norm": 0.0} for i in range(1, 6)]
    lora = {"method": "lora"}
    assert list(checks(lora, sft)) == ["grad_norm", "lr"]  # the flat loss: their consequence
    stuck = [{**r, "lr": 1e-4, "grad_norm": 0.7} for r in sft]  # a gradient, yet the same loss
    assert checks(lora, stuck)["loss_flat"].startswith(
        f"loss 2 in each of the first {WINDOW} steps, on different batches")  # fmt: skip
    assert checks(lora, stuck[:-1]) == {}
    learning = [{**r, "loss": 2.0 - 1e-4 * r["step"]} for r in stuck]
    assert checks(lora, learning) == {}
    assert "loss is nan at step 3" in checks(lora, [{"step": 3, "loss": float("nan")}])["loss"]
    vitals = Vitals(grpo, tmp_path, fresh=True)
    said = [line for r in flat + flat for line in vitals.see(r)]
    assert said == [found["reward_std"]]  # once
    assert read(tmp_path) == {"reward_std": found["reward_std"]}
    resumed = Vitals(grpo, tmp_path, fresh=False)  # a resumed run: said already
    assert [line for r in flat for line in resumed.see(r)] == []
    Vitals(grpo, tmp_path, fresh=True)
    assert read(tmp_path) == {}


def test_status_says_a_failed_training_s_reason_its_warnings_and_an_interrupted_stage(
        tmp_path, monkeypatch):  # fmt: skip
    """`snaketune status` from the files a failed run leaves: the last attempt's one-line
    reason, what the first steps warned, a stage Snakemake left incomplete (no Snakemake
    holds the directory: interrupted, not running)."""
    from base64 import urlsafe_b64encode

    from snaketune.app.status import status

    monkeypatch.setenv("PATH", "/nonexistent")  # no squeue: off SLURM
    run = tmp_path / "results/x"
    (run / "shards").mkdir(parents=True)
    (run / "shards/manifest.json").write_text("{}")
    (run / "train/logs").mkdir(parents=True)
    (run / "train/logs/attempts.jsonl").write_text(
        json.dumps({"attempt": 1, "log": "logs/attempt-1.log", "began": 1.0, "host": "h",
                    "pid": 1}) + "\n"
        + json.dumps({"attempt": 1, "ended": 2.0, "exit": 1,
                      "reason": "CUDA out of memory on rank 3"}) + "\n")  # fmt: skip
    (run / "train/warnings.jsonl").write_text(json.dumps(
        {"step": 5, "check": "lr", "warning": "learning rate 0 in each of the first 5 steps"}
    ) + "\n")  # fmt: skip
    marks = tmp_path / ".snakemake/incomplete"
    marks.mkdir(parents=True)
    (marks / urlsafe_b64encode(b"results/x/merged_model").decode()).write_text("")
    assert status(tmp_path) == [
        "run x",
        "  shard_dataset      done",
        "  train              failed (attempt 1): CUDA out of memory on rank 3; rerun the same "
        "command to resume",
        "  convert_checkpoint -",
        "  merge_lora         interrupted (rerun to redo it)",
        "  evaluate           -",
        "  warning: learning rate 0 in each of the first 5 steps",
    ]
    assert status(tmp_path / "none") == [
        f"no run has started under {tmp_path / 'none/results'} yet"
    ]


def test_status_lists_the_scoring_stages_jobs_and_the_runs_that_read_them(tmp_path, monkeypatch):
    """`snaketune status` after the runs: each registered scoring stage's jobs under
    results/<stage>/<key> (done; interrupted where Snakemake left it incomplete) and the runs
    whose train job read each (their job.json)."""
    from base64 import urlsafe_b64encode

    from snaketune.app.status import status

    monkeypatch.setenv("PATH", "/nonexistent")  # no squeue: off SLURM
    done = tmp_path / "results/reference_logps/base__0123456789ab"
    done.mkdir(parents=True)
    (done / "logps.parquet").write_bytes(b"x")
    (tmp_path / "results/teacher_logps/t__ba9876543210").mkdir(parents=True)
    marks = tmp_path / ".snakemake/incomplete"
    marks.mkdir(parents=True)
    name = b"results/teacher_logps/t__ba9876543210/topk.parquet"
    (marks / urlsafe_b64encode(name).decode()).write_text("")
    for run in ("p", "q"):
        (tmp_path / f"results/{run}/shards").mkdir(parents=True)
        (tmp_path / f"results/{run}/train").mkdir()
        inputs = {
            "shards": "s",
            "reference_logps": f"results/reference_logps/{done.name}/logps.parquet",
        }
        (tmp_path / f"results/{run}/train/job.json").write_text(json.dumps({"inputs": inputs}))
    lines = status(tmp_path)
    assert lines[-2:] == [
        f"reference_logps {done.name}: done (read by p, q)",
        "teacher_logps t__ba9876543210: interrupted (rerun to redo it)",
    ], lines


def test_the_run_s_settings_travel_in_one_job_file(tmp_path, monkeypatch):
    """scripts/train.py's launcher resolves the job once and writes <out>/job.json (the
    run's settings, its inputs with the scoring stages' outputs by stage name, its launch
    settings); a worker's command line is that file's path and nothing else, and the
    worker's one read of it gives back the same job."""
    import importlib.util

    from snaketune.core.errors import UserError
    from snaketune.core.job import Job
    from snaketune.train import launch as launcher

    spec = importlib.util.spec_from_file_location("train_entry", ROOT / "scripts/train.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    seen = []
    monkeypatch.setattr(launcher, "launch_job", lambda job, fd: seen.append(job) or 0)
    out = tmp_path / "results/x/train"
    run = {"method": "grpo", "grpo": {"rewards": {"correctness": 1.0, "/u/w.py:f": 0.5}}}
    argv = ["--run-spec", json.dumps(run),
            "--shards", "s", "--model", "m", "--deepspeed", "d.json", "--out", str(out),
            "--stage-input", "reference_logps=results/reference_logps/k/logps.parquet",
            "--min-busbw", "5", "--log-example-ids", str(tmp_path / "ids")]  # fmt: skip
    assert entry.main(argv) == 0
    (job,) = seen
    assert job.worker_argv[1:] == ["--worker", "--job", str(out / "job.json")]
    assert job.spec == run  # no stage output in its block
    assert job.inputs == {"reference_logps": "results/reference_logps/k/logps.parquet"}
    assert job.write() == out / "job.json"
    read = Job.read(out / "job.json")
    assert read == Job(**{**job.__dict__, "worker_argv": []})
    # the settings' order kept: the trainer calls and logs a run's rewards in their order
    assert list(read.spec["grpo"]["rewards"]) == ["correctness", "/u/w.py:f"]
    args = entry.parse(job.worker_argv[1:])
    assert args.worker and args.job == out / "job.json" and args.run_spec is None
    with pytest.raises(SystemExit):  # a worker needs its job file
        entry.parse(["--worker"])
    with pytest.raises(UserError, match="--stage-input nope=x: give NEED=PATH"):
        entry.stage_inputs(["nope=x"])


def test_allocation_end_from_squeue_or_the_runtime(monkeypatch, tmp_path):
    import subprocess as sp
    from datetime import datetime

    from snaketune.core.job import Job
    from snaketune.train import segments
    from snaketune.train.segments import allocation_end

    job = Job({}, tmp_path, tmp_path, tmp_path, tmp_path, "auto", [], time_limit_min=10)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert allocation_end(job, 1000.0) == 1600.0  # off SLURM: the rule's runtime
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(segments.shutil, "which", lambda _: "/usr/bin/squeue")
    for printed, want in [("2026-11-23T12:00:00", datetime(2026, 11, 23, 12).timestamp()),
                          ("UNLIMITED", None), ("N/A", 1600.0)]:  # fmt: skip
        monkeypatch.setattr(segments.subprocess, "run",
                            lambda *a, p=printed, **k: sp.CompletedProcess(a, 0, p + "\n", ""))  # fmt: skip
        assert allocation_end(job, 1000.0) == want, printed


def test_the_launcher_imports_no_ml_library():
    """Every train job, retry and requeue starts the launcher before any worker: importing
    transformers there (it once came in through the heartbeat's callback) cost ~4 s a job.
    The launcher's modules import none of the ML stack; the workers do. What it asks of the
    GPU (the disk plan, the flight recorder, provenance's device) it asks without torch
    (2-3 CPU-seconds a job), and gets torch's answer."""
    import torch

    code = ("import sys, snaketune.train.launch, snaketune.train.attempts, snaketune.train.agents; "
            "import snaketune.budget.diskplan; from snaketune.train.preflight import cuda_available; "
            "gpu = cuda_available(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', "
            "'deepspeed', 'trl', 'peft', 'accelerate', 'datasets', 'numpy', 'pandas', "
            "'pyarrow'}), gpu)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "scripts", capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.strip() == f"[] {torch.cuda.is_available()}", out


def test_the_launchers_handoff_reaches_the_worker_whole_and_alone():
    """What the launcher hands one start of the workers (snaketune.core.job.Handoff) is read back
    as it was given; an earlier start's variables do not survive into the next one."""
    from snaketune.core.job import HANDOFF_ENV, Handoff
    from snaketune.train.progress import Deadline

    given = Handoff(deadline=1_000_000.0, stop_margin_s=90.0, save_s=12.5, load_universal=True,
                    checkpoint_bytes=123456)  # fmt: skip
    env = given.environ({"PATH": "/bin"})
    assert Handoff.from_environ(env) == given and env["PATH"] == "/bin"
    later = Handoff().environ(env)  # no deadline, no universal checkpoint this time
    assert not set(later) & set(HANDOFF_ENV.values()) and Handoff.from_environ(later) == Handoff()
    deadline = Deadline.handed(given)
    assert (deadline.end, deadline.margin_s, deadline.save_s) == (1_000_000.0, 90.0, 12.5)
    assert Deadline.handed(Handoff(deadline=5.0, stop_margin_s=120.0)).save_s == 30.0  # a guess


def test_openmp_threads_sleep_only_where_the_ranks_threads_outnumber_the_cores():
    """OMP_WAIT_POLICY=PASSIVE where ranks share cores (the tests' emulated nodes: 4 ranks on
    2 cores, or 2 ranks of 2 threads), OpenMP's spinning default where each thread has a
    core (one process with every core: bench/train_overhead.py's case, 0.57 of a plain loop
    under PASSIVE); a policy the environment sets is kept."""
    from snaketune.train.agents import wait_policy

    for ranks, threads, cores, passive in [(4, "1", 2, True), (2, "2", 2, True),
                                           (1, "2", 2, False), (2, "1", 2, False),
                                           (8, "4", 32, False), (2, "", 1, True)]:  # fmt: skip
        env = {"OMP_NUM_THREADS": threads}
        wait_policy(env, ranks, cores)
        assert ("OMP_WAIT_POLICY" in env) == passive, (ranks, threads, cores)
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}
    wait_policy(env, 4, 2)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_torchrun_s_shutdown_warning_when_the_store_s_agent_ended_first_is_explained(caplog):
    """torch's own shutdown (its words, from its code) on a node whose rendezvous store has
    gone: the agent's line says what happened at INFO; another rendezvous error still warns."""
    import logging
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousStateError,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from snaketune.train.torchrun import RENDEZVOUS_LOGGER, StoreGoneAtShutdown

    def shutdown(error) -> None:
        handler = DynamicRendezvousHandler.__new__(DynamicRendezvousHandler)
        handler._this_node = "localhost_11317_0"
        handler._settings = SimpleNamespace(run_id="snaketune-demo")
        handler._stop_heartbeats = lambda: None
        handler._record = lambda **kw: None

        def close():
            raise error("the store is gone")

        handler._close = close
        assert handler.shutdown() is False

    logger = logging.getLogger(RENDEZVOUS_LOGGER)
    explain = StoreGoneAtShutdown()
    logger.addFilter(explain)
    try:
        with caplog.at_level(logging.INFO, logger=RENDEZVOUS_LOGGER):
            shutdown(RendezvousConnectionError)
            shutdown(RendezvousStateError)
    finally:
        logger.removeFilter(explain)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0][0] == "INFO" and said[0][1].endswith("not a failure)"), said
    assert said[1][0] == "WARNING" and "RendezvousStateError" in said[1][1], said


def test_torchrun_is_given_only_the_options_it_takes(monkeypatch):
    """Every option the launchers pass is one this torch's torchrun knows; --shutdown-timeout
    (torch 2.12 on) is left out where torchrun lacks it (torch 2.11 refused the whole launch:
    the first GPU check)."""
    from torch.distributed.run import get_args_parser

    from snaketune.train import commands

    known = get_args_parser()._option_string_actions  # torchrun's own parser
    args = commands.torchrun_args(2, 4, "head:29500", "run", 90)
    assert all(a in known for a in args if a.startswith("--")), args
    for option in ("--shutdown-timeout", "--nnodes", "--no-such-option"):
        assert commands.torchrun_knows(option) == (option in known), option
    assert args[args.index("--shutdown-timeout") + 1] == "90"
    monkeypatch.setattr(commands, "torchrun_knows", lambda option: False)
    older = commands.torchrun_args(2, 4, "head:29500", "run", 90)
    assert "--shutdown-timeout" not in older and older == args[: args.index("--shutdown-timeout")]


def test_the_progress_line_reads_a_live_file_whose_last_line_is_being_written(tmp_path):
    """A train job's progress line (the terminal's, `snaketune status`'s) reads the live
    metrics while the callback appends to them: a torn last line is left for the next
    read, not an error (one killed the progress thread of the demo under the CI tier's
    load: no ETA line)."""
    from snaketune.train.attemptlog import live_progress

    live = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s, "max_steps": 10, "tokens_per_s": 100.0,
             "elapsed_s": 2.0 * s} for s in (1, 2)]  # fmt: skip
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    live.write_text(whole + '{"step": 3, "loss": 0.3')
    assert live_progress(live) == "step 2/10, loss 0.5000, 100 tok/s, ETA 0:00:16"
    live.write_text(whole)
    assert live_progress(live) == "step 2/10, loss 0.5000, 100 tok/s, ETA 0:00:16"


def test_a_process_group_of_one_makes_no_collective_and_keeps_its_own_values(monkeypatch):
    """The per-step agreement (snaketune.core.collective) in a job of one rank: the values
    as they are, and not one gloo call (each one a step's wait for nothing there)."""
    import torch.distributed as dist

    from snaketune.core.collective import any_rank, barrier, gather_combined
    from snaketune.train.commands import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:

        def refuse(*args, **kwargs):
            raise AssertionError("a collective in a process group of one")

        for name in ("all_gather", "all_reduce", "barrier"):
            monkeypatch.setattr(dist, name, refuse)
        barrier()
        assert any_rank(True) is True and any_rank(False) is False
        assert gather_combined([1.0, 5.0], ("sum", "max")) == [1.0, 5.0]
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_the_trainers_flop_count_reads_the_parameter_count_once_and_is_transformers_own():
    """Lean (every method's trainer) against transformers' Trainer.floating_point_ops on the
    same model and batches: the same figures, the model's parameters counted once."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    from snaketune.methods.training import Lean

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2))  # fmt: skip
    counted = []
    count = model.num_parameters
    model.num_parameters = lambda **kw: counted.append(kw) or count(**kw)

    class Plain:
        pass

    lean, plain = Lean(), Plain()
    lean.model = plain.model = model
    for rows, width in ((3, 7), (5, 11), (2, 4)):
        batch = {"input_ids": torch.zeros(rows, width, dtype=torch.long)}
        assert lean.floating_point_ops(batch) == Trainer.floating_point_ops(plain, batch)
    assert len(counted) == 1 + 3  # Lean's one count, then Trainer's own each time
    assert lean.floating_point_ops({"labels": torch.zeros(1, 2)}) == 0


def test_a_build_lock_its_killed_builder_left_is_removed_and_the_load_goes_on(tmp_path,
                                                                             monkeypatch):  # fmt: skip
    """A rank killed while it built a DeepSpeed op left torch's lock file in the op's build
    directory, and every later job's load of the op waited on it forever (seen here: a
    killed build's lock hung every training of two test suites sharing the cache). A lock
    made before the load began, in a directory quiet for STALE_BUILD_S, is removed and the
    load goes on; a lock of a live build (a file changed lately) or one made after the load
    began (this process's own) is kept."""
    import os
    import threading
    import time

    import torch.utils.cpp_extension as cpp
    from deepspeed.ops.op_builder.builder import OpBuilder
    from torch.utils.file_baton import FileBaton

    from snaketune.train import startup

    lock = tmp_path / "lock"
    lock.touch()
    (tmp_path / "shm.o").touch()
    now = time.time()
    for f in (lock, tmp_path / "shm.o"):
        os.utime(f, (now - 1000, now - 1000))
    assert not startup.clear_stale_lock(tmp_path, since=now - 1001, now=now)  # made after
    assert not startup.clear_stale_lock(tmp_path, since=now, now=now - 1000 + 899)  # quiet < 900
    os.utime(tmp_path / "shm.o", (now - 10, now - 10))
    assert not startup.clear_stale_lock(tmp_path, since=now, now=now)  # a file changed lately
    os.utime(tmp_path / "shm.o", (now - 1000, now - 1000))
    assert startup.clear_stale_lock(tmp_path, since=now, now=now) and not lock.exists()
    assert not startup.clear_stale_lock(tmp_path, since=now, now=now)  # none there

    # the load itself: torch's wait on the dead builder's lock ends
    lock.touch()
    os.utime(lock, (now - 1000, now - 1000))
    monkeypatch.setattr(startup, "STALE_BUILD_S", 0.2)
    monkeypatch.setitem(startup._BUILDS, "compile_s", 0.0)  # the wait counts as a build here
    monkeypatch.setattr(startup, "STALE_POLL_S", 0.05)
    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: FileBaton(str(lock)).wait() or "loaded")  # fmt: skip
    startup.watch_builds()
    got = []
    load = threading.Thread(target=lambda: got.append(OpBuilder.jit_load(type("Op", (), {"name": "shm"})())),
                            daemon=True)  # fmt: skip
    load.start()
    load.join(10)
    assert got == ["loaded"], "the load still waits on the dead build's lock"


def test_each_environment_builds_its_ops_in_its_own_folder(tmp_path, monkeypatch):
    """Two environments on one machine never share torch's extension folder (each rebuilt
    the other's DeepSpeed op at every job: docs/benchmarks.md); a user's own setting wins."""
    from snaketune.core.cache import extensions_dir
    from snaketune.train.agents import worker_environment

    a, b, base = tmp_path / "a", tmp_path / "b", tmp_path / "python"
    for p in (a, b, base):
        p.mkdir()
    assert extensions_dir(str(a), str(base)) == a / "torch_extensions"
    assert extensions_dir(str(b), str(base)) == b / "torch_extensions"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    system = extensions_dir(str(base), str(base))  # not a venv: keyed by its path
    assert system.parent == tmp_path / "cache/torch_extensions" and system.name.startswith("env-")
    assert extensions_dir(str(a / "x"), str(base)) != system  # a read-only or other prefix
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the system's ninja first: not the one used
    env = worker_environment()
    assert env["TORCH_EXTENSIONS_DIR"] == str(extensions_dir())
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine")
    assert worker_environment()["TORCH_EXTENSIONS_DIR"] == "/mine"
