"""The training loop: one function, ``train(config)``.

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

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from orthornn.models import build_model, spectral_summary

from . import checkpoint, distributed
from .config import TrainConfig, validate
from .data import EpochSampler, Split, TokenStream
from .preprocessing import input_preprocessing
from .progress import progress_bar
from .reproducibility import numerics, pick_threads
from .tasks import COPY_LENGTH, Task, make_task

DEFAULT_STEPS = 1000


class TrainingError(ValueError):
    """Training cannot go on (e.g. the loss became NaN); the message says why."""


# -- losses and metrics ------------------------------------------------------------------

def task_loss(kind: str, out: torch.Tensor, y: torch.Tensor,
              scored_steps: int | None = None) -> torch.Tensor:
    """The task's loss; ``scored_steps`` (seq2seq): only the last that many steps count
    (the copy task's copied portion, DizzyRNN sec. 6; Task.scored_steps)."""
    if kind == "regress":
        return F.mse_loss(out, y)
    if kind == "classify":
        return F.cross_entropy(out, y)
    if scored_steps is not None:
        out, y = out[:, -scored_steps:], y[:, -scored_steps:]
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))  # seq2seq, lm


@torch.no_grad()
def evaluate(model, task: Task, data: Split | TokenStream, batch_size: int, device) -> dict:
    """Metrics of the task on a fixed split: loss and the task metric (and the copy
    task's accuracy on the copied symbols)."""
    model.eval()
    total, count, correct, copied = 0.0, 0, 0, 0
    if isinstance(data, TokenStream):
        state = None
        for x, y in data.windows():
            out, state = model(x.to(device), h0=state, return_state=True)
            total += F.cross_entropy(out.flatten(0, 1), y.to(device).flatten(),
                                     reduction="sum").item()
            count += y.numel()
        model.train()
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    for batch in data.batches(batch_size):
        x, y = batch.x.to(device), batch.y.to(device)
        lengths = None if batch.lengths is None else batch.lengths.to(device)
        out = model(x, lengths=lengths)
        total += task_loss(task.kind, out, y, task.scored_steps).item() * len(y)
        count += len(y)
        if task.kind == "classify":
            correct += (out.argmax(-1) == y).sum().item()
        elif task.kind == "seq2seq":
            copied += (out[:, -COPY_LENGTH:].argmax(-1) == y[:, -COPY_LENGTH:]).sum().item()
    model.train()
    metrics = {"loss": total / count}
    if task.kind == "classify":
        metrics["accuracy"] = correct / count
    elif task.kind == "regress":
        metrics["mse"] = metrics["loss"]
    elif task.kind == "seq2seq":
        metrics["cross_entropy"] = metrics["loss"]
        metrics["copy_accuracy"] = copied / (count * COPY_LENGTH)
    return metrics


def improves(candidate: tuple[float, float], best: tuple[float, float] | None,
             higher_is_better: bool) -> bool:
    """Whether (metric, validation loss) beats the kept model's: a better metric, or the
    same metric with a lower loss (ties are frequent on small validation sets)."""
    if best is None:
        return True
    if candidate[0] != best[0]:
        return candidate[0] > best[0] if higher_is_better else candidate[0] < best[0]
    return candidate[1] < best[1]


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


#: validation splits smaller than this cannot rank checkpoints: one series is 1/N of
#: accuracy (7 series on ArrowHead: steps of 0.14), so --select auto keeps the last one.
MIN_SELECT_SIZE = 50


def resolve_select(select: str, val) -> str:
    """'best' or 'last' for --select: auto is best unless the validation split is a fixed
    set of fewer than MIN_SELECT_SIZE sequences."""
    if select != "auto":
        return select
    if isinstance(val, Split) and len(val) < MIN_SELECT_SIZE:
        return "last"
    return "best"


