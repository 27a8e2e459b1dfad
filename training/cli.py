"""``orthornn train`` and ``orthornn plot``. Torch-free at import: the flags come from
TrainConfig's fields; the trainer is imported only when a command runs."""

from __future__ import annotations

import argparse
import dataclasses

from .config import (
    DEVICES,
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULES,
    SELECTS,
    TASK_NAMES,
    TrainConfig,
    read_config_file,
)
from .flags import add_progress_flag
from .presets import FLAG, Kind, Provenance, resolve, show

HELP = {
    "arch": "architecture (orthornn architectures lists them)",
    "task": f"task: {', '.join(TASK_NAMES)}",
    "out": "run directory to create (RUN_DIR)",
    "hidden_size": "hidden state size n",
    "embedding_size": "token embedding size (task lm)",
    "seq_len": "sequence length T (adding) or time lag T (copy)",
    "copy_loss": "copy task: cross-entropy over every step (all, Arjovsky et al.) or over "
                 "the copied portion only (copied, DizzyRNN sec. 6)",
    "copy_symbols": "copy task: number of data symbols (alphabet: these, blank, marker)",
    "dataset": "UCR/UEA set bundled with sktime (task ucr)",
    "point_by_point": "feed UCR series one point per step (task ucr)",
    "step_width": "UCR points fed per step, the series padded at its end (repeating its "
                  "last value) to a multiple (task ucr)",
    "val_fold": "which of the training split's disjoint fifths is the validation "
                "split (task ucr; cross-validation of a recipe)",
    "corpus": "a text file to model instead of the bundled corpus (task lm); repeat it to "
              "train on several (each split on its own, the splits concatenated; the "
              "vocabulary is the first file's)",
    "vocab_size": "vocabulary size incl. <unk> and <eos> (task lm)",
    "bptt": "steps per truncated-backprop window (task lm)",
    "data": ".npz file with x [N, T, d] (+ lengths) and y [N] (task classify); repeat it to "
            "train on several (each split on its own, the splits concatenated; every file "
            "must agree on d and the class names)",
    "data_mix": "with several --data files: the share of each batch drawn from the files "
                "after the first (oversamples a small captured set), in (0, 1)",
    "steps": "optimizer steps",
    "epochs": "epochs over the training set instead of steps (data set tasks)",
    "batch_size": "sequences per step",
    "optimizer": f"optimizer: {', '.join(OPTIMIZERS)}",
    "lr": "learning rate",
    "orthogonal_lr": "learning rate of the orthogonal parameters",
    "schedule": f"learning-rate schedule: {', '.join(SCHEDULES)} (linear: to 0 at the end)",
    "clip": "gradient-norm clipping threshold (0 disables)",
    "seed": "random seed (initialisation and batches)",
    "device": f"device: {', '.join(DEVICES)}",
    "precision": f"dtype of the parameters while training: {', '.join(PRECISIONS)} (float64: "
                 f"weights that agree across CPUs' kernels to ~1e-9, at ~2x the time; "
                 f"exported as float32 either way)",
    "threads": "CPU threads (results do not depend on it)",
    "log_every": "steps between validation, logging and checkpoints",
    "eval_every": "steps between validations",
    "eval_batch_size": "sequences per evaluation batch",
    "select": f"which checkpoint is the run's model: {', '.join(SELECTS)} (auto: best by "
              f"validation, or last when the validation split holds fewer than 50 sequences)",
    "plot": "write RUN_DIR/curves.png at the end",
}


#: options a flag gives several times (``--data A --data B``, ``--corpus A --corpus B``): the
#: original data, then the captured; one value stays a path, so its config (and hash) is as
#: it always was
REPEATABLE = ("data", "corpus")

# what an unset (None) option means (tests/integration/test_cli.py checks these against the tasks'
# and the trainer's defaults); the other defaults are TrainConfig's own values
UNSET = {
    "out": "none: required",
    "embedding_size": "the hidden size",
    "seq_len": "200 for adding, 100 for copy",
    "copy_loss": "all",
    "copy_symbols": "8",
    "dataset": "none: required by --task ucr",
    "point_by_point": "false: L/n_i steps of n_i values",
    "step_width": "n_i, the largest divisor of L not above sqrt(L)",
    "val_fold": "0: the Spectral-RNN appendix's one split",
    "corpus": "the bundled Wikipedia + news corpus",
    "vocab_size": "10000",
    "bptt": "70",
    "data": "none: required by --task classify",
    "data_mix": "none: batches drawn from all the rows alike",
    "steps": "1000 unless --epochs is given",  # trainer.DEFAULT_STEPS (a test keeps it so)
    "epochs": "none: --steps",
    "orthogonal_lr": "--lr",
    "eval_every": "--log-every",
    "threads": "the cores idle at the start, at least 1",
}


