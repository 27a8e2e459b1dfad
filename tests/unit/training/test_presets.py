"""Task presets: every (task, architecture) resolves to a configuration the trainer
accepts, whose batch size fits the data; flags, config files and resumed runs override
the preset; --show-config names the source of every value."""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np
import pytest
from orthornn.models import ARCHITECTURES, build_model
from orthornn.training.cli import add_train_parser, resolve_args
from orthornn.training.config import TASK_NAMES, TrainConfig, validate
from orthornn.training.presets import (
    CHOSEN,
    DEFAULT,
    FLAG,
    PRESETS,
    Kind,
    Provenance,
    Rule,
    derive,
    resolve,
)
from orthornn.training.tasks import _BUILDERS, make_task, ucr_datasets

from orthornn.cli import main as cli

RECURRENT = [a for a in ARCHITECTURES if ARCHITECTURES[a].recurrent]
DATASETS = ("ArrowHead", "GunPoint", "ItalyPowerDemand", "BasicMotions")


def parse(argv):
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(30, 5, 2)).astype(np.float32), y=np.arange(30) % 3)
    return str(path)


def test_every_task_has_a_preset():
    assert set(PRESETS) == set(TASK_NAMES)


@pytest.mark.parametrize("task", TASK_NAMES)
@pytest.mark.parametrize("arch", RECURRENT)
def test_every_preset_resolves_to_a_valid_configuration(task, arch, user_data):
    given = {"arch": arch, "task": task, "out": "unused"}
    if task == "ucr":
        given["dataset"] = "ItalyPowerDemand"
    if task == "classify":
        given["data"] = user_data
    config, sources = resolve(given)
    validate(config)
    # the task accepts every data option the preset sets, the model every arch option
    accepted = _BUILDERS[task][1]
    assert all(v is None or k in accepted for k, v in config.task_options().items())
    kind = {"adding": "regress", "copy": "seq2seq", "lm": "lm"}.get(task, "classify")
    build_model(arch, kind, input_size=3 if kind != "lm" else 50,
                hidden_size=config.hidden_size,
                num_outputs={"classify": 2, "seq2seq": 10}.get(kind),
                embedding_size=config.embedding_size, **config.arch_options)
    assert config.steps is not None or config.epochs is not None  # a budget, always
    assert str(sources["task"]) == "flag"
    assert any(str(s).startswith("preset: ") for s in sources.values())


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("arch", ["svdrnn", "sgornn", "scornn", "lstm"])
def test_ucr_preset_batch_fits_the_training_split(dataset, arch):
    config, sources = resolve({"arch": arch, "task": "ucr", "dataset": dataset})
    n_train = len(make_task("ucr", dataset=dataset).train)  # built, not counted
    assert config.batch_size <= n_train
    if config.batch_size == n_train:
        assert "capped" in str(sources["batch_size"])


def test_user_data_preset_batch_is_capped_and_a_flag_is_not(user_data):
    config, sources = resolve({"arch": "rnn", "task": "classify", "data": user_data})
    n_train = len(make_task("classify", data=user_data).train)
    assert n_train < 64 and config.batch_size == n_train
    assert "capped" in str(sources["batch_size"])
    config, sources = resolve({"arch": "rnn", "task": "classify", "data": user_data,
                               "batch_size": 40})
    assert config.batch_size == 40 and str(sources["batch_size"]) == "flag"  # the trainer says no


def test_the_issues_first_command_runs_as_given(tmp_path, capsys):
    # `orthornn train --arch svdrnn --task ucr --dataset ItalyPowerDemand --out RUN` used to
    # exit with "batch_size must be at most the training set size (54), got 64"
    run = tmp_path / "run"
    assert cli(["train", "--arch", "svdrnn", "--task", "ucr", "--dataset", "ItalyPowerDemand",
                "--steps", "4", "--log-every", "2", "--out", str(run), "--no-progress"]) == 0
    assert "test accuracy" in capsys.readouterr().out