def gate_values(model) -> dict:
    """The scalar gates a and b2 (sgornn, fastrnn), for metrics.jsonl."""
    gates = getattr(getattr(model, "layer", None), "gates", None)
    if gates is None:
        return {}
    with torch.no_grad():
        a, b2 = gates()
    return {"gate_a": a.item(), "gate_b2": b2.item()}


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
          backend: str = "auto", timeout_s: float = distributed.DEFAULT_TIMEOUT_S
          ) -> dict | None:
    """Train and return the summary (also written to RUN_DIR/summary.json; None on the
    ranks other than 0 of a distributed run). progress: a bar on a terminal, else a log
    line every few seconds (training.progress). On the CPU the same config gives the same
    bytes at any thread count (training.reproducibility); oneDNN is off meanwhile. Under
    torchrun it joins the process group (``backend``: gloo on the CPU, nccl on CUDA; none
    joined within ``timeout_s`` is an error) and trains its share of each batch."""
    return run_training(config, resume=resume, progress=progress, backend=backend,
                        timeout_s=timeout_s)[0]


def run_training(config: TrainConfig, *, resume: bool = False, progress: bool = True,
                 backend: str = "auto", timeout_s: float = distributed.DEFAULT_TIMEOUT_S
                 ) -> tuple[dict | None, torch.nn.Module]:
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
        done = _train(config, resume, progress, threads, ctx, device, backend)
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


