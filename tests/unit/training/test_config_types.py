"""A config file's values as their options' types: a number written as a string (what
``helm --set retraining.trainConfig.lr=0.02`` renders into the chart's train.yaml) is that
number; anything else not of the option's type is refused, naming the option and the file."""

import argparse
import json

import pytest
from orthornn.training.cli import add_train_parser, resolve_args
from orthornn.training.config import read_config_file

from orthornn.cli import main as cli


def parse(argv):
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_numbers_given_as_strings_resolve_as_the_numbers(tmp_path):
    base = "arch: svdrnn\ntask: digits\nhidden_size: {n}\nlr: {lr}\nepochs: {epochs}\n"
    as_text = write(tmp_path, "text.yaml", base.format(n='"16"', lr='"0.02"', epochs='"3"'))
    as_numbers = write(tmp_path, "numbers.yaml", base.format(n=16, lr=0.02, epochs=3))
    config, sources = resolve_args(parse(["--config", as_text, "--out", "run"]))
    expected, _ = resolve_args(parse(["--config", as_numbers, "--out", "run"]))
    assert config == expected
    assert (config.lr, config.epochs, config.hidden_size) == (0.02, 3.0, 16)
    assert type(config.lr) is float and type(config.epochs) is float
    assert type(config.hidden_size) is int
    assert str(sources["lr"]) == f"config file {as_text}"
    values = read_config_file(write(tmp_path, "e.yaml", 'lr: "1e-3"\nplot: "false"\n'
                                    'point_by_point: "True"\nsteps: " 40 "\n'))
    assert values == {"lr": 1e-3, "plot": False, "point_by_point": True, "steps": 40}


def test_the_chart_style_config_trains(tmp_path, capsys):
    # lr "0.02" used to reach torch's LambdaLR and fail there with a TypeError
    cfg = write(tmp_path, "train.yaml", 'arch: svdrnn\ntask: adding\nseq_len: "10"\n'
                'hidden_size: 8\nsteps: "4"\nbatch_size: 8\nlog_every: 2\nlr: "0.02"\n'
                "schedule: cosine\n")
    run = tmp_path / "run"
    assert cli(["train", "--config", cfg, "--out", str(run), "--no-progress"]) == 0
    train = json.loads((run / "config.json").read_text())["train"]
    assert (train["lr"], train["steps"], train["seq_len"]) == (0.02, 4, 10)
    assert isinstance(train["lr"], float) and isinstance(train["steps"], int)


@pytest.mark.parametrize("line,message", [
    ('lr: "abc"', 'lr must be a number (e.g. 0.02 or "0.02"); got \'abc\''),
    ('lr: ""', "lr must be a number"),
    ('lr: "nan"', "lr must be a number"),
    ("lr: true", "lr must be a number"),
    ("lr: [0.02]", "lr must be a number"),
    ('epochs: "1e400"', "epochs must be a number"),
    ('steps: "2.5"', 'steps must be an integer (e.g. 40 or "40"); got \'2.5\''),
    ("steps: 2.5", "steps must be an integer"),
    ('steps: "1e3"', "steps must be an integer"),
    ("batch_size: false", "batch_size must be an integer"),
    ('plot: "yes"', "plot must be true or false; got 'yes'"),
    ("plot: 1", "plot must be true or false"),
    ("optimizer: 5", "optimizer must be a string; got 5"),
])
def test_a_value_not_of_its_options_type_is_refused(tmp_path, line, message):
    path = write(tmp_path, "bad.yaml", f"arch: svdrnn\ntask: adding\n{line}\n")
    with pytest.raises(ValueError, match=f"^config file {path!r}: ") as error:
        read_config_file(path)
    assert message in str(error.value)


def test_a_choice_given_as_a_string_is_still_checked(tmp_path, capsys):
    cfg = write(tmp_path, "train.yaml", "arch: svdrnn\ntask: adding\nschedule: exponential\n")
    assert cli(["train", "--config", cfg, "--out", str(tmp_path / "run")]) == 2
    assert "schedule must be one of 'constant', 'cosine'" in capsys.readouterr().err


def test_the_cli_reports_a_bad_number_in_one_line(tmp_path, capsys):
    cfg = write(tmp_path, "train.yaml", 'arch: svdrnn\ntask: adding\nlr: "0.02x"\n')
    run = tmp_path / "run"
    code = cli(["train", "--config", cfg, "--out", str(run), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (f"orthornn train: error: config file {cfg!r}: lr must be a number "
                   f"(e.g. 0.02 or \"0.02\"); got '0.02x'")
    assert "Traceback" not in err and not run.exists()
