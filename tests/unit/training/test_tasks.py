"""Task data: shapes, label ranges, determinism and baselines, against the task
definitions of the papers."""

import math

import numpy as np
import pytest
import torch
from orthornn.training.corpus import EOS, UNK, build_vocabulary, tokenize
from orthornn.training.data import EpochSampler, TokenStream
from orthornn.training.tasks import (
    adding_batch,
    copy_baseline,
    copy_batch,
    fold_series,
    make_task,
    step_width,
    train_size,
    ucr_datasets,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_adding_batch_structure():
    b = adding_batch(500, 30, gen())
    assert b.x.shape == (500, 30, 2) and b.y.shape == (500, 1)
    markers = b.x[..., 1]
    assert torch.all(markers.sum(1) == 2)
    assert torch.all(markers[:, :15].sum(1) == 1) and torch.all(markers[:, 15:].sum(1) == 1)
    assert torch.all((b.x[..., 0] >= 0) & (b.x[..., 0] < 1))
    torch.testing.assert_close(b.y[:, 0], (b.x[..., 0] * markers).sum(1))
    again = adding_batch(500, 30, gen())
    assert torch.equal(again.x, b.x)  # determinism under a seed
    assert not torch.equal(adding_batch(500, 30, gen(1)).x, b.x)


def test_adding_baseline_is_the_mse_of_predicting_one():
    task = make_task("adding", seq_len=20)
    b = adding_batch(200_000, 20, gen(3))
    assert (b.y - 1).square().mean().item() == pytest.approx(task.baseline, abs=2e-3)
    assert task.baseline == pytest.approx(0.167, abs=1e-3)


def test_copy_batch_structure_and_baseline():
    lag = 25
    b = copy_batch(300, lag, gen())
    steps = lag + 20
    assert b.x.shape == (300, steps, 10) and b.y.shape == (300, steps)
    symbols = b.x.argmax(-1)
    assert torch.all((symbols[:, :10] >= 1) & (symbols[:, :10] <= 8))
    assert torch.all(symbols[:, steps - 11] == 9)  # the marker, ten steps before the end
    blanks = torch.ones(steps, dtype=torch.bool)
    blanks[:10] = False
    blanks[steps - 11] = False
    assert torch.all(symbols[:, blanks] == 0)
    assert torch.equal(b.y[:, -10:], symbols[:, :10])
    assert torch.all(b.y[:, :-10] == 0)
    # the baseline strategy: certain blanks, then uniform over the 8 symbols
    probs = torch.zeros(300, steps, 10)
    probs[:, :-10, 0] = 1
    probs[:, -10:, 1:9] = 1 / 8
    ce = -torch.log(probs.gather(-1, b.y.unsqueeze(-1)).clamp_min(1e-30)).mean().item()
    assert ce == pytest.approx(copy_baseline(lag))
    assert copy_baseline(lag) == pytest.approx(10 * math.log(8) / (lag + 20))


def test_copy_paper_variant_dizzyrnn_sec6():
    """DizzyRNN sec. 6: 10 symbols of an alphabet of 10, a lag of 90, only the copied
    portion scored (baseline log 10, chance accuracy 10%)."""
    lag = 90
    b = copy_batch(400, lag, gen(), symbols=10)
    steps = lag + 20
    assert b.x.shape == (400, steps, 12) and b.y.shape == (400, steps)
    symbols = b.x.argmax(-1)
    assert torch.all((symbols[:, :10] >= 1) & (symbols[:, :10] <= 10))
    assert set(symbols[:, :10].unique().tolist()) == set(range(1, 11))
    assert torch.all(symbols[:, steps - 11] == 11)  # the marker: symbols + 1
    assert torch.equal(b.y[:, -10:], symbols[:, :10]) and torch.all(b.y[:, :-10] == 0)
    task = make_task("copy", seq_len=lag, copy_loss="copied", copy_symbols=10)
    assert (task.input_size, task.num_outputs, task.scored_steps) == (12, 12, 10)
    assert task.options == {"seq_len": 90, "copy_loss": "copied", "copy_symbols": 10}
    assert task.baseline == pytest.approx(math.log(10)) == copy_baseline(lag, 10, "copied")
    # the baseline strategy on the copied steps: uniform over the 10 data symbols
    probs = torch.zeros(400, 10, 12)
    probs[..., 1:11] = 1 / 10
    ce = -torch.log(probs.gather(-1, b.y[:, -10:].unsqueeze(-1))).mean().item()
    assert ce == pytest.approx(task.baseline)
    # the default stays Arjovsky's: every step, 8 symbols, the same data as before
    default = make_task("copy", seq_len=lag)
    assert default.scored_steps is None and default.input_size == 10
    assert default.options == {"seq_len": 90, "copy_loss": "all", "copy_symbols": 8}
    assert default.baseline == pytest.approx(10 * math.log(8) / (lag + 20))
    assert torch.equal(copy_batch(5, 7, gen(2)).x, copy_batch(5, 7, gen(2), symbols=8).x)


def test_copied_loss_ignores_the_non_copied_steps():
    from orthornn.training.trainer import task_loss

    torch.manual_seed(0)
    b = copy_batch(4, 6, gen(), symbols=10)  # 26 steps, the last 10 copied
    out = torch.randn(4, 26, 12)
    # by hand: the mean negative log-softmax of the target over the 4 x 10 copied steps
    total = 0.0
    for i in range(4):
        for t in range(16, 26):
            logits = out[i, t].double()
            total -= (logits[b.y[i, t]] - torch.logsumexp(logits, 0)).item()
    copied = task_loss("seq2seq", out, b.y, scored_steps=10)
    assert copied.item() == pytest.approx(total / 40, rel=1e-6)
    changed = out.clone()
    changed[:, :16] = torch.randn(4, 16, 12) * 100  # the non-copied steps do not count
    assert task_loss("seq2seq", changed, b.y, scored_steps=10).item() == pytest.approx(
        copied.item(), rel=1e-6)
    assert task_loss("seq2seq", changed, b.y).item() != pytest.approx(copied.item(), rel=1e-3)
    every = task_loss("seq2seq", out, b.y)  # the default: every step
    assert every.item() == pytest.approx(torch.nn.functional.cross_entropy(
        out.reshape(-1, 12), b.y.reshape(-1)).item(), rel=1e-6)


@pytest.mark.parametrize("options,match", [
    ({"copy_loss": "copy"}, "copy_loss must be one of 'all', 'copied'; got 'copy'"),
    ({"copy_loss": None, "copy_symbols": 1}, "copy_symbols must be an integer in \\[2, 1000\\]"),
    ({"copy_symbols": 2.5}, "copy_symbols must be an integer"),
])
def test_copy_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        make_task("copy", seq_len=10, **options)


def test_copy_options_apply_to_copy_only():
    with pytest.raises(ValueError, match="copy_loss do not apply to task 'adding'"):
        make_task("adding", copy_loss="copied")


@pytest.mark.parametrize("name", ["digits", "permuted-digits"])
def test_digits(name):
    task = make_task(name)
    sizes = [len(task.train), len(task.val), len(task.test)]
    assert sum(sizes) == 1797 and sizes[0] > sizes[1] > 0
    for split in (task.train, task.val, task.test):
        assert split.x.shape[1:] == (64, 1)
        assert split.y.min() >= 0 and split.y.max() <= 9
        assert split.x.min() >= 0 and split.x.max() <= 1
    assert task.kind == "classify" and task.num_outputs == 10 and task.metric == "accuracy"
    again = make_task(name)
    assert torch.equal(again.test.x, task.test.x)  # a fixed split


def test_digits_are_scikit_learns_load_digits_without_importing_it():
    """The file read directly is the data set scikit-learn's own loader returns, and
    reading it imports nothing of scikit-learn (a subprocess: this one may have)."""
    import subprocess
    import sys

    from orthornn.training.tasks.bundled import load_digits
    from sklearn.datasets import load_digits as sklearns

    pixels, classes = load_digits()
    reference = sklearns()
    np.testing.assert_array_equal(pixels, reference.data)
    np.testing.assert_array_equal(classes, reference.target)
    assert pixels.dtype == reference.data.dtype and classes.dtype == reference.target.dtype
    code = ("import sys; from orthornn.training.tasks import make_task; make_task('digits'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_permuted_digits_is_a_fixed_pixel_permutation_of_digits():
    plain, perm = make_task("digits"), make_task("permuted-digits")
    assert torch.equal(plain.test.y, perm.test.y)
    a, b = plain.test.x[..., 0], perm.test.x[..., 0]
    assert not torch.equal(a, b)
    order = [int(torch.nonzero((a[:, [j]] == b).all(0))[0]) for j in range(64)
             if (a[:, [j]] == b).all(0).sum() == 1]
    assert len(order) > 40  # most pixels identified; the mapping is one fixed permutation


def test_mnist1d():
    task = make_task("mnist1d")
    assert task.train.x.shape == (3500, 40, 1) and task.test.x.shape == (1000, 40, 1)
    assert set(task.train.y.tolist()) == set(range(10))


@pytest.mark.parametrize("name,steps,width,n_test", [("GunPoint", 15, 10, 150),
                                                     ("ArrowHead", 251, 1, 175)])
def test_ucr_folds_series_like_the_spectral_rnn_appendix(name, steps, width, n_test):
    assert name in ucr_datasets()
    task = make_task("ucr", dataset=name)
    assert task.train.x.shape[1:] == (steps, width)
    assert len(task.test) == n_test
    total = len(task.train) + len(task.val)
    assert len(task.val) == round(0.2 * total)
    flat = make_task("ucr", dataset=name, point_by_point=True)
    assert flat.train.x.shape[1:] == (steps * width, 1)
    torch.testing.assert_close(flat.test.x.reshape(n_test, -1), task.test.x.reshape(n_test, -1))


def test_step_width_and_multivariate_folding():
    assert step_width(150) == 10 and step_width(251) == 1 and step_width(100) == 10
    x = np.arange(2 * 3 * 6, dtype=np.float32).reshape(2, 3, 6)  # [N, channels, L]
    folded = fold_series(x, point_by_point=False)  # n_i = 2: 3 steps of 3 x 2 values
    assert folded.shape == (2, 3, 6)
    assert folded[0, 1].tolist() == [2, 3, 8, 9, 14, 15]


def test_a_chosen_step_width_pads_the_series_with_its_last_value():
    """ArrowHead's 251 points (prime) in steps of 4: 63 steps, the last one's values the
    series' 249..251th points then the 251th again; the points themselves unchanged."""
    x = np.random.default_rng(0).normal(size=(3, 2, 251)).astype(np.float32)
    folded = fold_series(x, point_by_point=False, width=4)
    assert folded.shape == (3, 63, 8)
    padded = np.concatenate([x, x[:, :, -1:]], axis=2)  # the reference: one point repeated
    for step in (0, 30, 62):
        expected = padded[:, :, 4 * step:4 * step + 4].reshape(3, 8)  # channel-major
        np.testing.assert_array_equal(folded[:, step], expected)
    task = make_task("ucr", dataset="ArrowHead", step_width=4)
    default = make_task("ucr", dataset="ArrowHead", point_by_point=True)
    assert task.train.x.shape[1:] == (63, 4) and default.train.x.shape[1:] == (251, 1)
    torch.testing.assert_close(task.test.x.reshape(len(task.test), -1)[:, :251],
                               default.test.x.reshape(len(default.test), -1))
    for bad, message in ((0, "got 0"), (True, "got True"), (252, "at most the series' "
                                                                  "length 251")):
        with pytest.raises(ValueError, match=message):
            make_task("ucr", dataset="ArrowHead", step_width=bad)
    with pytest.raises(ValueError, match="not with point_by_point"):
        make_task("ucr", dataset="ArrowHead", step_width=2, point_by_point=True)


def test_ucr_validation_folds_are_disjoint_blocks_of_the_training_split():
    """--val-fold K: the K-th of the training split's disjoint 20% blocks validates, the
    rest trains; fold 0 (the default) is the appendix's one split."""
    from orthornn.training.tasks.ucr import ucr_folds

    default = make_task("ucr", dataset="ArrowHead", step_width=2)
    n = len(default.train) + len(default.val)  # 36 series: 29 train, 7 validate
    assert (n, len(default.val), ucr_folds(n)) == (36, 7, 5)
    rows = {tuple(r.tolist()) for r in make_task("ucr", dataset="ArrowHead",
                                                 step_width=2).train.x.reshape(29, -1)}
    seen = []
    for fold in range(5):
        task = make_task("ucr", dataset="ArrowHead", step_width=2, val_fold=fold)
        train = {tuple(r.tolist()) for r in task.train.x.reshape(len(task.train), -1)}
        val = [tuple(r.tolist()) for r in task.val.x.reshape(len(task.val), -1)]
        assert len(val) == 7 and len(train) == 29 and not train & set(val)
        torch.testing.assert_close(task.test.x, default.test.x)  # the test split never moves
        seen += val
        if fold == 0:
            assert train == rows
    assert len(set(seen)) == 35  # disjoint blocks: 35 of the 36 series validate once
    for bad in (5, -1, True, 1.0):
        with pytest.raises(ValueError, match="val_fold must be an integer from 0 to 4"):
            make_task("ucr", dataset="ArrowHead", val_fold=bad)


def test_ucr_unknown_dataset_lists_bundled():
    with pytest.raises(ValueError, match=r"bundled with sktime: .*GunPoint"):
        make_task("ucr", dataset="Wafer")


def test_lm_corpus_and_vocabulary():
    task = make_task("lm", vocab_size=500, bptt=20)
    assert task.vocabulary[:2] == [UNK, EOS] and len(task.vocabulary) == 500
    assert task.input_size == task.num_outputs == 500
    assert len(task.train) > 400_000  # real text: wiki articles and news
    ids = torch.tensor(task.train)
    assert ids.min() >= 0 and ids.max() < 500
    assert task.val.inputs.shape[1] > 1000 and task.test.inputs.shape[1] > 1000
    assert tokenize("The 3 cats' owner's 1,000 dogs.") == ["the", "N", "cats", "owner's", "N",
                                                          "dogs", EOS]


def test_lm_user_corpus(tmp_path):
    text = "\n\n".join(f"paragraph {i} about the cat and the dog and the bird number {i}"
                       for i in range(40))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    task = make_task("lm", corpus=str(path), vocab_size=20, bptt=5)
    assert task.vocabulary[2] == "the"  # the most frequent word
    with pytest.raises(ValueError, match="corpus must be a readable text file"):
        make_task("lm", corpus=str(tmp_path / "missing.txt"))


def test_vocabulary_ranking():
    assert build_vocabulary(["b", "a", "b", "c", "a", "b"], 4) == [UNK, EOS, "b", "a"]


def test_token_stream_windows_carry_across_steps():
    stream = TokenStream(torch.arange(101), columns=4, bptt=10)
    x0, y0, fresh0 = stream.window(0)
    x1, _, fresh1 = stream.window(1)
    assert fresh0 and not fresh1
    assert x0.shape == (4, 10) and torch.equal(y0, x0 + 1)
    assert torch.equal(x1[:, 0], x0[:, -1] + 1)  # each column continues its own stream


def test_epoch_sampler_covers_each_epoch():
    task = make_task("digits")
    sampler = EpochSampler(task.train, 100, seed=0)
    seen = torch.cat([sampler.batch(i).y for i in range(sampler.per_epoch)])
    assert len(seen) == 100 * (len(task.train) // 100)


# -- a user's data ---------------------------------------------------------------------

def _npz(tmp_path, **arrays):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return str(path)


def test_user_npz_with_lengths(tmp_path):
    x = np.random.rand(50, 7, 3).astype(np.float32)
    lengths = np.random.randint(1, 8, 50)
    path = _npz(tmp_path, x=x, y=np.arange(50) % 3, lengths=lengths,
                labels=np.array(["a", "b", "c"]))
    task = make_task("classify", data=path)
    assert task.labels == ["a", "b", "c"] and task.input_size == 3
    assert len(task.train) + len(task.val) + len(task.test) == 50
    assert task.train.lengths is not None


@pytest.mark.parametrize("arrays,match", [
    ({"x": np.zeros((20, 5, 2))}, "missing 'y'"),
    ({"x": np.zeros((20, 5, 2, 1)), "y": np.zeros(20, int)}, "data x must be a numeric array"),
    ({"x": np.full((20, 5, 2), np.nan), "y": np.zeros(20, int)}, "NaN"),
    ({"x": np.zeros((20, 5, 2)), "y": np.zeros(19, int)}, "data y must be integer class ids"),
    ({"x": np.zeros((20, 5, 2)), "y": np.zeros(20)}, "data y must be integer class ids"),
    ({"x": np.zeros((20, 5, 2)), "y": np.zeros(20, int), "lengths": np.full(20, 9)},
     "data lengths must be integers"),
])
def test_user_npz_errors(tmp_path, arrays, match):
    with pytest.raises(ValueError, match=match):
        make_task("classify", data=_npz(tmp_path, **arrays))


def test_task_errors():
    with pytest.raises(ValueError, match="task must be one of adding, copy"):
        make_task("mnist")
    with pytest.raises(ValueError, match="option\\(s\\) dataset do not apply to task 'adding'"):
        make_task("adding", dataset="GunPoint")
    with pytest.raises(ValueError, match="seq_len must be an integer in \\[2"):
        make_task("adding", seq_len=1)


@pytest.mark.parametrize("name,options", [
    ("digits", {}), ("permuted-digits", {}), ("mnist1d", {}),
    *[("ucr", {"dataset": d}) for d in ucr_datasets()], ("classify", {"data": 33}),
    ("classify", {"data": 10})])
def test_train_size_is_the_length_of_the_built_training_split(name, options, tmp_path):
    """train_size counts without building the task (the presets' batch cap); the split it
    counts must be the one make_task builds."""
    if name == "classify":  # a user's .npz of N sequences
        n, path = options["data"], tmp_path / "data.npz"
        rng = np.random.default_rng(0)
        np.savez(path, x=rng.normal(size=(n, 4, 2)).astype(np.float32), y=np.arange(n) % 3)
        options = {"data": str(path)}
    assert train_size(name, **options) == len(make_task(name, **options).train)


def test_train_size_is_none_without_a_fixed_training_split(tmp_path):
    assert train_size("adding") is None and train_size("copy") is None
    assert train_size("lm") is None and train_size("ucr", dataset="Wafer") is None
    assert train_size("classify", data=str(tmp_path / "missing.npz")) is None
