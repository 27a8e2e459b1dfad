"""Export: onnxruntime against torch for every recurrent architecture and both modes,
the ai.orthornn functions against the parametrizations, packages, verification and
atomic publishing."""

import json
import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from orthornn.export.artifacts import repository
from orthornn.export.artifacts.package import (
    TOLERANCE,
    PackageError,
    golden_check,
    session_from_bytes,
    sha256,
    verify_package,
)
from orthornn.export.builder import functions
from orthornn.export.builder.exporter import export_run
from orthornn.export.builder.graph import DOMAIN, IR_VERSION
from orthornn.export.builder.onnx_export import build_graph
from orthornn.models import ARCHITECTURES, build_model
from orthornn.models.parametrizations import (
    HouseholderChain,
    PackedGivens,
    RotationPermutation,
    ScaledCayley,
)
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import train

from orthornn.cli import main as cli

RECURRENT = [a for a in ARCHITECTURES if ARCHITECTURES[a].recurrent]
V = 13


def _model(arch, task):
    """Every parameter drawn at random: an untrained model's zero biases (scoRNN's modReLU
    bias among them) would leave their terms of the graph uncompared. Dense W is scaled by
    1/sqrt(n) to keep the recurrence bounded; the parametrized ones are orthogonal (or
    near) for any parameters."""
    model = build_model(arch, task, input_size=V if task == "lm" else 3, hidden_size=8,
                        num_outputs=None if task == "lm" else 4).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if name == "layer.transition.weight" else 0.5)
    return model