def default_text(f: dataclasses.Field) -> str:
    if f.name in UNSET:
        return UNSET[f.name]
    value = f.default
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _parse_option(text: str) -> tuple[str, object]:
    import json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.replace("-", "_"), parsed


def add_train_parser(sub) -> None:
    parser = sub.add_parser("train", help="train a model on a task, writing RUN_DIR",
                            description="Train a model. Each task has a preset from the "
                            "papers (per architecture where they differ; README lists them): "
                            "--arch A --task T --out RUN runs it. Every option can also "
                            "come from --config FILE (YAML or JSON); flags override the file, "
                            "the file overrides the preset. The defaults shown apply where "
                            "the task's preset sets nothing; --show-config prints the "
                            "resolved values and where each came from.",
                            argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="YAML or JSON file of options (default: none)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out (its options, overridden by flags; "
                             "default: a new run)")
    add_progress_flag(parser)
    parser.add_argument("--show-config", action="store_true",
                        help="print the resolved configuration with the source of every "
                        "value (default, preset: PAPER, config file, flag) and exit")
    add_distributed_flags(parser)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "hidden_size":
            flag = ("--hidden", flag)
        else:
            flag = (flag,)
        if f.name == "arch_options":
            parser.add_argument("--option", dest="arch_options", action="append",
                                type=_parse_option, metavar="KEY=VALUE",
                                help="architecture option, e.g. --option m1=16 (repeatable; "
                                     "default: the architecture's own, see orthornn "
                                     "architectures)")
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        text = f"{HELP[f.name]} (default: {default_text(f)})"
        if "bool" in kind:
            parser.add_argument(*flag, dest=f.name, action="store_true", help=text)
            continue
        conv = int if kind.startswith("int") else float if kind.startswith("float") else str
        if f.name in REPEATABLE:  # the original data set, then the captured ones
            parser.add_argument(*flag, dest=f.name, action="append", metavar="FILE", help=text)
            continue
        parser.add_argument(*flag, dest=f.name, type=conv, help=text)
    parser.set_defaults(run=run_train)


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Data-parallel training (training.distributed): the launcher's flags, and the two a
    worker that torchrun started also reads (--backend, --dist-timeout-s)."""
    group = parser.add_argument_group(
        "data-parallel training (torch.distributed; --batch-size is the global batch)")
    group.add_argument("--nproc-per-node", type=int, metavar="N",
                       help="start N workers on this machine through torchrun's launcher "
                            "(torch.distributed.run) (default: one process, no launcher)")
    group.add_argument("--nnodes", type=int, metavar="M",
                       help="machines in the run, each running this same command (default: 1)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="the c10d rendezvous every machine joins, needed with --nnodes > "
                            "1 (default: a local one)")
    group.add_argument("--max-restarts", type=int, metavar="K",
                       help="restart the workers up to K times after one fails; they resume "
                            "from the last checkpoint (default: 0)")
    group.add_argument("--force", action="store_true",
                       help="allow --nproc-per-node above the cores (or CUDA devices); default: "
                            "refused")
    group.add_argument("--backend", choices=("auto", "gloo", "nccl"),
                       help="torch.distributed backend (default: auto: nccl on CUDA, gloo on "
                            "the CPU)")
    group.add_argument("--dist-timeout-s", type=float, metavar="S",
                       help="longest wait for the rendezvous or for another worker in a "
                            "collective (default: 600)")


LAUNCH_FLAGS = ("nnodes", "rdzv_endpoint", "max_restarts", "force")


def launch_from_args(args: argparse.Namespace):
    """The launcher's options when --nproc-per-node is given, else None (a single process, or
    a worker torchrun started); ValueError for launcher flags without it."""
    given = vars(args)
    if "nproc_per_node" not in given:
        stray = [name for name in LAUNCH_FLAGS if name in given]
        if stray:
            flag = "--" + stray[0].replace("_", "-")
            raise ValueError(f"{flag} needs --nproc-per-node N (orthornn train starts the "
                             f"workers through torchrun then)")
        return None
    import os

    from .distributed import DEFAULT_TIMEOUT_S
    from .launcher import Launch

    if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:
        raise ValueError("--nproc-per-node: this process already runs under torchrun "
                         f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')}); give the worker "
                         f"count to torchrun or to orthornn train, not both")
    return Launch(nproc_per_node=given["nproc_per_node"], nnodes=given.get("nnodes", 1),
                  rdzv_endpoint=given.get("rdzv_endpoint"),
                  max_restarts=given.get("max_restarts", 0), backend=given.get("backend", "auto"),
                  timeout_s=given.get("dist_timeout_s", DEFAULT_TIMEOUT_S),
                  force=given.get("force", False))


def add_plot_parser(sub) -> None:
    parser = sub.add_parser("plot", help="write PNG learning curves of a run")
    parser.add_argument("run_dir", help="a run directory")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    parser.set_defaults(run=run_plot)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return resolve_args(args)[0]


def resolve_args(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, Provenance]]:
    """The configuration and the source of each value: flags over the config file (or
    a resumed run's options) over the task's preset over the defaults."""
    values: dict = {}
    origin: dict[str, Provenance] = {}
    given = vars(args)
    if given.get("resume") and given.get("out"):
        from .checkpoint import read_run_config

        resumed = read_run_config(given["out"])["train"]
        values.update(resumed)
        origin.update({k: Provenance(Kind.RESUMED) for k in resumed})
    if given.get("config"):
        from_file = read_config_file(given["config"])
        values.update(from_file)
        origin.update({k: Provenance(Kind.CONFIG, str(given["config"])) for k in from_file})
    for f in dataclasses.fields(TrainConfig):
        if f.name in given:
            value = given[f.name]
            if f.name == "arch_options":
                value = {**values.get("arch_options", {}), **dict(value)}
            if f.name in REPEATABLE and isinstance(value, list) and len(value) == 1:
                value = value[0]  # one file stays a path: the config (and its hash) as before
            values[f.name] = value
            origin[f.name] = FLAG
    # one budget: a flag's --steps replaces the file's or the resumed run's epochs (and
    # the other way round); either is the run's total, which --resume continues up to
    for unit, other in (("steps", "epochs"), ("epochs", "steps")):
        if given.get(unit) is not None and values.get(other) is not None:
            values[other] = None
            origin[other] = Provenance(Kind.FLAG, f"--{unit} replaces it")
    if given.get("resume"):
        for unit in ("steps", "epochs"):
            if values.get(unit) is not None:
                origin[unit] = origin[unit].noted("the run's total: --resume trains up to it")
    return resolve(values, origin)


def run_train(args: argparse.Namespace) -> int:
    config, sources = resolve_args(args)
    if getattr(args, "show_config", False):
        print(show(config, sources))
        return 0
    resume = getattr(args, "resume", False)
    progress = not getattr(args, "no_progress", False)
    launch = launch_from_args(args)
    if launch is not None:
        from .launcher import launch_workers

        return launch_workers(config, launch, resume=resume, progress=progress)
    from .distributed import DEFAULT_TIMEOUT_S, RankError, context
    from .trainer import train

    try:
        summary = train(config, resume=resume, progress=progress,
                        backend=getattr(args, "backend", "auto"),
                        timeout_s=getattr(args, "dist_timeout_s", DEFAULT_TIMEOUT_S))
    except ValueError as error:
        # every rank stops on the same bad input, and rank 0 alone says it
        if context().rank != 0 and not isinstance(error, RankError):
            return 2
        raise
    if summary is not None:
        metric = summary["metric"]
        print(f"{config.out}: test {metric} = {summary['test'][metric]:.4f} (model of step "
              f"{summary['kept_step']}, --select {summary['select']}; best validation "
              f"{summary['best_val']:.4f} at step {summary['best_step']})")
        if summary["resumed_at"] is not None and summary["kept_step"] <= summary["resumed_at"]:
            print(f"{config.out}: the kept model is still step {summary['kept_step']}'s, from "
                  f"before this --resume (validation did not improve since); exporting it "
                  f"publishes nothing new (--select last keeps the latest weights)")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from .plots import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0
