import os
import subprocess
import sys

from orthornn.models import ARCHITECTURES

from orthornn.cli import main


def test_architectures_lists_every_name(capsys):
    assert main(["architectures"]) == 0
    out = capsys.readouterr().out
    for name in ARCHITECTURES:
        assert name in out
    assert "svdrnn (alias spectral-rnn)" in out
    assert "m1=auto" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: orthornn" in capsys.readouterr().err


def test_cli_module_does_not_import_torch():
    code = "import sys, orthornn.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_service_package_does_not_import_torch():
    """The serving image has no torch: no module of service/ may pull it (nor models/ or
    training/, which do)."""
    code = ("import importlib, pkgutil, sys\n"
            "import orthornn.service as service\n"
            "for m in pkgutil.iter_modules(service.__path__):\n"
            "    importlib.import_module('orthornn.service.' + m.name)\n"
            "from orthornn.service.http.app import create_app\n"
            "bad = [m for m in ('torch', 'orthornn.models', 'orthornn.training')\n"
            "       if m in sys.modules]\n"
            "print(bad)\n"
            "sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_serve_bad_settings_exit_2(capsys, tmp_path):
    assert main(["serve"]) == 2
    assert "repo (--repo or ORTHORNN_REPO): Field required" in capsys.readouterr().err
    assert main(["serve", "--repo", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["serve", "--repo", str(tmp_path), "--max-batch-size", "0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err


def test_bench_runs_a_benchmark_script(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["bench", "models", "--hidden", "8", "--steps", "3", "--batch", "2", "--reps",
                 "1", "--factored-reps", "1", "--out", str(out)]) == 0
    assert "time / nn.RNN(relu)" in capsys.readouterr().out and out.is_file()


def test_bench_rejects_unknown_names(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "nope"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_serve_flags_are_generated_from_every_setting():
    """One list: every Settings field is a flag whose help shows the field's own default,
    except the secrets (environment only) and what is derived from another (--repo
    s3://... sets repository_uri), and a flag's value reaches Settings."""
    from orthornn.service.commands.serve import DERIVED, ENV_ONLY, settings_from_args
    from orthornn.service.settings import Settings

    from orthornn.cli import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest: a for a in serve._actions if a.dest != "help"}
    assert set(flags) | set(ENV_ONLY) | DERIVED == set(Settings.model_fields)
    assert "admin_token" not in flags
    for name, action in flags.items():
        field = Settings.model_fields[name]
        assert f"ORTHORNN_{name.upper()}" in action.help, name
        default = field.get_default(call_default_factory=True)
        if name != "repo" and default not in (None, []) and not isinstance(default, bool):
            assert f"default: {default}" in action.help, (name, action.help)
    args = parser.parse_args(["serve", "--repo", "r", "--max-token-length", "77",
                              "--max-new-tokens", "9", "--no-batching", "--models", "a,b",
                              "--log-level", "warning"])
    settings = settings_from_args(args)
    assert (settings.max_token_length, settings.max_new_tokens, settings.batching) == \
        (77, 9, False)
    assert settings.models == ["a", "b"] and settings.log_level == "warning"
    defaults = settings_from_args(parser.parse_args(["serve", "--repo", "r"]))
    assert defaults.batching is True and defaults.max_new_tokens == \
        Settings.model_fields["max_new_tokens"].default


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`orthornn ... | head`: the pipe's reader is gone before the command writes. The
    command stops with 141 (128 + SIGPIPE, as a shell reports it) and says nothing, where
    it used to end with a BrokenPipeError traceback and exit 1."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "orthornn", "architectures"],
                            stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    os.close(read)  # long before the child has imported anything and written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert err == b""


def test_train_refuses_a_setting_given_as_an_architecture_option(capsys, tmp_path):
    """--option embedding_size=32 reached build_model twice and ended in a TypeError
    traceback; it is refused up front, naming the flag to use."""
    code = main(["train", "--arch", "svdrnn", "--task", "lm", "--option", "embedding_size=32",
                 "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "embedding_size" in err and "--embedding-size" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
