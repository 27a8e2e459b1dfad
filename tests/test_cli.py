import subprocess
import sys

from models import ARCHITECTURES
from service.cli import main


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
    code = "import sys, service.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
