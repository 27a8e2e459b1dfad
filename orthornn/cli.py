"""The ``orthornn`` console script: composes the stages' subcommands.

Each stage exposes its own parsers (``training.cli``, ``export.cli``, the modules of
``service.commands``), importable without torch or the server's packages; a stage's
heavy modules are imported only when its command runs. A command whose extra is not
installed ends with one line naming the extra (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from orthornn import __version__

# which extra brings each third-party top-level module a command may import
EXTRAS = {
    "train": ("torch", "safetensors", "tqdm", "yaml", "matplotlib", "sklearn", "sktime",
              "mnist1d", "gensim", "scipy"),
    "serve": ("fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pydantic",
              "pydantic_settings", "orjson", "simdjson", "prometheus_client", "fastapi_offline"),
    "gpu": ("triton",),
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The extra that would have installed the module ``error`` names (None: not ours)."""
    top = (error.name or "").split(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def _architectures(args: argparse.Namespace) -> int:
    from orthornn.models import ALIASES, ARCHITECTURES

    aliases = {v: k for k, v in ALIASES.items()}
    for name, spec in ARCHITECTURES.items():
        label = name + (f" (alias {aliases[name]})" if name in aliases else "")
        print(f"{label}\n    {spec.summary}\n    tasks: {', '.join(spec.tasks)}")
        if spec.options:
            opts = ", ".join(f"{k}={'auto' if v is None else v}" for k, v in spec.options.items())
            print(f"    options: {opts}")
    return 0


SOURCE_TREE = Path(__file__).resolve().parents[1]
BENCH_FOLDERS = ("perf", "load", "experiments")


def benchmarks(root: Path | None = None) -> dict[str, Path]:
    """Every script of bench/perf, bench/load and bench/experiments by name (unique across
    the folders), in folder order: each .sh, and each .py that runs as a program (a
    ``__main__`` guard; bench/load/client.py, which the load tests import, has none).
    Empty outside a source checkout."""
    found = {}
    for folder in BENCH_FOLDERS:
        path = (root or SOURCE_TREE) / "bench" / folder
        for script in sorted([*path.glob("*.py"), *path.glob("*.sh")]):
            if script.suffix == ".sh" or 'if __name__ == "__main__":' in script.read_text():
                found[script.stem] = script
    return found


def _summary_line(script: Path) -> str:
    """The first line of a script's module docstring (of its first comment, for .sh)."""
    text = script.read_text()
    if script.suffix == ".py":
        import ast

        return (ast.get_docstring(ast.parse(text)) or "").split("\n")[0]
    comments = [line for line in text.splitlines() if line.startswith("# ")]
    return comments[0][2:] if comments else ""


def _bench(args: argparse.Namespace) -> int:
    """Run bench/<folder>/<name>.py (or .sh) of the source checkout with the remaining
    arguments; with --list or no name, list the benchmarks by folder."""
    scripts = benchmarks()
    if not scripts:
        raise ValueError("the benchmarks live in the source tree (bench/); run orthornn from "
                         "a checkout of the repository")
    if args.list or args.name is None:
        for folder in BENCH_FOLDERS:
            print(f"bench/{folder}/")
            for name, script in scripts.items():
                if script.parent.name == folder:
                    print(f"  {name:14} {_summary_line(script)}")
        return 0
    script = scripts[args.name]
    if script.suffix == ".sh":
        import subprocess

        return subprocess.run(["bash", str(script), *args.args]).returncode
    import runpy

    sys.argv = [str(script), *args.args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orthornn",
        description="Train, export and serve orthogonal and spectrally-constrained RNNs.")
    parser.add_argument("--version", action="version", version=f"orthornn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    arch = sub.add_parser("architectures", help="list the architectures, their tasks and options")
    arch.set_defaults(run=_architectures)
    bench = sub.add_parser("bench", help="run a benchmark of bench/ (prints a table, writes "
                           "JSON); --list lists them", description="orthornn bench NAME "
                           "[ARGS...] runs bench/FOLDER/NAME.py; NAME --help lists its options; "
                           "orthornn bench --list (or no NAME) lists every benchmark.")
    bench.add_argument("--list", action="store_true",
                       help="list the benchmarks by folder (perf, load, experiments)")
    # choices only in a checkout: outside one, _bench says where the benchmarks live
    bench.add_argument("name", nargs="?", choices=list(benchmarks()) or None, metavar="NAME",
                       help="a benchmark (--list names them)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    bench.set_defaults(run=_bench)
    from orthornn.export.cli import add_export_parser
    from orthornn.quickstart import add_quickstart_parser
    from orthornn.service.commands.capture import add_capture_parser
    from orthornn.service.commands.labels import add_labels_parser
    from orthornn.service.commands.monitor import add_monitor_parser
    from orthornn.service.commands.predict import add_predict_parser
    from orthornn.service.commands.rollout import add_rollout_parser
    from orthornn.service.commands.serve import add_serve_parser
    from orthornn.service.commands.trigger import add_trigger_parser
    from orthornn.training.cli import add_plot_parser, add_train_parser
    from orthornn.training.flags import add_progress_flag

    add_train_parser(sub)
    add_plot_parser(sub)
    add_export_parser(sub)
    add_rollout_parser(sub)
    add_monitor_parser(sub)
    add_trigger_parser(sub)
    add_serve_parser(sub)
    add_predict_parser(sub)
    add_labels_parser(sub)
    add_capture_parser(sub, add_progress_flag)
    add_quickstart_parser(sub)
    return parser


#: commands that train: torch's CPU allocator backs its tensors of 2 MiB and more with
#: transparent huge pages (c10 reads THP_MEM_ALLOC_ENABLE once, at torch's first
#: allocation, so it is set before torch is imported). A language model's output layer
#: and its gradients (tens of MB a step) then cost no page faults: the quickstart's word
#: model trains 1.14 -> 1.44 steps/s on the 2-core AMD EPYC; the same bytes (memory
#: placement changes no arithmetic). An explicit THP_MEM_ALLOC_ENABLE=0 keeps it off.
TRAINING_COMMANDS = ("train", "quickstart")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return 2
    if args.command in TRAINING_COMMANDS:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is met below
        return code
    except BrokenPipeError:  # `orthornn predict ... | head`: the reader has what it wanted
        # stop quietly; Python's own flush at exit would fail again, so it gets /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what a shell reports for a writer its pipe ended
    except ValueError as error:  # bad input: one line, no traceback
        print(f"orthornn {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        extra = missing_extra(error)
        if extra is None:
            raise
        print(f"orthornn {args.command} needs the {extra} extra: "
              f"pip install '.[{extra}]' in a checkout of orthornn (missing module "
              f"{error.name!r})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"orthornn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