def test_preset_values_and_sources_are_the_papers():
    config, sources = resolve({"arch": "svdrnn", "task": "ucr", "dataset": "ArrowHead"})
    assert config.hidden_size == 32 and config.arch_options["m1"] == 16
    assert "Table 4" in str(sources["hidden_size"])
    assert "Table 4" in str(sources["arch_options.m1"])
    # the paper's parameter count for ArrowHead's recurrence: 1,011 - 587 (oRNN) + 392
    model = build_model("svdrnn", "classify", input_size=1, hidden_size=32, num_outputs=3,
                        **config.arch_options)
    recurrent = sum(p.numel() for p in model.layer.transition.parameters())
    assert recurrent == 1011 - 587 + 392
    # and the whole model's: Table 4's 1,011 at the preset's two points a step
    assert config.step_width == 2 and "Table 4" in str(sources["step_width"])
    model = build_model("svdrnn", "classify", input_size=config.step_width, hidden_size=32,
                        num_outputs=3, **config.arch_options)
    assert sum(p.numel() for p in model.parameters()) == 1011
    config, _ = resolve({"arch": "scornn", "task": "adding", "seq_len": 750})
    assert config.hidden_size == 170 and config.arch_options["rho"] == 119  # 7n/10
    config, _ = resolve({"arch": "scornn", "task": "adding"})
    assert config.arch_options["rho"] == 85  # n/2 at T = 200
    config, sources = resolve({"arch": "sgornn", "task": "adding"})
    assert (config.optimizer, config.lr, config.schedule, config.batch_size) == (
        "rmsprop", 1e-2, "linear", 64)
    # b2 starts where the paper's clip puts it, on eq. 3's boundary 1 - 2a (to 0.1%)
    a = 1 / (1 + math.exp(3))
    assert config.arch_options["b2_init"] == pytest.approx(0.999 * (1 - 2 * a))
    assert "sec. 2" in str(sources["arch_options.b2_init"])
    model = build_model("sgornn", "regress", input_size=2, hidden_size=128, num_outputs=1,
                        **config.arch_options)
    ga, gb = (g.item() for g in model.layer.gates())
    assert ga == pytest.approx(a, rel=1e-5) and 1 - 2 * ga - gb == pytest.approx(
        0.001 * (1 - 2 * a), rel=1e-3)
    # it follows a given a_init, and a given b2_init wins
    config, _ = resolve({"arch": "sgornn", "task": "adding", "arch_options": {"a_init": 0.1}})
    assert config.arch_options["b2_init"] == pytest.approx(0.999 * 0.8)
    config, _ = resolve({"arch": "sgornn", "task": "adding", "arch_options": {"b2_init": 0.5}})
    assert config.arch_options["b2_init"] == 0.5
    config, _ = resolve({"arch": "vprnn", "task": "adding"})
    assert "b2_init" not in config.arch_options


def test_dizzyrnn_copy_preset_is_the_papers_task():
    """DizzyRNN sec. 6: the copied portion scored, 10 symbols, lag 90, batches of 100,
    100 epochs of 10 batches, 10 packed rotations; the other models keep Arjovsky's."""
    config, sources = resolve({"arch": "dizzyrnn", "task": "copy"})
    assert (config.copy_loss, config.copy_symbols, config.seq_len) == ("copied", 10, 90)
    assert (config.batch_size, config.steps, config.hidden_size) == (100, 1000, 128)
    assert config.arch_options["rotations"] == 10
    for key in ("copy_loss", "copy_symbols", "seq_len", "steps", "batch_size",
                "arch_options.rotations"):
        assert "DizzyRNN" in str(sources[key]) and "sec. 6" in str(sources[key]), key
    task = make_task("copy", **config.task_options())
    assert task.scored_steps == 10 and task.input_size == 12
    for arch in ("svdrnn", "scornn", "lstm", "sgornn"):
        config, _ = resolve({"arch": arch, "task": "copy"})
        assert (config.copy_loss, config.copy_symbols, config.seq_len) == (None, None, 100)
        assert make_task("copy", **config.task_options()).scored_steps is None
    # flags choose the other variant for dizzyrnn
    config, sources = resolve_args(parse(["--arch", "dizzyrnn", "--task", "copy",
                                          "--copy-loss", "all", "--copy-symbols", "8",
                                          "--seq-len", "100"]))
    assert (config.copy_loss, config.copy_symbols, config.seq_len) == ("all", 8, 100)
    assert str(sources["copy_loss"]) == str(sources["copy_symbols"]) == "flag"


