"""The trainer, checkpoints, resume and the command line (DDP:
tests/integration/test_distributed.py)."""

import json
import math

import pytest
import torch
from orthornn.models import build_model
from orthornn.training import checkpoint
from orthornn.training.config import TrainConfig
from orthornn.training.tasks import make_task
from orthornn.training.trainer import evaluate, improves, train

from orthornn.cli import main as cli


def small(out, **kw):
    base = dict(arch="svdrnn", task="adding", seq_len=10, hidden_size=8, steps=12, batch_size=8,
                log_every=6, optimizer="adam", lr=0.01, out=str(out))
    return TrainConfig(**{**base, **kw})


def test_adding_t30_learns(tmp_path):
    # 600 steps: every seed tried (0-3) ends below 0.02; 400 steps is seed-dependent
    summary = train(small(tmp_path / "run", seq_len=30, hidden_size=32, steps=600,
                          batch_size=64, log_every=100), progress=False)
    assert summary["test"]["mse"] < 0.05 < summary["baseline"]


def test_run_directory_contents_and_metrics_log(tmp_path):
    run = tmp_path / "run"
    summary = train(small(run, plot=True), progress=False)
    for name in ("model.safetensors", "config.json", "summary.json", "metrics.jsonl",
                 "last.safetensors", "trainer_state.pt", "curves.png"):
        assert (run / name).is_file(), name
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temporary left
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [6, 12]
    for key in ("loss", "val_mse", "spectral_margin", "grad_h0", "lr", "seconds"):
        assert all(r[key] is not None for r in rows), key
    assert rows[-1]["spectral_margin"] <= 0.01 + 1e-6  # r = 0.01 bounds |s_i - 1|
    assert summary["parameters"] == sum(
        p.numel() for p in checkpoint.load_model(run)[0].parameters())
    config = json.loads((run / "config.json").read_text())
    assert config["input_spec"] == {"kind": "float", "feature_size": 2, "max_length": 10}


def test_copy_variant_is_recorded_and_rebuilt(tmp_path):
    """The copied-portion copy task (DizzyRNN sec. 6) is in config.json, and the task that
    export rebuilds from it scores the same loss as the trainer."""
    from orthornn.export.builder.evaluation import rebuild_task

    run = tmp_path / "run"
    summary = train(small(run, arch="dizzyrnn", task="copy", seq_len=5, copy_loss="copied",
                          copy_symbols=10, arch_options={"rotations": 2}), progress=False)
    assert summary["baseline"] == pytest.approx(math.log(10))
    config = json.loads((run / "config.json").read_text())
    assert config["data"] == {"seq_len": 5, "copy_loss": "copied", "copy_symbols": 10}
    assert (config["train"]["copy_loss"], config["train"]["copy_symbols"]) == ("copied", 10)
    assert config["input_spec"]["feature_size"] == config["model"]["num_outputs"] == 12
    task = rebuild_task(config)
    assert task.scored_steps == 10 and task.baseline == pytest.approx(math.log(10))
    model, _ = checkpoint.load_model(run)
    again = evaluate(model, task, task.test, 256, torch.device("cpu"))
    assert again["cross_entropy"] == pytest.approx(summary["test"]["cross_entropy"], rel=1e-6)
    assert 0 <= again["copy_accuracy"] <= 1


def test_checkpoint_round_trip_gives_identical_outputs(tmp_path):
    run = tmp_path / "run"
    summary = train(small(run, arch="scornn", task="copy", seq_len=5), progress=False)
    model, config = checkpoint.load_model(run)
    task = make_task("copy", seq_len=5)
    again = evaluate(model, task, task.test, 256, torch.device("cpu"))
    assert again["cross_entropy"] == pytest.approx(summary["test"]["cross_entropy"], rel=1e-6)
    # saving and loading once more changes nothing
    checkpoint.save_weights(tmp_path / "copy.safetensors", model)
    clone = checkpoint.build_from_config(config)
    clone.load_state_dict(checkpoint.load_weights(tmp_path / "copy.safetensors"))
    x = task.test.x[:4]
    assert torch.equal(clone.eval()(x), model(x))