def _train(config: TrainConfig, resume: bool, progress: bool, threads: int,
           ctx: distributed.Context, device: torch.device, backend: str
           ) -> tuple[dict | None, torch.nn.Module]:
    run_dir = Path(config.out)
    state_path = run_dir / "trainer_state.pt"
    # Everything that can fail on bad input happens before RUN_DIR is touched.
    state = distributed.from_rank0(lambda: _saved_state(run_dir, resume, ctx), ctx)
    task = make_task(config.task, **config.task_options())
    distributed.check_batch(config.batch_size, ctx.world)
    torch.manual_seed(config.seed)
    model = build_model(config.arch, task.kind, input_size=task.input_size,
                        hidden_size=config.hidden_size, num_outputs=task.num_outputs,
                        embedding_size=config.embedding_size, **config.arch_options).to(device)
    if task.sample is not None:
        sampler, per_epoch = None, None
    elif task.kind == "lm":
        sampler = TokenStream(torch.tensor(task.train), config.batch_size, task.options["bptt"],
                              ctx.rank, ctx.world)
        per_epoch = sampler.per_epoch
    else:
        sampler = EpochSampler(task.train, config.batch_size, config.seed, ctx.rank, ctx.world)
        per_epoch = sampler.per_epoch
    total = _total_steps(config, task, per_epoch)

    main = ctx.main
    groups = model.param_groups(config.lr, config.orthogonal_lr)
    opt_class = torch.optim.RMSprop if config.optimizer == "rmsprop" else torch.optim.Adam
    optimizer = opt_class(groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config.schedule, total))
    group = distributed.record(config, ctx, backend)

    # best: (metric, validation loss) of the kept model; ties on the metric (frequent with
    # small validation sets, e.g. accuracy 1.0 on 7 UCR series) go to the lower loss.
    start, best, best_step, elapsed, carried = 0, None, None, 0.0, None
    if state is not None:
        model.load_state_dict(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start, best, best_step = state["step"], tuple(state["best"]), state["best_step"]
        elapsed, carried = state["seconds"], state.get("carried")
        if carried is not None:  # the whole batch's state: this rank's columns of it
            carried = carried[sampler.rows]
        if total <= start and not ctx.restart:  # a restart after the last step finishes it
            raise ValueError(f"{str(run_dir)!r} is at step {start} of {total}: give a larger "
                             f"total budget (--steps or --epochs count the whole run, not "
                             f"the steps to add)")
        if main:  # the run's options now (the next --resume or --config reads them)
            checkpoint.write_json(run_dir / "config.json", run_config(config, task, model, group))
    elif main:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.write_json(run_dir / "config.json", run_config(config, task, model, group))
        if task.vocabulary:
            checkpoint.write_text(run_dir / "vocab.txt", "\n".join(task.vocabulary) + "\n")
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    # after loading: DDP starts every rank from rank 0's parameters and buffers
    net = (torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
        if ctx.world > 1 else model)

    eval_every = config.eval_every or config.log_every
    select = resolve_select(config.select, task.val)
    losses: list[float] = []
    # a bar on a terminal, a line every few seconds in a log
    bar = progress_bar(total=total, initial=start, enabled=progress and main, unit="step",
                       desc=f"train {config.arch} {task.name}")
    clock = time.perf_counter()
    for step in range(start, total):
        log_now = (step + 1) % config.log_every == 0 or step + 1 == total
        h0 = None
        if task.kind == "lm":  # this rank's columns of the window (TokenStream.rows)
            x, y, fresh = sampler.window(step)
            x, y = x.to(device), y.to(device)
            h0 = None if fresh or carried is None else carried.to(device)
            if log_now:
                h0 = (torch.zeros(x.shape[0], model.state_size, device=device)
                      if h0 is None else h0).requires_grad_(True)
            out, last = net(x, h0=h0, return_state=True)
            carried = last.detach()
        else:  # this rank's rows of the global batch (data.rank_share)
            batch = (task.sample(config.batch_size,
                                 torch.Generator().manual_seed(config.seed * 1_000_003 + step))
                     .shard(ctx.rank, ctx.world)
                     if sampler is None else sampler.batch(step))
            x, y = batch.x.to(device), batch.y.to(device)
            lengths = None if batch.lengths is None else batch.lengths.to(device)
            if log_now and getattr(model, "state_size", None):
                h0 = torch.zeros(x.shape[0], model.state_size, device=device, requires_grad=True)
            out = net(x, lengths=lengths, h0=h0) if h0 is not None else net(x, lengths=lengths)
        loss = task_loss(task.kind, out, y, task.scored_steps)
        objective = loss + model.regularization()
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        # the global batch's loss; every rank sees the same value, so all stop together
        value = distributed.mean(loss.detach(), ctx).item()
        if not math.isfinite(value):
            raise TrainingError(f"the loss became {value} at step {step + 1}; "
                                f"lower lr or set clip")
        if config.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
        scheduler.step()
        losses.append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}")

        if log_now or (step + 1) % eval_every == 0:
            # collectives first (every rank), then rank 0 alone validates and writes
            grad_h0 = (distributed.gradient_norm(h0.grad, ctx)
                       if h0 is not None and h0.grad is not None else None)
            whole_state = None if carried is None else distributed.gather_rows(carried, ctx)
            mean_loss = sum(losses) / len(losses)
            losses = []
            if not main:
                continue
            metrics = evaluate(model, task, task.val, config.eval_batch_size, device)
            value = metrics[task.metric]
            improved = improves((value, metrics["loss"]), best, task.higher_is_better)
            if improved:
                best, best_step = (value, metrics["loss"]), step + 1
            keep = improved if select == "best" else True
            seconds = elapsed + time.perf_counter() - clock
            row = {"step": step + 1, "loss": mean_loss,
                   **{f"val_{k}": v for k, v in metrics.items()},
                   **spectral_summary(model), **gate_values(model), "grad_h0": grad_h0,
                   "lr": optimizer.param_groups[0]["lr"], "seconds": round(seconds, 3)}
            bar.set_postfix(loss=f"{row['loss']:.4f}", **{task.metric: f"{value:.4f}"})
            if keep:
                checkpoint.save_weights(run_dir / "model.safetensors", model)
            checkpoint.save_weights(run_dir / "last.safetensors", model)
            checkpoint.save_torch(state_path, {
                "step": step + 1, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "best": best, "best_step": best_step,
                "seconds": seconds,
                "carried": None if whole_state is None else whole_state.cpu()})
            with open(run_dir / "metrics.jsonl", "a") as log:
                log.write(json.dumps(row) + "\n")
    bar.close()
    seconds = elapsed + time.perf_counter() - clock

    summary = None
    if main:
        best_model, _ = checkpoint.load_model(run_dir)
        best_model.to(device)
        test = evaluate(best_model, task, task.test, config.eval_batch_size, device)
        summary = {
            "arch": model.arch, "task": task.name, "metric": task.metric,
            "test": test, "best_val": best[0], "best_step": best_step, "steps": total,
            "select": select, "kept_step": best_step if select == "best" else total,
            "baseline": task.baseline,
            "parameters": sum(p.numel() for p in model.parameters()),
            "spectral": spectral_summary(best_model), "seconds": round(seconds, 3),
            "device": str(device), "processes": ctx.world,
            "numerics": numerics(torch, device, threads),
            "resumed_at": start if state is not None else None,
        }
        checkpoint.write_json(run_dir / "summary.json", summary)
        if config.plot:
            from .plots import plot_run

            plot_run(run_dir)
    return summary, model
