"""Every Triton kernel of models/ops compiles, ahead of time and without a GPU, for the
cards users run, at every tile and warp count the launchers choose for the sizes the
dispatch sends to a kernel, in both precisions and argument specializations
(``scripts/compile_check.py`` enumerates them from the launchers' own functions). The
flags: every activation with every switch on, and relu with every switch off, for sm_90a
(H100, H200: 206 compilations, about a minute of a core with a cold cache);
``--runslow`` adds sm_80 (A100) and every flag combination for both (2232).
A configuration fails when ptxas spills any register, or the shared memory a launch
requests is over the card's per-block limit.

The compilations run once per session, in a subprocess without TRITON_INTERPRET (the
interpreter's kernels do not compile), on every CPU; Triton's cache
(``~/.triton/cache`` or ``TRITON_CACHE_DIR``) makes reruns quick. This is what ptxas
compiled, not what ran on a device."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# a development tool in scripts/, not part of the wheel
_SPEC = importlib.util.spec_from_file_location(
    "compile_check", Path(__file__).resolve().parents[2] / "scripts" / "compile_check.py")
compile_check = sys.modules["compile_check"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(compile_check)

#: make test's set: the card this project measures on (sm_80's half of the set cost another
#: minute of CI's two cores with a cold Triton cache; the slow test below compiles it)
TARGETS = ("sm_90a",)
CONFIGS = compile_check.configurations(targets=TARGETS)
# The first test waits for every compilation (the session fixture): on 2 idle cores about
# 40 s with a cold Triton cache and 15 s warm; three minutes beside other heavy jobs.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile-check") / "kernels.json"
    report = compile_check.run_subprocess(str(out), jobs=os.cpu_count(), targets=TARGETS)
    return {row["ident"]: row for row in report["rows"]}


@pytest.mark.parametrize("config", CONFIGS, ids=[c.ident for c in CONFIGS])
def test_kernel_compiles_without_spills(compiled, config):
    row = compiled[config.ident]
    assert row["error"] is None, row["error"]
    assert row["problems"] == [], (f"{config.ident} ({config.tile}): "
                                   f"{'; '.join(row['problems'])}")
    assert 0 < row["registers"] <= compile_check.MAX_REGISTERS


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_flag_combination_compiles(tmp_path):
    """``compile_check --full``: every flag combination of every kernel (about 5 minutes
    on 2 idle cores with a cold cache)."""
    report = compile_check.run_subprocess(str(tmp_path / "full.json"), full=True,
                                          jobs=os.cpu_count(), timeout=3600)
    bad = [f"{r['ident']}: {'; '.join(r['problems'])}" for r in report["rows"] if r["problems"]]
    assert len(report["rows"]) == len(compile_check.configurations(full=True))
    assert not bad, "\n".join(bad)


def test_enumeration_covers_every_dispatched_size():
    """Each size the dispatch sends to a kernel launches a configuration that the check
    compiles: the same launch options and constexprs, read from the launchers."""
    from orthornn.models.ops import householder, rotations, scan, triton_chains, triton_scan

    seen = {(c.fn, c.options, c.constexprs) for c in CONFIGS}

    def covered(kernel, options, meta):
        return (kernel.__name__, tuple(sorted(options.items())),
                tuple(sorted(meta.items()))) in seen

    for n in range(1, scan.MAX_TRITON_HIDDEN + 1):
        for precision in ("ieee", "tf32"):
            for columns in (1, *compile_check.SPLIT_COLUMNS):
                options, meta, _ = triton_scan.launch_meta(n, "modrelu", True, True, precision,
                                                           columns)
                assert covered(triton_scan._scan_fwd_kernel, options,
                               dict(meta, STORE_PRE=True)), (n, columns)
                assert covered(triton_scan._scan_bwd_kernel, options,
                               dict(meta, HAS_D_STATES=True)), (n, columns)
    for n in range(1, householder.MAX_TRITON_SIZE + 1):
        options, meta = triton_chains.householder_launch_meta(n, True)
        assert covered(triton_chains._householder_fwd_kernel, options, meta), n
        assert covered(triton_chains._householder_bwd_kernel, options, meta), n
    for n in range(1, rotations.MAX_TRITON_ROWS + 1):
        options, meta = triton_chains.givens_launch_meta(n, True)
        assert covered(triton_chains._givens_fwd_kernel, options, dict(meta, KEEP=True)), n
        assert covered(triton_chains._givens_bwd_kernel, options, meta), n


def test_every_target_and_kernel_enumerated():
    kernels = {c.kernel for c in CONFIGS}
    assert kernels == {"scan_fwd", "scan_bwd", "householder_fwd", "householder_bwd",
                       "givens_fwd", "givens_bwd"}
    assert {c.target for c in CONFIGS} == set(TARGETS)
    assert len({c.ident for c in CONFIGS}) == len(CONFIGS)
    # every card's set is the same enumeration: the full check's sm_80 half mirrors it
    everything = compile_check.configurations()
    assert {c.target for c in everything} == set(compile_check.TARGETS)
    for target in compile_check.TARGETS:
        mine = [c.ident.replace(target, "T") for c in everything if c.target == target]
        assert sorted(mine) == sorted(c.ident.replace(TARGETS[0], "T") for c in CONFIGS)


def test_ptxas_log_parsing():
    log = ("ptxas info    : Compiling entry function '_k' for 'sm_90a'\n"
           "ptxas info    : Function properties for _k\n"
           "    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 96 registers, used 1 barriers, 16 bytes cumulative stack size\n")
    assert compile_check.parse_ptxas(log) == dict(registers=96, spill_stores=12, spill_loads=8,
                                                  stack=16, static_shared=0)
    config = CONFIGS[0]
    fine = dict(registers=64, spill_stores=0, spill_loads=0, stack=0, static_shared=0,
                shared=1024)
    assert compile_check.problems(config, fine) == []
    spilled = dict(fine, spill_stores=4, spill_loads=4)
    assert "spills" in compile_check.problems(config, spilled)[0]
    limit = compile_check.TARGETS[config.target]["max_shared"]
    assert "shared memory" in compile_check.problems(config, dict(fine, shared=limit + 1))[0]