def test_resume_continues_the_step_count_and_matches_one_run(tmp_path):
    straight, split = tmp_path / "a", tmp_path / "b"
    train(small(straight, steps=12), progress=False)
    train(small(split, steps=6), progress=False)
    train(small(split, steps=12), resume=True, progress=False)
    rows = [json.loads(line)["step"] for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert rows == [6, 12]
    a = checkpoint.load_weights(straight / "last.safetensors")
    b = checkpoint.load_weights(split / "last.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=key)


def test_lm_trains_with_carried_state(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"the cat sat on the mat number {i} and the dog ran"
                                  for i in range(60)))
    run = tmp_path / "lm"
    summary = train(small(run, arch="sgornn", task="lm", seq_len=None, corpus=str(corpus),
                          vocab_size=30,
                          bptt=8, steps=30, log_every=10, lr=0.02), progress=False)
    vocab = checkpoint.read_vocabulary(run, checkpoint.read_run_config(run))
    assert vocab[:2] == ["<unk>", "<eos>"] and len(vocab) == 12  # all 10 words of this corpus
    assert summary["test"]["perplexity"] < len(vocab)  # better than uniform


def test_config_file_and_flag_override(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("arch: ornn\ntask: adding\nseq_len: 10\nhidden_size: 8\nsteps: 4\n"
                   "batch_size: 8\nlog_every: 2\narch_options: {m: 3}\n")
    run = tmp_path / "run"
    assert cli(["train", "--config", str(cfg), "--steps", "6", "--out", str(run),
                "--no-progress"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["steps"] == 6 and config["model"]["options"] == {"m": 3}
    assert config["arch"] == "ornn"


@pytest.mark.parametrize("args,message", [
    (["--task", "mnist"], "task must be one of"),
    (["--task", "ucr", "--dataset", "Wafer"], "bundled with sktime"),
    (["--hidden", "0"], "hidden_size must be an integer"),
    (["--option", "m1=99"], "m1 must be an integer in [1, 8]"),
    (["--lr", "-1"], "lr must be a number in (0.0, 10.0]"),
    (["--optimizer", "sgd"], "optimizer must be one of"),
    (["--task", "classify"], "needs --data FILE"),
    (["--epochs", "2"], "epochs does not apply to the generated task"),
    (["--task", "copy", "--copy-loss", "some"], "copy_loss must be one of 'all', 'copied'"),
    (["--task", "copy", "--copy-symbols", "1"], "copy_symbols must be an integer in [2, 1000]"),
    (["--copy-loss", "copied"], "copy_loss do not apply to task 'adding'"),
])
def test_cli_errors_are_one_line_and_leave_no_run_dir(tmp_path, capsys, args, message):
    run = tmp_path / "run"
    code = cli(["train", "--arch", "svdrnn", "--task", "adding", "--hidden", "8",
                "--out", str(run), "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not run.exists()


def test_cli_bad_data_file(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "d.npz"
    np.savez(path, x=np.full((20, 4, 2), np.nan), y=np.zeros(20, int))
    code = cli(["train", "--arch", "rnn", "--task", "classify", "--data", str(path),
                "--out", str(tmp_path / "run")])
    assert code == 2 and "NaN" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    train(small(run, steps=2, log_every=2), progress=False)
    code = cli(["train", "--arch", "svdrnn", "--task", "adding", "--out", str(run)])
    assert code == 2 and "already holds a run" in capsys.readouterr().err


def test_plot_command(tmp_path, capsys):
    run = tmp_path / "run"
    train(small(run), progress=False)
    assert cli(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_build_from_config_matches_build_model(tmp_path):
    run = tmp_path / "run"
    train(small(run, arch="dizzyrnn", arch_options={"rotations": 3}), progress=False)
    model, _ = checkpoint.load_model(run)
    assert model.layer.transition.rotations == 3
    reference = build_model("dizzyrnn", "regress", input_size=2, hidden_size=8, rotations=3)
    assert {k: v.shape for k, v in reference.state_dict().items()} == \
        {k: v.shape for k, v in model.state_dict().items()}


def test_best_checkpoint_rule():
    assert improves((0.9, 0.5), None, True)
    assert improves((0.95, 0.9), (0.9, 0.1), True)  # a better accuracy wins
    assert not improves((0.85, 0.01), (0.9, 0.5), True)
    assert improves((1.0, 0.2), (1.0, 0.3), True)  # same accuracy: the lower loss wins
    assert not improves((1.0, 0.3), (1.0, 0.3), True)
    assert improves((0.1, 0.1), (0.2, 0.2), False)  # lower is better for mse / perplexity


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("select", ["best", "last"])
def test_select_keeps_the_best_or_the_last_checkpoint(tmp_path, select):
    run = tmp_path / select
    summary = train(small(run, steps=16, log_every=2, lr=0.05, select=select), progress=False)
    rows = _rows(run)
    kept = checkpoint.load_weights(run / "model.safetensors")
    last = checkpoint.load_weights(run / "last.safetensors")
    best_row = min(rows, key=lambda r: r["val_mse"])  # the first of equal minima
    assert summary["best_step"] == best_row["step"] and summary["select"] == select
    same = all(torch.equal(kept[k], last[k]) for k in last)
    if select == "last":
        assert summary["kept_step"] == 16 and same
    else:
        assert summary["kept_step"] == best_row["step"]
        assert same == (best_row["step"] == 16)
    # the test figure is that of the kept weights, evaluated here independently
    model, _ = checkpoint.load_model(run)
    task = make_task("adding", seq_len=10)
    assert evaluate(model, task, task.test, 256, "cpu")["mse"] == pytest.approx(
        summary["test"]["mse"])


def test_select_auto_rule():
    from orthornn.training.evaluation import MIN_SELECT_SIZE, resolve_select

    small_val = make_task("ucr", dataset="ItalyPowerDemand").val  # 13 series
    large_val = make_task("digits").val
    assert len(small_val) < MIN_SELECT_SIZE <= len(large_val)
    assert resolve_select("auto", small_val) == "last"
    assert resolve_select("auto", large_val) == "best"
    assert resolve_select("auto", make_task("adding", seq_len=10).val) == "best"
    assert resolve_select("best", small_val) == "best"  # an explicit choice stands


def test_sgornn_gates_are_logged(tmp_path):
    run = tmp_path / "run"
    train(small(run, arch="sgornn", steps=4, log_every=2, select="last"), progress=False)
    rows = _rows(run)
    model, _ = checkpoint.load_model(run)
    a, b2 = model.layer.gates()
    assert rows[-1]["gate_a"] == pytest.approx(a.item())
    assert rows[-1]["gate_b2"] == pytest.approx(b2.item())
    assert all(r["gate_b2"] <= 1 - 2 * r["gate_a"] for r in rows)


def test_a_runs_config_json_is_a_config_file(tmp_path, capsys):
    """--config RUN/config.json trains a new run with the old run's options (flags over
    them, a new --out)."""
    first = tmp_path / "first"
    assert cli(["train", "--arch", "svdrnn", "--task", "adding", "--seq-len", "6", "--hidden",
                "8", "--steps", "4", "--batch-size", "8", "--log-every", "2", "--lr", "0.02",
                "--no-progress", "--out", str(first)]) == 0
    second = tmp_path / "second"
    assert cli(["train", "--config", str(first / "config.json"), "--seed", "1",
                "--out", str(second), "--no-progress"]) == 0
    old = json.loads((first / "config.json").read_text())["train"]
    new = json.loads((second / "config.json").read_text())["train"]
    assert {k: v for k, v in new.items() if k not in ("out", "seed")} == \
        {k: v for k, v in old.items() if k not in ("out", "seed")}
    assert (new["seed"], new["out"], new["lr"]) == (1, str(second), 0.02)
    # without a new --out the old run is not written over
    capsys.readouterr()
    assert cli(["train", "--config", str(first / "config.json"), "--no-progress"]) == 2
    assert "--out RUN_DIR is required" in capsys.readouterr().err


def test_resume_budget_is_the_runs_total_in_either_unit(tmp_path, capsys):
    run = tmp_path / "run"
    # permuted digits: 1257 training sequences, batch 64 -> 20 steps an epoch; 0.2 -> 4 steps
    common = ["--arch", "rnn", "--task", "permuted-digits", "--hidden", "8", "--log-every",
              "2", "--no-progress", "--out", str(run)]
    assert cli(["train", *common, "--epochs", "0.2"]) == 0
    capsys.readouterr()
    assert cli(["train", *common, "--resume", "--steps", "6", "--show-config"]) == 0
    shown = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "flag (the run's total: --resume trains up to it)" in shown["steps"]
    assert "None" in shown["epochs"] and "flag --steps replaces it" in shown["epochs"]
    assert cli(["train", *common, "--resume", "--steps", "6"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_at"]) == (6, 4)
    train_config = json.loads((run / "config.json").read_text())["train"]
    assert (train_config["steps"], train_config["epochs"]) == (6, None)  # the run's options now
    capsys.readouterr()
    assert cli(["train", *common, "--resume", "--steps", "5"]) == 2
    assert "is at step 6 of 5: give a larger total budget" in capsys.readouterr().err
    assert cli(["train", *common, "--resume", "--epochs", "0.4"]) == 0  # 8 steps in all
    assert json.loads((run / "summary.json").read_text())["steps"] == 8


def test_a_run_for_a_search_never_scores_the_test_split(tmp_path, monkeypatch):
    """train(score_test=False) (bench/experiments/ucr_search.py): the summary has no test
    score, and the test split's data is never evaluated; by default it is, once."""
    import orthornn.training.trainer as trainer

    scored = []
    real = trainer.evaluate

    def spy(model, task, data, *args, **kwargs):
        scored.append(data is task.test)
        return real(model, task, data, *args, **kwargs)
    monkeypatch.setattr(trainer, "evaluate", spy)
    summary = train(small(tmp_path / "search", steps=4), progress=False, score_test=False)
    assert summary["test"] is None and scored and not any(scored)
    scored.clear()
    summary = train(small(tmp_path / "final", steps=4), progress=False)
    assert set(summary["test"]) >= {"loss"} and scored.count(True) == 1
