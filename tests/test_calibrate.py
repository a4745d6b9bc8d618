"""snaketune.budget.calibrate piece by piece (quick): which finished run calibrates a run
(each reason one is passed over, the newest of several), its figures, the time before its
launcher, each stage's seconds, the calibration copy of a chained run. The estimates built
on them are test_cost.py's."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from test_cost import LLAMA_8B, config_with, finished

from snaketune.budget import calibrate as cal
from snaketune.core.modelshape import Shape

SHAPE = Shape.from_config(LLAMA_8B)


@pytest.fixture
def sorted_glob(monkeypatch):
    """The results folder read in name order, so a run passed over comes before the one
    that calibrates (a stop at the first passed over would find none)."""
    real = pathlib.Path.glob
    monkeypatch.setattr(pathlib.Path, "glob", lambda self, p: iter(sorted(real(self, p))))


def test_the_calibration_passes_over_each_run_unlike_this_one(tmp_path, sorted_glob):
    config = config_with(tmp_path, 1000)  # x: a LoRA run on the CPU (no gpu)
    spec = {**config["runs"]["x"], "nodes": 1, "gpus_per_node": 2, "model": "m"}
    run = (80.0, 45.0, 1_280_000, 20, 40)
    finished(tmp_path, "zz_good", spec, *run, "cpu", LLAMA_8B)
    good = cal.calibration(config, "x", tmp_path, SHAPE)
    assert good["run"] == "zz_good" and good["device"] == "cpu"
    passed = {
        "a_full": ({**spec, "method": "full"}, "cpu"),  # another adapter
        "b_gpu": (spec, "cuda"),  # a GPU's record for a CPU run
        "x": (spec, "cpu"),  # the run itself
        "c_other_model": ({**spec, "model": "m2"}, "cpu"),
    }
    for name, (s, device) in passed.items():
        finished(tmp_path, name, s, *run, device, {**LLAMA_8B, "num_hidden_layers": 2}
                 if name == "c_other_model" else LLAMA_8B)  # fmt: skip
    finished(tmp_path, "d_no_steps", spec, *run[:4], 0, "cpu", LLAMA_8B)  # metrics empty
    finished(tmp_path, "e_no_time", spec, 0.0, *run[1:], "cpu", LLAMA_8B)  # no train_s
    broken = tmp_path / "results/f_broken/train"
    broken.mkdir(parents=True)
    (broken / "provenance.json").write_text("{not json")
    no_model = tmp_path / "results/g_no_model/train"
    finished(tmp_path, "g_no_model", {**spec, "model": "gone"}, *run, "cpu", LLAMA_8B)
    (no_model / "run_config.json").write_text(
        json.dumps({k: v for k, v in spec.items() if k != "model"})
    )
    assert cal.calibration(config, "x", tmp_path, SHAPE)["run"] == "zz_good"
    # a lora record for a full run, a CPU record for a GPU run: neither
    for other, changes in (("f", {"method": "full"}), ("g", {"gpu": "h100-80gb"})):
        (tmp_path / other).mkdir()
        finished(tmp_path / other, "zz_good", spec, *run, "cpu", LLAMA_8B)
        wanted = config_with(tmp_path / other, 1000, **changes)
        assert cal.calibration(wanted, "x", tmp_path / other, SHAPE) is None, other
    # the newest of two that match
    finished(tmp_path, "zz_newer", spec, 40.0, 45.0, 1_280_000, 20, 40, "cpu", LLAMA_8B)
    for name, age in (("zz_good", 100), ("zz_newer", 10)):
        prov = tmp_path / f"results/{name}/train/provenance.json"
        os.utime(prov, (prov.stat().st_atime, prov.stat().st_mtime - age))
    assert cal.calibration(config, "x", tmp_path, SHAPE)["run"] == "zz_newer"


def test_two_shapes_differ_in_their_fields():
    assert cal.same_shape(SHAPE, Shape.from_config(LLAMA_8B))
    assert not cal.same_shape(SHAPE, Shape.from_config({**LLAMA_8B, "num_hidden_layers": 2}))


def test_a_runs_figures_are_its_tokens_and_steps_over_its_time():
    record = {"device": "cpu", "segments": {"train_s": 7.0, "compile_s": 2.0}}
    spec = {"nodes": 2, "gpus_per_node": 3}
    manifest = {"shards": [{"tokens": 1001}, {"tokens": 1000}], "steps_per_epoch": 4,
                "global_batch": 16}  # fmt: skip
    got = cal.measured("r", record, spec, manifest, [{"step": 1}, {"step": 3}])
    assert got["tokens_per_s"] == pytest.approx(2001 / 4 * 3 / 7.0)
    assert got["step_s"] == pytest.approx(7.0 / 3)
    assert (got["per_step"], got["devices"], got["nodes"]) == (16, 6, 2)
    assert got["outside_s"] == -2.0  # no time outside recorded: none, less the builds


def test_the_time_before_the_launcher_is_the_benchmark_less_the_segments(tmp_path):
    bench = tmp_path / "benchmarks/train/r.tsv"
    bench.parent.mkdir(parents=True)
    one = {"jobs": 1, "wall_s": 30.0}
    for text, seconds in (("s\th:m:s\n80\t0:01:20\n", 50.0), ("s\th:m:s\n20\t0:00:20\n", 0.0),
                          ("s\th:m:s\nnot\t0\n", 0.0), ("x\ty\n1\t2\n", 0.0), ("s\th:m:s\n", 0.0)):  # fmt: skip
        bench.write_text(text)
        assert cal.before_launcher(tmp_path, "r", one) == seconds, text
    bench.write_text("s\th:m:s\n80\t0:01:20\n")
    assert cal.before_launcher(tmp_path, "r", {"jobs": 1}) == 0.0  # no wall time recorded
    assert cal.before_launcher(tmp_path, "r", {"jobs": 2, "wall_s": 30.0}) == 0.0
    bench.unlink()
    bench.mkdir()  # unreadable as a file
    assert cal.before_launcher(tmp_path, "r", one) == 0.0


def test_each_stage_is_the_runs_own_benchmarks(tmp_path):
    folder = tmp_path / "benchmarks/evaluate"
    folder.mkdir(parents=True)
    for name, s in (("a", 1.0), ("x", 2.0), ("x.lora_adapters", 3.0), ("z", 4.0), ("xy", 8.0)):
        (folder / f"{name}.tsv").write_text(f"s\th:m:s\n{s}\t0\n")
    assert cal.stage_seconds(tmp_path, "".join(["x"]), ("evaluate", "merge_lora")) == {
        "evaluate": 5.0
    }


def test_a_chained_runs_calibration_keeps_a_model_it_names():
    config = {"runs": {"a": {"model": "base"}, "b": {"init_from": "a"},
                       "c": {"model": "own", "init_from": "a"}}}  # fmt: skip
    assert cal.calibration_config(config, "b", 5)["runs"]["b_calibration"]["model"] == "base"
    assert cal.calibration_config(config, "c", 5)["runs"]["c_calibration"]["model"] == "own"