def _run(proto, feeds):
    sess = session_from_bytes(proto.SerializeToString())
    return sess.run(None, feeds)


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.parametrize("mode", ["dense", "factored"])
@pytest.mark.parametrize("task", ["classify", "lm"])
def test_onnxruntime_equals_torch(arch, mode, task):
    model = _model(arch, task)
    proto = build_graph(model, mode)
    onnx.checker.check_model(proto, full_check=True)
    sess = session_from_bytes(proto.SerializeToString())
    for batch, steps, lengths in [(1, 1, [1]), (3, 7, [7, 2, 5]), (5, 12, [12] * 5)]:
        x = torch.randint(0, V, (batch, steps)) if task == "lm" else torch.randn(batch, steps, 3)
        lengths = torch.tensor(lengths)
        with torch.no_grad():
            ref, last = model(x, lengths=lengths, return_state=True)
        out, state = sess.run(["logits", "state"], {"tokens" if task == "lm" else "x":
                                                    x.numpy(), "lengths": lengths.numpy()})
        np.testing.assert_allclose(out, ref.numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(state, last.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.parametrize("mode", ["dense", "factored"])
@pytest.mark.parametrize("task", ["classify", "lm"])
def test_chunks_carrying_initial_state_equal_the_whole_sequence(arch, mode, task):
    """Streaming: a sequence fed in chunks, each starting from the state the last one
    returned, ends where one run over the whole sequence ends (onnxruntime vs onnxruntime)
    and where torch ends."""
    model = _model(arch, task)
    sess = session_from_bytes(build_graph(model, mode).SerializeToString())
    key = "tokens" if task == "lm" else "x"
    x = torch.randint(0, V, (2, 11)) if task == "lm" else torch.randn(2, 11, 3)
    whole_out, whole_state = sess.run(["logits", "state"], {key: x.numpy(), "lengths":
                                                           np.array([11, 11])})
    state = None
    for start, stop in [(0, 1), (1, 5), (5, 6), (6, 11)]:
        feeds = {key: x[:, start:stop].numpy(), "lengths": np.full(2, stop - start)}
        if state is not None:
            feeds["initial_state"] = state
        out, state = sess.run(["logits", "state"], feeds)
    np.testing.assert_allclose(state, whole_state, atol=1e-5, rtol=1e-5)
    last = whole_out if task == "classify" else whole_out[:, -1]
    np.testing.assert_allclose(out if task == "classify" else out[:, -1], last, atol=1e-5,
                               rtol=1e-5)
    with torch.no_grad():
        _, ref_state = model(x, return_state=True)
    np.testing.assert_allclose(state, ref_state.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["scornn", "lstm", "sgornn"])
def test_per_step_graph_and_initial_logits_equal_torch(arch):
    model = _model(arch, "classify")
    sess = session_from_bytes(build_graph(model, "dense", per_step=True).SerializeToString())
    x, h0 = torch.randn(3, 6, 3), torch.randn(3, model.state_size) * 0.5
    logits, state = sess.run(["logits", "state"], {"x": x.numpy(), "lengths": np.full(3, 6),
                                                   "initial_state": h0.numpy()})
    with torch.no_grad():
        states, last = model.encode(x, h0)
        ref = model.head(states[..., : model.hidden_size])
        assert torch.allclose(ref[:, -1], model(x, h0=h0), atol=1e-6)
    np.testing.assert_allclose(logits, ref.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, last.numpy(), atol=1e-5, rtol=1e-5)
    lm = _model(arch, "lm")
    sess = session_from_bytes(build_graph(lm, "dense").SerializeToString())
    (initial,) = sess.run(["initial_logits"], {"tokens": np.zeros((3, 2), np.int64),
                                               "lengths": np.full(3, 2),
                                               "initial_state": h0.numpy()})
    with torch.no_grad():
        expected = lm.head(h0[:, : lm.hidden_size])
    np.testing.assert_allclose(initial, expected.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["rnn", "irnn", "ornn", "svdrnn", "vprnn"])
def test_onnx_rnn_operator_path_equals_torch(arch):
    model = _model(arch, "classify")
    proto = build_graph(model, "dense", recurrence="rnn")
    assert any(n.op_type == "RNN" for n in proto.graph.node)
    x, lengths = torch.randn(3, 6, 3), torch.tensor([6, 1, 4])
    with torch.no_grad():
        ref, last = model(x, lengths=lengths, return_state=True)
    out, state = _run(proto, {"x": x.numpy(), "lengths": lengths.numpy()})
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(state, last.numpy(), atol=1e-5)


@pytest.mark.parametrize("arch", RECURRENT)
def test_lm_step_graph_carries_state(arch):
    model = _model(arch, "lm")
    step = build_graph(model, "factored", step=True)
    onnx.checker.check_model(step, full_check=True)
    sess = session_from_bytes(step.SerializeToString())
    tokens = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        ref = model(tokens)
    state = np.zeros((2, model.state_size), np.float32)
    for t in range(5):
        logits, state = sess.run(None, {"tokens": tokens[:, t:t + 1].numpy(), "state": state})
        np.testing.assert_allclose(logits[:, 0], ref[:, t].numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", [a for a in RECURRENT if a != "lstm"])
def test_dense_graph_stores_the_recurrent_weight(arch):
    import re

    model = _model(arch, "classify")
    proto = build_graph(model, "dense")
    (stored,) = [onnx.numpy_helper.to_array(t) for t in proto.graph.initializer
                 if re.fullmatch(r"W_\d+", t.name)]
    np.testing.assert_array_equal(stored, model.recurrent_weight().detach().numpy())


def _function_output(fn, args):
    """Run one ai.orthornn function on constant inputs with onnxruntime."""
    names = [f"in{i}" for i in range(len(args))]
    node = helper.make_node(fn.name, names, ["W"], domain=DOMAIN)
    inits = [onnx.numpy_helper.from_array(np.asarray(a), n) for a, n in zip(args, names,
                                                                           strict=True)]
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info(
        "W", TensorProto.FLOAT, ["n", "n"])], initializer=inits)
    model = helper.make_model(graph, functions=[fn], ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    onnx.checker.check_model(model, full_check=True)
    return _run(model, {})[0]


@pytest.mark.parametrize("n,m", [(2, 1), (7, 5), (16, 16), (64, 64), (9, 3)])
def test_function_householder_chain(n, m):
    p = HouseholderChain(n, m)
    y = p.reflector_matrix().detach().clone()
    if m > 2:
        y[:, 1] = 0  # a zero reflector is the identity (eq. 1)
        p.set_factors(reflectors=y)
    w = _function_output(functions.householder_chain(18), [y.numpy()])
    np.testing.assert_allclose(w, p.matrix().detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("cls", [PackedGivens, RotationPermutation])
def test_function_rotations(cls):
    p = cls(10, 5)
    args = [t.detach().numpy() for t in p.factors().values()]  # the exporter's inputs
    fn = functions.packed_givens(18)
    if cls is RotationPermutation:
        fn = functions.rotation_permutation(18)
    np.testing.assert_allclose(_function_output(fn, args), p.matrix().detach().numpy(),
                               atol=1e-5)


@pytest.mark.parametrize("n,rho", [(3, 1), (12, 6)])
def test_function_scaled_cayley(n, rho):
    p = ScaledCayley(n, rho)
    with torch.no_grad():
        p.skew.normal_(0, 0.5)
    w = _function_output(functions.scaled_cayley(18), [p.skew.detach().numpy(),
                                                       p.upper_index.numpy(),
                                                       p.diagonal.numpy()])
    np.testing.assert_allclose(w, p.matrix().detach().numpy(), atol=1e-5)


# -- packages -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "c.txt"
    corpus.write_text("\n\n".join(f"the cat sat on the mat {i} and the dog ran"
                                  for i in range(40)))
    common = dict(hidden_size=8, steps=4, batch_size=8, log_every=4, optimizer="adam")
    train(TrainConfig(arch="svdrnn", task="adding", seq_len=6, out=str(root / "adding"),
                      **common), progress=False)
    train(TrainConfig(arch="lstm", task="lm", corpus=str(corpus), vocab_size=20, bptt=5,
                      out=str(root / "lm"), **common), progress=False)
    return root


def test_export_publishes_verified_versions(runs, tmp_path):
    repo = tmp_path / "repo"
    first = export_run(runs / "adding", repo, "adder")
    second = export_run(runs / "adding", repo, "adder", mode="factored")
    assert (first.name, second.name) == ("1", "2")
    manifest = json.loads((second / "manifest.json").read_text())
    for key in ("name", "version", "arch", "task", "mode", "opset", "input_spec", "output_spec",
                "files", "spectral", "training", "source"):
        assert key in manifest, key
    assert manifest["mode"] == "factored" and manifest["version"] == 2
    assert manifest["input_spec"] == {"kind": "float", "feature_size": 2, "max_length": 6}
    assert set(manifest["files"]) == {"model.onnx", "steps.onnx", "golden.npz",
                                      "reference.npz"}  # the drift reference
    assert manifest["spectral"]["sigma_max"] <= 1.01 + 1e-6
    assert verify_package(second).version == 2
    with np.load(second / "golden.npz") as golden:
        assert sorted(golden["model/lengths"].tolist()) != [6, 6, 6, 6]  # padded sequences
    # versions only grow, even after one is deleted
    import shutil

    shutil.rmtree(second)
    assert export_run(runs / "adding", repo, "adder", mode="factored").name == "3"


def test_the_same_checkpoint_is_not_published_twice(runs, tmp_path, capsys):
    """An export run twice, or a retrain that kept the exported checkpoint, names the
    version that holds it and publishes nothing (exit 0: what was asked for is there)."""
    from orthornn.export.builder.exporter import AlreadyPublished

    from orthornn.cli import main

    repo = tmp_path / "repo"
    first = export_run(runs / "adding", repo, "adder")
    with pytest.raises(AlreadyPublished) as same:
        export_run(runs / "adding", repo, "adder")
    assert same.value.path == first
    capsys.readouterr()
    assert main(["export", str(runs / "adding"), "--repo", str(repo), "--name", "adder",
                 "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(first)
    assert f"{first} already holds this checkpoint" in err and "nothing published" in err
    assert repository.versions(repo / "adder") == [1]


def test_lm_package_has_step_graph_and_vocabulary(runs, tmp_path):
    path = export_run(runs / "lm", tmp_path / "repo", "words")
    manifest = verify_package(path)
    assert manifest.graphs == {"model": "model.onnx", "step": "step.onnx"}
    assert manifest.vocabulary_file == "vocab.txt"
    assert (path / "vocab.txt").read_text().split("\n")[:2] == ["<unk>", "<eos>"]
    assert manifest.recurrence == "lstm"
    assert manifest.files["vocab.txt"] == sha256(path / "vocab.txt")  # hashed like the rest


def test_vocabulary_file_is_confined_to_the_package_and_hashed(runs, tmp_path):
    """A manifest's vocabulary_file is a plain file name of the package folder, listed
    with its sha256 in ``files``: "/etc/passwd", "../x" or a link out are refused."""
    path = export_run(runs / "lm", tmp_path / "repo", "words")
    original = json.loads((path / "manifest.json").read_text())

    def refused(match: str, **changes) -> None:
        (path / "manifest.json").write_text(json.dumps({**original, **changes}))
        with pytest.raises(PackageError, match=match):
            verify_package(path)

    outside = tmp_path / "x"
    outside.write_text("<unk>\n<eos>\n")
    for name in ("/etc/passwd", "../x", "sub/vocab.txt", "..", "C:x", 7):
        refused("vocabulary_file" + ("' must be str" if name == 7 else
                                     ".* plain file name inside the package folder"),
                vocabulary_file=name)
    # a name the package holds but the manifest does not hash
    refused(r"no sha256 for vocabulary_file 'vocab2\.txt'", vocabulary_file="vocab2.txt")
    # hashed, but changed
    refused(r"sha256 mismatch for 'vocab\.txt'",
            files={**original["files"], "vocab.txt": "0" * 64})
    # a symbolic link out of the folder, even with the right hash
    (path / "vocab2.txt").symlink_to(outside)
    refused(r"'vocab2\.txt' .* leads outside the package folder", vocabulary_file="vocab2.txt",
            files={**original["files"], "vocab2.txt": sha256(outside)})
    (path / "manifest.json").write_text(json.dumps(original))
    assert verify_package(path).vocabulary_file == "vocab.txt"


def test_a_graph_with_external_data_or_a_linked_manifest_is_refused(runs, tmp_path):
    """Issue 59, finding 10, replayed: a graph whose weights live in an external-data file
    that the manifest does not list was loaded and served (its golden inputs passed, and a
    rewrite of that file later passed verify_package too); a manifest.json that is a
    symbolic link to a file outside the package was read. Now graphs load from their own
    hashed bytes only, and no file of a package may be a link."""
    from onnx.external_data_helper import convert_model_to_external_data
    from orthornn.export.artifacts.package import sha256

    path = export_run(runs / "adding", tmp_path / "repo", "adder")
    model = onnx.load(path / "model.onnx")
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="w.bin",
                                   size_threshold=0)
    onnx.save(model, path / "model.onnx")
    assert (path / "w.bin").stat().st_size > 0
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = sha256(path / "model.onnx")  # hashed: only the rule
    (path / "manifest.json").write_text(json.dumps(manifest))  # can refuse it
    with pytest.raises(PackageError, match=r"'model\.onnx' keeps data in external files"):
        verify_package(path)

    other = export_run(runs / "adding", tmp_path / "repo2", "adder")
    outside = tmp_path / "elsewhere.json"
    outside.write_text((other / "manifest.json").read_text())
    (other / "manifest.json").unlink()
    (other / "manifest.json").symlink_to(outside)
    with pytest.raises(PackageError, match=r"manifest\.json' is a symbolic link"):
        verify_package(other)
    (other / "manifest.json").unlink()
    (other / "manifest.json").write_text(outside.read_text())
    (other / "golden.npz").rename(other / "golden-real.npz")  # a link inside the folder
    (other / "golden.npz").symlink_to(other / "golden-real.npz")
    with pytest.raises(PackageError, match=r"'golden\.npz' .* is a symbolic link"):
        verify_package(other)


def test_tampered_package_fails_verification(runs, tmp_path):
    path = export_run(runs / "adding", tmp_path / "repo", "adder")
    data = bytearray((path / "model.onnx").read_bytes())
    data[-5] ^= 0xFF
    (path / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(PackageError, match=r"sha256 mismatch for 'model\.onnx'"):
        verify_package(path)


def _rewrite_golden(path, change):
    """golden.npz with CHANGE(key, array) applied, rehashed in the manifest (so only the
    golden check can refuse it)."""
    with np.load(path / "golden.npz") as f:
        golden = {k: change(k, f[k]) for k in f.files}
    np.savez(path / "golden.npz", **golden)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["golden.npz"] = sha256(path / "golden.npz")
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_wrong_golden_outputs_fail_verification(runs, tmp_path):
    path = export_run(runs / "adding", tmp_path / "repo", "adder")
    _rewrite_golden(path, lambda k, v: v + 0.01 if k == "model/value" else v)
    with pytest.raises(PackageError, match="golden check failed: model/value"):
        verify_package(path)


@pytest.mark.parametrize("factor,passes", [(0.3, True), (3.0, False)])
def test_golden_check_tolerance(runs, tmp_path, factor, passes):
    """Every output of every case (a regress package: value and state) shifted by FACTOR
    times the tolerance, atol + rtol = TOLERANCE (1 + |expected|)."""
    assert TOLERANCE == 1e-4  # pinned: a loosened constant would loosen this test with it
    path = export_run(runs / "adding", tmp_path / "repo", "adder")
    assert golden_check(path, verify_package(path)) < 0.03 * TOLERANCE  # the graph's own error
    _rewrite_golden(path, lambda k, v: v + factor * TOLERANCE * (1 + np.abs(v))
                    if k.rsplit("/", 1)[1] in ("value", "state") else v)
    if passes:
        assert golden_check(path, verify_package(path)) <= TOLERANCE
    else:
        with pytest.raises(PackageError, match="golden check failed: model"):
            verify_package(path)


def test_interrupted_publish_leaves_no_visible_version(tmp_path):
    def build(tmp, version):
        (tmp / "model.onnx").write_bytes(b"partial")
        raise KeyboardInterrupt  # the process is stopped half way

    with pytest.raises(KeyboardInterrupt):
        repository.publish(tmp_path, "m", build)
    assert os.listdir(tmp_path / "m") == []
    assert repository.versions(tmp_path / "m") == []


@pytest.mark.parametrize("args,message", [
    (["{run}", "--repo", "{repo}", "--name", "a/b"], "no path separators"),
    (["{run}", "--repo", "{repo}", "--name", "x", "--mode", "sparse"], "mode must be one of"),
    (["{missing}", "--repo", "{repo}", "--name", "x"], "does not exist"),
    (["{run}", "--repo", "{repo}", "--name", "x", "--opset", "9"], "opset must be an integer"),
    (["{run}", "--name", "x"], "missing --repo"),
    (["--verify-only", "{missing}"], "not a model package"),
])
def test_export_cli_errors(runs, tmp_path, capsys, args, message):
    values = {"run": str(runs / "adding"), "repo": str(tmp_path / "repo"),
              "missing": str(tmp_path / "nope")}
    code = cli(["export", *[a.format(**values) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "repo" / "x").exists()


def test_export_cli_prints_the_published_path(runs, tmp_path, capsys):
    assert cli(["export", str(runs / "adding"), "--repo", str(tmp_path), "--name", "m"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m" / "1")
    assert cli(["export", "--verify-only", str(tmp_path / "m" / "1")]) == 0


@pytest.mark.parametrize("arch", ["svdrnn", "vprnn"])  # vprnn: the RNN operator won races
def test_the_same_run_exported_twice_gives_identical_graphs(tmp_path, arch):
    """No timing race decides the graph: two exports of one run are the same bytes."""
    train(TrainConfig(arch=arch, task="adding", seq_len=6, hidden_size=8, steps=2,
                      batch_size=8, log_every=1, out=str(tmp_path / "run")), progress=False)
    first = export_run(tmp_path / "run", tmp_path / "a", "m")
    second = export_run(tmp_path / "run", tmp_path / "b", "m")
    for name in ("model.onnx", "steps.onnx", "golden.npz"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert json.loads((first / "manifest.json").read_text())["recurrence"] == "scan"