def test_flags_override_the_preset_and_the_file(tmp_path):
    config, sources = resolve_args(parse(["--arch", "scornn", "--task", "copy", "--lr", "0.01",
                                          "--hidden", "64", "--option", "rho=10"]))
    assert (config.lr, config.hidden_size, config.arch_options["rho"]) == (0.01, 64, 10)
    assert {str(sources[k]) for k in ("lr", "hidden_size", "arch_options.rho")} == {"flag"}
    assert config.orthogonal_lr == 1e-4 and str(sources["orthogonal_lr"]).startswith("preset: ")
    # a preset value computed from another follows the override: rho = n/2 of --hidden
    config, _ = resolve_args(parse(["--arch", "scornn", "--task", "copy", "--hidden", "64"]))
    assert config.arch_options["rho"] == 32
    cfg = tmp_path / "c.yaml"
    cfg.write_text("arch: svdrnn\ntask: copy\nlr: 0.005\nbatch_size: 7\n"
                   "arch_options: {activation: leaky_relu}\n")
    config, sources = resolve_args(parse(["--config", str(cfg), "--batch-size", "9"]))
    assert config.lr == 0.005 and str(sources["lr"]).startswith("config file")
    assert config.batch_size == 9 and str(sources["batch_size"]) == "flag"
    assert config.arch_options["activation"] == "leaky_relu"
    assert config.arch_options["m1"] == 16  # the rest of the preset's options stay
    # giving epochs drops the preset's steps (and the other way round)
    config, _ = resolve_args(parse(["--arch", "svdrnn", "--task", "digits", "--steps", "5"]))
    assert (config.steps, config.epochs) == (5, None)


def test_a_preset_never_asks_more_than_the_architecture_allows():
    # --hidden 8: 16 reflectors and 14 rotation sublayers do not exist; the preset caps them
    config, _ = resolve({"arch": "svdrnn", "task": "copy", "hidden_size": 8})
    assert config.arch_options["m1"] == 8
    config, _ = resolve({"arch": "sgornn", "task": "adding", "hidden_size": 8})
    assert config.arch_options["rotations"] == 6


