"""The training loop: ``train(config)``, run as a recipe (``TrainingRun``).

Per step: a batch (generated, sampled from a fixed split, or the next window of the
token stream with the hidden state carried), the task loss plus the model's
regularization, gradient clipping, an optimizer step. Every ``log_every`` steps it
evaluates on the validation set, appends a row to metrics.jsonl (loss, metric,
spectral margin max|s_i - 1| of W, ||dL/dh_0||, learning rate, seconds), keeps the
best model and saves what --resume needs.

Under torchrun (training.distributed) it trains with DistributedDataParallel: each rank
reads its own share of every global batch (training.data), rank 0 alone reads and writes
the run directory, validates and shows progress, and the logged loss and ||dL/dh_0|| are
the global batch's, so a run on N processes logs and reaches what one process does, up to
the order of floating-point sums.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
from orthornn.models import build_model, spectral_summary

from . import checkpoint, distributed
from .batches import batches_for
from .config import TrainConfig, validate
from .evaluation import evaluate, gate_values, improves, resolve_select, task_loss
from .preprocessing import input_preprocessing
from .progress import progress_bar
from .reproducibility import numerics, pick_threads
from .tasks import Task, make_task

DEFAULT_STEPS = 1000


class TrainingError(ValueError):
    """Training cannot go on (e.g. the loss became NaN); the message says why."""


# -- the run ---------------------------------------------------------------------------

def _device(name: str, local_rank: int = 0) -> torch.device:
    """The device; on CUDA, each process of a machine its own (torchrun's LOCAL_RANK)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def _schedule(name: str, total: int):
    if name == "cosine":
        return lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    if name == "step":  # x0.1 at half and at three quarters of the run
        return lambda step: 0.1 ** ((step >= total // 2) + (step >= 3 * total // 4))
    if name == "linear":  # to zero at the end (SGORNN section 3.1)
        return lambda step: max(0.0, 1 - min(step, total) / total)
    return lambda step: 1.0


def _total_steps(config: TrainConfig, task: Task, per_epoch: int | None) -> int:
    if config.epochs is not None:
        if per_epoch is None:
            raise ValueError(f"epochs does not apply to the generated task {task.name!r}: "
                             f"give steps")
        return max(1, math.ceil(config.epochs * per_epoch))
    return config.steps or DEFAULT_STEPS


def run_config(config: TrainConfig, task: Task, model,
               group: dict | None = None) -> dict:
    """config.json; ``group``: distributed.record (world size, per-rank batch, backend)."""
    return {
        "format": checkpoint.FORMAT,
        "arch": model.arch,
        "task": task.kind,
        "task_name": task.name,
        "model": {"arch": model.arch, "task": task.kind, "input_size": task.input_size,
                  "hidden_size": config.hidden_size, "num_outputs": task.num_outputs,
                  **({"embedding_size": config.embedding_size}
                     if config.embedding_size is not None else {}),
                  "options": dict(config.arch_options)},
        "data": task.options,
        "input_spec": task.input_spec(),
        "preprocessing": input_preprocessing(task),
        "labels": task.labels,
        "vocabulary_file": "vocab.txt" if task.vocabulary else None,
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "baseline": task.baseline,
        "train": config.to_dict(),
        "distributed": group or {"world_size": 1, "per_rank_batch": config.batch_size,
                                 "backend": None},
    }


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True,
          backend: str = "auto", timeout_s: float = distributed.DEFAULT_TIMEOUT_S,
          score_test: bool = True) -> dict | None:
    """Train and return the summary (also written to RUN_DIR/summary.json; None on the
    ranks other than 0 of a distributed run). progress: a bar on a terminal, else a log
    line every few seconds (training.progress). On the CPU the same config gives the same
    bytes at any thread count (training.reproducibility); oneDNN is off meanwhile. Under
    torchrun it joins the process group (``backend``: gloo on the CPU, nccl on CUDA; none
    joined within ``timeout_s`` is an error) and trains its share of each batch.
    ``score_test`` off: the test split is never scored (a recipe search chooses on the
    validation split only; the summary's "test" is None)."""
    return run_training(config, resume=resume, progress=progress, backend=backend,
                        timeout_s=timeout_s, score_test=score_test)[0]


def run_training(config: TrainConfig, *, resume: bool = False, progress: bool = True,
                 backend: str = "auto", timeout_s: float = distributed.DEFAULT_TIMEOUT_S,
                 score_test: bool = True) -> tuple[dict | None, torch.nn.Module]:
    """``train``, returning this process's trained model beside the summary (every rank
    holds the same weights)."""
    validate(config)
    distributed.die_with_launcher()
    ctx = distributed.context()
    device = _device(config.device, ctx.local_rank)
    backend = distributed.backend_for(backend, device)
    distributed.check_timeout(timeout_s)
    threads, before = pick_threads(config.threads, ctx.local_world), torch.get_num_threads()
    onednn = torch.backends.mkldnn.enabled
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = False
    # a group made here is left here (a caller's own group is the caller's)
    own_group = ctx.world > 1 and not torch.distributed.is_initialized()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if own_group:
            distributed.join(backend, ctx, timeout_s)
        run = TrainingRun(config, resume, progress, threads, ctx, device, backend)
        run.score_test = score_test
        done = run.run()
        if own_group:  # leave together, once rank 0 has written the run: a rank whose
            # group is torn down while a peer still works can abort at exit (SIGABRT, seen
            # in CI: "terminate called without an active exception")
            torch.distributed.barrier()
        return done
    finally:
        if own_group:
            distributed.leave()
        torch.set_num_threads(before)
        torch.backends.mkldnn.enabled = onednn


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to DTYPE meanwhile (TrainConfig.precision)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _saved_state(run_dir: Path, resume: bool, ctx: distributed.Context) -> dict | None:
    """Rank 0's reading of RUN_DIR: the state to continue from (--resume, or torchrun's
    restart after a failure: the last checkpoint), None for a new run, or a ValueError."""
    state_path = run_dir / "trainer_state.pt"
    restarted = ctx.restart > 0
    if restarted and state_path.is_file():
        resume = True
    if resume:
        if not state_path.is_file():
            raise ValueError(f"cannot resume: {str(run_dir)!r} holds no trainer_state.pt")
        distributed.check_resume_world(checkpoint.read_run_config(run_dir), ctx.world)
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        state["weights"] = checkpoint.load_weights(run_dir / "last.safetensors")
        return state
    if not restarted and (run_dir / "config.json").exists():  # a restart may redo its own
        raise ValueError(f"{str(run_dir)!r} already holds a run: pass --resume to continue it "
                         f"or choose another --out")
    return None


class TrainingRun:
    """One run, as a recipe: ``setup`` (everything that can fail on bad input, before
    RUN_DIR is touched; the model, the data, the optimizer, a resumed state), ``step``
    (one optimizer step), ``evaluate`` and ``checkpoint`` (every ``eval_every`` steps, rank
    0), ``finish`` (the test score of the kept model, summary.json). The task's data is
    a strategy (``batches``: a language model's windows, or the other tasks' batches)."""

    def __init__(self, config: TrainConfig, resume: bool, progress: bool, threads: int,
                 ctx: distributed.Context, device: torch.device, backend: str):
        self.config, self.resume, self.progress, self.threads = config, resume, progress, threads
        self.ctx, self.device, self.backend = ctx, device, backend
        self.run_dir = Path(config.out)
        self.score_test = True  # off: the test split is never read (``train``)

    def setup(self) -> None:
        config, ctx, run_dir = self.config, self.ctx, self.run_dir
        self.state = distributed.from_rank0(
            lambda: _saved_state(run_dir, self.resume, ctx), ctx)
        task = self.task = make_task(config.task, **config.task_options())
        distributed.check_batch(config.batch_size, ctx.world)
        torch.manual_seed(config.seed)
        with default_dtype(getattr(torch, config.precision)):
            # the initial draws in the run's dtype too: float32's normal and uniform
            # kernels are vectorised by instruction set (their last bits differ between
            # ATen's AVX2, AVX-512 and scalar kernels), float64's are not
            model = self.model = build_model(
                config.arch, task.kind, input_size=task.input_size,
                hidden_size=config.hidden_size, num_outputs=task.num_outputs,
                embedding_size=config.embedding_size, **config.arch_options).to(self.device)
        self.batches = batches_for(task, config, ctx)
        self.total = _total_steps(config, task, self.batches.per_epoch)
        groups = model.param_groups(config.lr, config.orthogonal_lr)
        opt_class = torch.optim.RMSprop if config.optimizer == "rmsprop" else torch.optim.Adam
        self.optimizer = opt_class(groups)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _schedule(config.schedule, self.total))
        group = distributed.record(config, ctx, self.backend)
        # best: (metric, validation loss) of the kept model; ties on the metric (frequent
        # with small validation sets, e.g. accuracy 1.0 on 7 UCR series) go to the lower loss
        self.start, self.best, self.best_step, self.elapsed = 0, None, None, 0.0
        state = self.state
        if state is not None:
            model.load_state_dict(state["weights"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.start, self.best = state["step"], tuple(state["best"])
            self.best_step, self.elapsed = state["best_step"], state["seconds"]
            self.batches.resume(state.get("carried"))
            if self.total <= self.start and not ctx.restart:  # a restart after the last
                raise ValueError(                           # step finishes it
                    f"{str(run_dir)!r} is at step {self.start} of {self.total}: give a "
                    f"larger total budget (--steps or --epochs count the whole run, not the "
                    f"steps to add)")
            if ctx.main:  # the run's options now (the next --resume or --config reads them)
                checkpoint.write_json(run_dir / "config.json",
                                      run_config(config, task, model, group))
        elif ctx.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.write_json(run_dir / "config.json", run_config(config, task, model, group))
            if task.vocabulary:
                checkpoint.write_text(run_dir / "vocab.txt", "\n".join(task.vocabulary) + "\n")
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        # after loading: DDP starts every rank from rank 0's parameters and buffers
        self.net = (torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            if ctx.world > 1 else model)
        self.select = resolve_select(config.select, task.val)

    def step(self, step: int, log_now: bool) -> tuple[float, torch.Tensor | None]:
        """One optimizer step: (the global batch's loss, h0 when its gradient is logged)."""
        config, model = self.config, self.model
        out, y, h0 = self.batches.forward(self.net, model, step, log_now, self.device)
        loss = task_loss(self.task.kind, out, y, self.task.scored_steps)
        objective = loss + model.regularization()
        self.optimizer.zero_grad(set_to_none=True)
        objective.backward()
        # the global batch's loss; every rank sees the same value, so all stop together
        value = distributed.mean(loss.detach(), self.ctx).item()
        if not math.isfinite(value):
            raise TrainingError(f"the loss became {value} at step {step + 1}; "
                                f"lower lr or set clip")
        if config.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        self.optimizer.step()
        self.scheduler.step()
        return value, h0

    def evaluate(self, step: int, mean_loss: float, grad_h0: float | None
                 ) -> tuple[dict, bool]:
        """Rank 0: the validation metrics of STEP as a metrics.jsonl row, and whether the
        model is kept (it improves, or --select last)."""
        task, model = self.task, self.model
        metrics = evaluate(model, task, task.val, self.config.eval_batch_size, self.device)
        value = metrics[task.metric]
        improved = improves((value, metrics["loss"]), self.best, task.higher_is_better)
        if improved:
            self.best, self.best_step = (value, metrics["loss"]), step + 1
        row = {"step": step + 1, "loss": mean_loss,
               **{f"val_{k}": v for k, v in metrics.items()},
               **spectral_summary(model), **gate_values(model), "grad_h0": grad_h0,
               "lr": self.optimizer.param_groups[0]["lr"]}
        return row, improved if self.select == "best" else True

    def checkpoint(self, step: int, row: dict, keep: bool, whole_state, seconds: float) -> None:
        """Rank 0: the kept and the last weights, what --resume needs, the metrics row."""
        run_dir, model = self.run_dir, self.model
        if keep:
            checkpoint.save_weights(run_dir / "model.safetensors", model)
        checkpoint.save_weights(run_dir / "last.safetensors", model)
        checkpoint.save_torch(run_dir / "trainer_state.pt", {
            "step": step + 1, "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "best": self.best,
            "best_step": self.best_step, "seconds": seconds,
            "carried": None if whole_state is None else whole_state.cpu()})
        with open(run_dir / "metrics.jsonl", "a") as log:
            log.write(json.dumps(row) + "\n")

    def run(self) -> tuple[dict | None, torch.nn.Module]:
        self.setup()
        config, ctx, task = self.config, self.ctx, self.task
        eval_every = config.eval_every or config.log_every
        losses: list[float] = []
        # a bar on a terminal, a line every few seconds in a log
        bar = progress_bar(total=self.total, initial=self.start,
                           enabled=self.progress and ctx.main, unit="step",
                           desc=f"train {config.arch} {task.name}")
        clock = time.perf_counter()
        for step in range(self.start, self.total):
            log_now = (step + 1) % config.log_every == 0 or step + 1 == self.total
            value, h0 = self.step(step, log_now)
            losses.append(value)
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4f}")
            if log_now or (step + 1) % eval_every == 0:
                # collectives first (every rank), then rank 0 alone validates and writes
                grad_h0 = (distributed.gradient_norm(h0.grad, ctx)
                           if h0 is not None and h0.grad is not None else None)
                whole_state = self.batches.whole_state(ctx)
                mean_loss = sum(losses) / len(losses)
                losses = []
                if not ctx.main:
                    continue
                row, keep = self.evaluate(step, mean_loss, grad_h0)
                seconds = self.elapsed + time.perf_counter() - clock
                row["seconds"] = round(seconds, 3)
                bar.set_postfix(loss=f"{row['loss']:.4f}",
                                **{task.metric: f"{row['val_' + task.metric]:.4f}"})
                self.checkpoint(step, row, keep, whole_state, seconds)
        bar.close()
        return self.finish(self.elapsed + time.perf_counter() - clock), self.model

    def finish(self, seconds: float) -> dict | None:
        """Rank 0: the kept model's test score and summary.json (None on other ranks)."""
        if not self.ctx.main:
            return None
        config, task, model, run_dir = self.config, self.task, self.model, self.run_dir
        best_model, _ = checkpoint.load_model(run_dir)
        best_model.to(self.device)
        test = evaluate(best_model, task, task.test, config.eval_batch_size, self.device) \
            if self.score_test else None
        summary = {
            "arch": model.arch, "task": task.name, "metric": task.metric,
            "test": test, "best_val": self.best[0], "best_step": self.best_step,
            "steps": self.total, "select": self.select,
            "kept_step": self.best_step if self.select == "best" else self.total,
            "baseline": task.baseline,
            "parameters": sum(p.numel() for p in model.parameters()),
            "spectral": spectral_summary(best_model), "seconds": round(seconds, 3),
            "device": str(self.device), "processes": self.ctx.world,
            "numerics": {**numerics(torch, self.device, self.threads),
                         "precision": config.precision},
            "resumed_at": self.start if self.state is not None else None,
        }
        checkpoint.write_json(run_dir / "summary.json", summary)
        if config.plot:
            from .plots import plot_run

            plot_run(run_dir)
        return summary
