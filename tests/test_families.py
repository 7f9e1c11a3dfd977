"""Tests of the model family registry (utils/families.py): a model is one folder and one registry line, and the
trainer's flags, the trainer itself and the benchmarks take every registered family."""
import json

import pytest

from utils import hub
from utils.families import FAMILIES, family_info, load_family
from utils.run_config import parse_run_config

QUICK = ["--max-seq-length", "64", "--batch-size", "4", "--report-to", "none", "--no-save-initial",
         "--eval-batches", "1", "--precision", "fp32"]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_decision", None)


def test_every_registered_family_has_a_folder_whose_train_py_defines_it():
    assert set(FAMILIES) >= {"gpt2", "bert"}
    for name, info in FAMILIES.items():
        assert load_family(name).name == name and info.default_size


def test_an_unknown_family_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model family 'llama' \(known: gpt2, bert\)"):
        parse_run_config("llama", [])


def test_a_registered_toy_family_takes_its_defaults_from_the_registry(toy_family, capsys):
    config = parse_run_config("toy", ["--max-steps", "2"])
    assert config.model.model_name == "tiny" and config.checkpoint.save_dir == "./checkpoints/toy"
    assert parse_run_config("gpt2", []).model.model_name == "gpt2"  # the others keep theirs
    with pytest.raises(SystemExit):
        parse_run_config("toy", ["--help"])
    assert capsys.readouterr().out.startswith("usage: toy/train.py")


@pytest.mark.slow
def test_a_toy_family_trains_and_traces_through_the_trainer(toy_family, tmp_path, offline, capsys):
    from utils.trainer import main as run_training
    status = run_training(load_family("toy"), [
        *QUICK, "--max-steps", "4", "--enable-tracing", "--trace-output-dir", str(tmp_path / "outputs"),
        "--save-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")])
    assert status == 0
    assert "toy toy-tiny: " in capsys.readouterr().out  # the family's name, not GPT-2's
    info = json.loads((tmp_path / "ckpt" / "final_model" / "training_info.json").read_text())
    assert info["step"] == 4 and info["model_name"] == "tiny" and info["model_type"] == "gpt2"
    trace = tmp_path / "outputs" / "toy-tiny_1cpu"
    assert {"host.0.json", "device.0.json", "run.json"} <= {p.name for p in trace.iterdir()}
    assert json.loads((trace / "run.json").read_text())["family"] == "toy"


def test_the_training_bench_plans_a_toy_family_and_its_trainer_child_parses_it(toy_family, tmp_path):
    from bench import hf_trainer_run, train_bench
    args = train_bench.build_parser().parse_args(["--models", "toy", "--quick"])
    [case] = train_bench.plan_cases(args, cuda=False)
    assert (case.family, case.model_name, train_bench.size_label(case)) == ("toy", "tiny", "tiny")
    ours = [str(a) for a in train_bench.our_command(case, tmp_path, tmp_path / "tokenizer")]
    assert ours[1] == str(tmp_path / "families" / "toy" / "train.py")
    assert parse_run_config("toy", ours[2:]).optim.max_steps == case.max_steps
    child = [str(a) for a in train_bench.trainer_command(case, tmp_path, tmp_path / "tokenizer")]
    own, config = hf_trainer_run.parse_args(child[2:])
    assert own.family == "toy" and config.model.model_name == "tiny" and config.optim.max_steps == case.max_steps
    assert config.optim.learning_rate == parse_run_config("gpt2", []).optim.learning_rate  # the trainer's defaults
    with pytest.raises(train_bench.BenchError, match="unknown model or size 'llama'"):
        train_bench.plan_cases(train_bench.build_parser().parse_args(["--models", "llama"]), cuda=False)
    assert family_info("toy").label == "Toy"