def test_show_config_prints_every_value_with_its_source(capsys):
    assert cli(["train", "--arch", "sgornn", "--task", "copy", "--lr", "0.002",
                "--show-config"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert set(TrainConfig.__dataclass_fields__) - {"arch_options"} <= set(lines)
    assert lines["lr"].split()[1] == "0.002" and lines["lr"].endswith("flag")
    assert "preset: scoRNN code scoRNN_copying.py" in lines["batch_size"]
    assert "preset: SGORNN" in lines["arch_options.rotations"]
    assert lines["seed"].endswith("default")


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 128)" in out and "--show-config" in out and "preset" in out


def test_bundled_ucr_sets_all_resolve():
    datasets = ucr_datasets()
    assert set(DATASETS) <= set(datasets)  # an empty list would resolve nothing
    for dataset in datasets:
        config, _ = resolve({"arch": "svdrnn", "task": "ucr", "dataset": dataset})
        assert config.batch_size >= 1


def test_derived_presets_are_their_parent_but_the_named_rule():
    digits = PRESETS["digits"]
    mnist1d_note = "; mnist1d was in no paper, the digits preset"
    for task, replaced, note in (("permuted-digits", "scornn", ""),
                                 ("mnist1d", "budget", mnist1d_note)):
        derived = PRESETS[task]
        assert list(derived) == list(digits)  # the parent's rules, in its order
        assert derived[replaced] != digits[replaced]
        for name, rule in digits.items():
            if name != replaced:
                assert derived[name] == dataclasses.replace(rule, source=rule.source + note)
    # resolved: permuted digits is digits for every model but scoRNN, whose rho is n/2
    for arch in RECURRENT:
        plain, plain_sources = resolve({"arch": arch, "task": "digits"})
        perm, perm_sources = resolve({"arch": arch, "task": "permuted-digits"})
        assert dataclasses.replace(perm, task="digits") == plain or arch == "scornn", arch
        assert perm_sources == plain_sources or arch == "scornn", arch
    plain, _ = resolve({"arch": "scornn", "task": "digits"})
    perm, perm_sources = resolve({"arch": "scornn", "task": "permuted-digits"})
    assert (plain.arch_options["rho"], perm.arch_options["rho"]) == (17, 85)
    assert dataclasses.replace(perm, task="digits", arch_options=plain.arch_options) == plain
    assert "rho = n/2 permuted" in str(perm_sources["arch_options.rho"])


def test_derive_refuses_a_name_the_parent_lacks():
    rule = Rule({"epochs": 1}, "test")
    with pytest.raises(ValueError, match=r"replace must name rules of the parent preset "
                                         r"\(shared, budget, .*\); got scorn"):
        derive(PRESETS["digits"], {"scorn": rule})
    assert derive(PRESETS["digits"], {"budget": rule})["budget"] is rule


@pytest.mark.parametrize("provenance", [
    DEFAULT, Provenance(Kind.PRESET, "a rule"), FLAG, Provenance(Kind.FLAG, "--steps replaces it"),
    Provenance(Kind.CONFIG, "c.yaml"), Provenance(Kind.RESUMED),
    Provenance(Kind.RESUMED).noted("the run's total: --resume trains up to it")])
def test_the_batch_cap_follows_the_provenance_kind(provenance, user_data):
    """The preset's batch is capped at the training split unless the user chose it (flag,
    config file, resumed run), exactly as the text rule it replaced decided."""
    config, sources = resolve({"arch": "rnn", "task": "classify", "data": user_data,
                               "batch_size": 64}, {"batch_size": provenance})
    was_capped = not str(provenance).startswith(("flag", "config", "resumed"))  # the old rule
    assert (config.batch_size == 24) is was_capped and (config.batch_size == 64) is not was_capped
    assert sources["batch_size"].kind is provenance.kind
    assert ("capped at the 24 training sequences" in str(sources["batch_size"])) is was_capped
    assert (provenance.kind in CHOSEN) is not was_capped


def test_provenance_prints_as_before():
    assert [str(p) for p in (
        DEFAULT, DEFAULT.noted("the preset gives epochs"), FLAG,
        Provenance(Kind.FLAG, "--steps replaces it").noted("the run's total: x"),
        Provenance(Kind.PRESET, "scoRNN sec. 5.1").noted("capped at the 54 training sequences"),
        Provenance(Kind.CONFIG, "c.yaml"), Provenance(Kind.RESUMED),
        Provenance(Kind.PER_OPTION, "arch_options.KEY"))] == [
        "default", "default (the preset gives epochs)", "flag",
        "flag --steps replaces it (the run's total: x)",
        "preset: scoRNN sec. 5.1 (capped at the 54 training sequences)",
        "config file c.yaml", "resumed run", "per option: arch_options.KEY"]


def test_a_config_files_batch_is_not_capped(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("arch: rnn\ntask: ucr\ndataset: GunPoint\nbatch_size: 500\n")
    config, sources = resolve_args(parse(["--config", str(cfg)]))
    assert config.batch_size == 500 and sources["batch_size"] == Provenance(Kind.CONFIG, str(cfg))
    config, sources = resolve_args(parse(["--arch", "rnn", "--task", "ucr", "--dataset",
                                          "GunPoint", "--batch-size", "500"]))
    assert config.batch_size == 500 and sources["batch_size"] == FLAG
    config, sources = resolve_args(parse(["--arch", "rnn", "--task", "ucr", "--dataset",
                                          "GunPoint"]))
    assert config.batch_size == 16 and sources["batch_size"].kind is Kind.PRESET
