"""Ahead-of-time compile check of the Triton kernels: no GPU needed.

``triton.compile`` builds PTX and a cubin for a named target on a machine without a
device; ptxas's verbose log then gives registers per thread, spill stores and loads
and the stack frame, and the compiled metadata the shared memory a launch requests
(Triton's shared memory is dynamic, so ptxas does not count it).

``configurations()`` enumerates the kernel variants the launchers of
``triton_scan`` and ``triton_chains`` can choose, for every size the dispatch sends to
a kernel (``scan.MAX_TRITON_HIDDEN``, ``householder.MAX_TRITON_SIZE``,
``rotations.MAX_TRITON_ROWS``), built from the launchers' own ``*_launch_meta``
functions, so the check and the dispatch cannot drift apart. Sizes that compile to
the same kernel (same constexprs, warps and argument specialization) are merged.

    python scripts/compile_check.py               # the default set
    python scripts/compile_check.py --full        # every flag combination
    python scripts/compile_check.py --target sm_90a   # one card's compilations only
    python scripts/compile_check.py --markdown    # the table of docs/gpu.md
    python scripts/compile_check.py --json out.json

A development tool, kept out of the runtime wheel. It must run without
``TRITON_INTERPRET`` (the interpreter's kernels do not compile);
``run_subprocess`` starts it in a clean process for the tests. What it reports is what
ptxas compiled, not what ran on a device.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor

from orthornn.models.ops.dispatch import MAX_REGISTERS, REGISTER_FILE

#: Compute capability, ptxas architecture and the most shared memory one block may
#: request (opt-in dynamic shared memory, which Triton's launcher opts into above the
#: 48 KiB static default): A100 163 KiB, H100 / H200 227 KiB.
TARGETS = {
    "sm_80": dict(capability=80, arch="sm_80", max_shared=163 * 1024),
    "sm_90a": dict(capability=90, arch="sm_90a", max_shared=227 * 1024),
}
STATIC_SHARED = 48 * 1024  # above it the launch needs the opt-in (Triton does it)

#: Two specializations of the runtime arguments, as Triton's launcher derives them:
#: "aligned": every pointer 16-byte aligned and every integer a multiple of 16 (the
#: docs' shapes: T in {128, 784, 2000}, B in {64, 256}, n a power of two), so loads
#: vectorize; "unaligned": no divisibility anywhere (odd sizes, offset views).
ALIGNS = ("aligned", "unaligned")


@dataclasses.dataclass(frozen=True)
class Config:
    """One kernel compilation: everything ``triton.compile`` needs, hashable."""

    kernel: str  # scan_fwd, scan_bwd, householder_fwd, ...
    module: str  # triton_scan or triton_chains
    fn: str  # the @triton.jit function's name in that module
    sizes: str  # the sizes the dispatch sends to this variant, e.g. "n 65-128"
    variant: str  # the constexpr flags in words
    align: str
    target: str
    options: tuple  # ((name, value), ...): num_warps, maxnreg, ... as the launch passes them
    constexprs: tuple  # ((name, value), ...)
    args: tuple  # ((name, pointer type "*fp32" / "*i64", "fp32", or an int's value), ...)

    @property
    def ident(self) -> str:
        """A unique, readable name: kernel, sizes, flags, specialization, target."""
        return "-".join([self.kernel, self.sizes.replace(" ", ""), self.variant.replace(" ", "_"),
                         self.align, self.target])

    @property
    def num_warps(self) -> int:
        return dict(self.options).get("num_warps", 4)

    @property
    def tile(self) -> str:
        c = dict(self.constexprs)
        keys = [k for k in ("BB", "BN", "BK", "NP", "BC", "RESIDENT", "GATHER_MEM") if k in c]
        parts = [f"{k}={int(c[k]) if isinstance(c[k], bool) else c[k]}" for k in keys]
        parts.append(f"warps={self.num_warps}")
        if "maxnreg" in dict(self.options):
            parts.append(f"maxnreg={dict(self.options)['maxnreg']}")
        return " ".join(parts)

    @property
    def key(self) -> tuple:
        """What the compiled kernel depends on: integers only through their
        specialization (1, a multiple of 16, or neither), as in Triton's launcher."""
        args = tuple((n, _spec(v) if isinstance(v, int) else v) for n, v in self.args)
        return (self.module, self.fn, self.align, self.target, self.options, self.constexprs,
                args)


def _spec(value: int) -> str:
    return "1" if value == 1 else "D" if value % 16 == 0 else ""


# -- the enumeration -----------------------------------------------------------------

def _int_value(name: str, align: str, size: int) -> int:
    """A representative runtime integer: a multiple of 16 when aligned, odd otherwise.
    Sizes take the largest the variant covers (or one less); other integers (batch,
    steps, columns, chain length) 64 or 17 (1 would specialize to a constant)."""
    if name in ("N",):
        return size if align == "aligned" else max(size - 1, 3) | 1
    return 64 if align == "aligned" else 17


def _args(fn, align: str, size: int, pointers: dict[str, str]) -> tuple:
    """(name, type) of every runtime argument of ``fn``; ``pointers`` maps pointer
    arguments to their element type (the launcher's dummies included)."""
    out = []
    for name in fn.arg_names:
        if name in pointers:
            out.append((name, pointers[name]))
        elif name == "slope":
            out.append((name, "fp32"))
        elif name in ("B", "T", "N", "M", "C", "K", "P0", "P1"):
            out.append((name, _int_value(name, align, size)))
    return tuple(out)


def _padded_sizes(limit: int) -> list[tuple[int, int]]:
    """(smallest n, padded size) of every power-of-two bucket up to ``limit``."""
    out, low, padded = [], 1, 16
    while low <= limit:
        out.append((low, padded))
        low, padded = padded + 1, padded * 2
    return out


def _merge(configs: Iterable[Config]) -> list[Config]:
    """One entry per distinct compilation; the size ranges of merged entries joined."""
    merged: dict[tuple, Config] = {}
    for c in configs:
        seen = merged.get(c.key)
        if seen is None:
            merged[c.key] = c
        else:
            low = seen.sizes.split(" ")[1].split("-")[0]
            high = c.sizes.split("-")[-1]
            merged[c.key] = dataclasses.replace(seen, sizes=f"{seen.sizes.split(' ')[0]} "
                                                            f"{low}-{high}")
    return list(merged.values())


#: Column programs per group the split scan variants are compiled for: each gives its own
#: column tile at a padded size (``triton_scan._config``: 2 keeps 64 columns a program, 4
#: gives 32 from n = 128, 8 gives 16).
SPLIT_COLUMNS = (2, 4, 8)


def scan_configurations(full: bool = False, targets=tuple(TARGETS), aligns=ALIGNS):
    """The scan kernels (forward and backward) for every padded hidden size up to
    ``scan.MAX_TRITON_HIDDEN``. Flags: all of KIND x GATED x HAS_LEN x (STORE_PRE or
    HAS_D_STATES) x PRECISION with ``full``; otherwise, per precision, every
    activation with every flag on (the most live values) and relu with every flag off,
    and in the unaligned specialization only the every-flag-on tanh and modrelu. The
    column-split variants (``SPLIT_COLUMNS`` programs a group, a grid barrier a step):
    every flag combination with ``full``, else the every-flag-on modrelu, aligned."""
    from orthornn.models.activations import KINDS
    from orthornn.models.ops import scan, triton_scan

    out = []
    for (low, padded), kernel, target, align, precision, columns in itertools.product(
            _padded_sizes(scan.MAX_TRITON_HIDDEN), ("scan_fwd", "scan_bwd"), targets, aligns,
            ("ieee", "tf32"), (1, *SPLIT_COLUMNS)):
        high = min(padded, scan.MAX_TRITON_HIDDEN)
        extra = "STORE_PRE" if kernel == "scan_fwd" else "HAS_D_STATES"
        if full:
            flags = list(itertools.product(KINDS, (False, True), (False, True), (False, True)))
        elif columns > 1:
            flags = [("modrelu", True, True, True)] if align == "aligned" else []
        elif align == "aligned":
            flags = [(k, True, True, True) for k in KINDS] + [("relu", False, False, False)]
        else:
            flags = [("tanh", True, True, True), ("modrelu", True, True, True)]
        fn = triton_scan.KERNELS[kernel]
        for kind, gated, has_len, more in flags:
            options, meta, used = triton_scan.launch_meta(high, kind, gated, has_len, precision,
                                                          columns)
            if used != columns:
                continue  # too few tiles at this size: the launch uses fewer programs
            meta[extra] = more
            pointers = {a: "*fp32" for a in fn.arg_names if a.endswith("_ptr")}
            pointers["counter_ptr"] = "*i32"
            if has_len:
                pointers["len_ptr"] = "*i64"
            words = [kind, "gated" if gated else "plain", "len" if has_len else "nolen",
                     ("pre" if more else "nopre") if kernel == "scan_fwd"
                     else ("dstates" if more else "nodstates"), precision]
            if columns > 1:
                words.append(f"split{columns}")
            # C and P0 as the launch passes them (C = 1 specializes to a constant; a
            # persistent launch starts at phase 0)
            args = tuple((name, columns if name == "C" else 0 if name == "P0" else value)
                         for name, value in _args(fn, align, high, pointers))
            out.append(Config(kernel, "triton_scan", fn.__name__, f"n {low}-{high}",
                              " ".join(words), align, target, tuple(sorted(options.items())),
                              tuple(sorted(meta.items())), args))
    return _merge(out)


def chain_configurations(full: bool = False, targets=tuple(TARGETS), aligns=ALIGNS):
    """The Householder (up to ``householder.MAX_TRITON_SIZE``) and Givens (up to
    ``rotations.MAX_TRITON_ROWS`` rows) kernels: every flag combination, except that in
    the unaligned specialization (unless ``full``) only transposed Householder chains
    and Givens chains with permutations (and saved inputs) are compiled."""
    from orthornn.models.ops import householder, rotations, triton_chains

    out = []
    for target, align in itertools.product(targets, aligns):
        for (low, padded), kernel, transpose in itertools.product(
                _padded_sizes(householder.MAX_TRITON_SIZE),
                ("householder_fwd", "householder_bwd"), (False, True)):
            if align == "unaligned" and not full and not transpose:
                continue
            high = min(padded, householder.MAX_TRITON_SIZE)
            fn = triton_chains.KERNELS[kernel]
            options, meta = triton_chains.householder_launch_meta(high, transpose)
            pointers = {a: "*fp32" for a in fn.arg_names if a.endswith("_ptr")}
            out.append(Config(kernel, "triton_chains", fn.__name__, f"n {low}-{high}",
                              "transpose" if transpose else "plain", align, target,
                              tuple(sorted(options.items())),
                              tuple(sorted(meta.items())), _args(fn, align, high, pointers)))
        for (low, padded), kernel, has_perm, keep in itertools.product(
                _padded_sizes(rotations.MAX_TRITON_ROWS), ("givens_fwd", "givens_bwd"),
                (False, True), (False, True)):
            if kernel == "givens_bwd" and not keep:
                continue  # the backward has no KEEP flag (it always reads the inputs)
            if align == "unaligned" and not full and not (has_perm and keep):
                continue
            high = min(padded, rotations.MAX_TRITON_ROWS)
            fn = triton_chains.KERNELS[kernel]
            options, meta = triton_chains.givens_launch_meta(high, has_perm)
            if kernel == "givens_fwd":
                meta["KEEP"] = keep
            pointers = {a: "*fp32" for a in fn.arg_names if a.endswith("_ptr")}
            for name in ("partner_ptr", "perm_ptr", "inverse_ptr"):
                if name in pointers:
                    pointers[name] = "*i64"
            if not has_perm:  # the launcher passes partner as the unused permutation
                for name in ("perm_ptr", "inverse_ptr"):
                    if name in pointers:
                        pointers[name] = "*i64"
            words = ["perm" if has_perm else "noperm"]
            if kernel == "givens_fwd":
                words.append("keep" if keep else "nokeep")
            out.append(Config(kernel, "triton_chains", fn.__name__, f"n {low}-{high}",
                              " ".join(words), align, target, tuple(sorted(options.items())),
                              tuple(sorted(meta.items())), _args(fn, align, high, pointers)))
    return _merge(out)


def configurations(full: bool = False, targets=tuple(TARGETS)) -> list[Config]:
    """Every kernel compilation the check makes for TARGETS (see the module docstring)."""
    return scan_configurations(full, targets) + chain_configurations(full, targets)


# -- compiling one configuration ------------------------------------------------------

@functools.cache
def _ptxas() -> tuple[str, str]:
    """(path, version line) of the ptxas Triton itself runs."""
    import triton

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(90).path
    except Exception:  # an older layout: the bundled binary
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "ptxas")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    line = next((v for v in version.splitlines() if "release" in v), version.strip())
    return path, line.strip()


def parse_ptxas(log: str) -> dict:
    """Registers, spill stores and loads, stack frame and static shared memory of the
    entry function in ptxas's ``-v`` log."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    smem = re.search(r"(\d+) bytes smem", log)
    if regs is None or spill is None:
        raise ValueError(f"unexpected ptxas log:\n{log}")
    return dict(registers=int(regs.group(1)), spill_stores=int(spill.group(1)),
                spill_loads=int(spill.group(2)), stack=int(stack.group(1)) if stack else 0,
                static_shared=int(smem.group(1)) if smem else 0)


def _signature(fn, config: Config):
    """(signature, constexprs, attrs) for ``ASTSource`` as the launcher would specialize
    them: a 16-byte-aligned pointer or a multiple-of-16 integer gets tt.divisibility 16,
    an integer 1 becomes a constant."""
    constexprs = dict(config.constexprs)
    runtime = dict(config.args)
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = runtime[name]
        if isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = value
            if value.startswith("*") and config.align == "aligned":
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_config(config: Config) -> dict:
    """Compile one configuration for its target and read ptxas's verdict."""
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
        raise RuntimeError("the compile check needs TRITON_INTERPRET unset "
                           "(use run_subprocess from an interpreter session)")
    import triton
    from triton.backends.compiler import GPUTarget

    module = importlib.import_module(f"orthornn.models.ops.{config.module}")
    fn = getattr(module, config.fn)
    target = TARGETS[config.target]
    signature, constexprs, attrs = _signature(fn, config)
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                       attrs=attrs)
    # Triton runs ptxas -v itself; with dump_ptxas_log it prints the log (to stdout).
    # A cache hit compiles nothing and prints nothing: then ptxas runs here, on the PTX,
    # with the flags Triton's make_cubin passes.
    captured = io.StringIO()
    knobs = getattr(triton, "knobs", None)
    dump = getattr(getattr(knobs, "nvidia", None), "dump_ptxas_log", None)
    try:
        if dump is not None:
            knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(captured):
            compiled = triton.compile(source, target=GPUTarget("cuda", target["capability"], 32),
                                      options=dict(config.options))
    finally:
        if dump is not None:
            knobs.nvidia.dump_ptxas_log = dump
    log = captured.getvalue()
    if "Used" not in log or f"'{target['arch']}'" not in log:
        ptxas, _ = _ptxas()
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "kernel.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            done = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
                                   f"--gpu-name={target['arch']}", ptx, "-o", ptx + ".o"],
                                  capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas failed on {config}:\n{done.stderr}")
        log = done.stderr
    result = parse_ptxas(log)
    result["shared"] = int(compiled.metadata.shared) + result["static_shared"]
    return result


def problems(config: Config, result: dict) -> list[str]:
    """Why a compiled configuration is unacceptable (empty when it is fine)."""
    out = []
    spill = result["spill_stores"] + result["spill_loads"]
    if spill:
        out.append(f"spills {result['spill_stores']} B stored, {result['spill_loads']} B loaded")
    limit = TARGETS[config.target]["max_shared"]
    if result["shared"] > limit:
        out.append(f"shared memory {result['shared']} B over the {limit} B per-block limit")
    threads = 32 * config.num_warps
    if result["registers"] > MAX_REGISTERS or result["registers"] * threads > REGISTER_FILE:
        out.append(f"{result['registers']} registers x {threads} threads over the register file")
    return out


def _compile_entry(config: Config):
    try:
        return config, compile_config(config), None
    except Exception as e:  # reported per configuration, not fatal to the run
        return config, None, f"{type(e).__name__}: {e}"


def compile_all(configs: list[Config], jobs: int | None = None):
    """[(config, result or None, error or None)], compiled on ``jobs`` processes."""
    jobs = jobs or os.cpu_count() or 1
    work = list(configs)
    if jobs == 1:
        return [_compile_entry(w) for w in work]
    # heaviest first: the larger tiles take longest, and a late one would idle a worker
    order = sorted(range(len(work)), key=lambda i: -int(dict(work[i].constexprs).get(
        "BN", dict(work[i].constexprs).get("NP", 16))))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(_compile_entry, [work[i] for i in order], chunksize=1))
    back = [None] * len(work)
    for slot, entry in zip(order, done, strict=True):
        back[slot] = entry
    return back


# -- reporting -------------------------------------------------------------------------

def versions() -> dict:
    import triton

    return dict(triton=triton.__version__, ptxas=_ptxas()[1],
                date=datetime.date.today().isoformat())


def to_json(entries) -> list[dict]:
    rows = []
    for config, result, error in entries:
        row = dataclasses.asdict(config)
        row["ident"] = config.ident
        row["options"] = dict(config.options)
        row["constexprs"] = dict(config.constexprs)
        row["args"] = dict(config.args)
        row["tile"] = config.tile
        row.update(result or {})
        if result:  # over 48 KiB a launch must opt in to more shared memory (Triton does)
            row["shared_opt_in"] = result["shared"] > STATIC_SHARED
        row["error"] = error
        row["problems"] = problems(config, result) if result else [error]
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per kernel, size range, tile, precision and target: the worst of its
    flag variants and specializations (most registers, spill bytes, shared memory)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        precision = row["constexprs"].get("PRECISION", "")
        groups.setdefault((row["kernel"], row["sizes"], row["tile"], precision, row["target"]),
                          []).append(row)
    order = ["scan_fwd", "scan_bwd", "householder_fwd", "householder_bwd", "givens_fwd",
             "givens_bwd"]

    def sort_key(item):
        kernel, sizes, _, precision, target = item[0]
        return (order.index(kernel), int(sizes.split(" ")[1].split("-")[0]), precision, target)

    lines = ["| kernel | sizes | tile | precision | target | variants | registers | "
             "spill bytes | stack bytes | shared memory |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (kernel, sizes, tile, precision, target), group in sorted(groups.items(), key=sort_key):
        ok = [r for r in group if r["error"] is None]
        if len(ok) < len(group):
            lines.append(f"| {kernel} | {sizes} | {tile} | {precision or '-'} | {target} | "
                         f"{len(group)} | compile error | | | |")
            continue
        regs = [r["registers"] for r in ok]
        spill = max(r["spill_stores"] + r["spill_loads"] for r in ok)
        stack = max(r["stack"] for r in ok)
        shared = max(r["shared"] for r in ok)
        reg_text = f"{min(regs)}-{max(regs)}" if min(regs) != max(regs) else f"{max(regs)}"
        lines.append(f"| {kernel} | {sizes} | {tile} | {precision or '-'} | {target} | "
                     f"{len(group)} | {reg_text} | {spill} | {stack} | "
                     f"{shared / 1024:.1f} KiB |")
    return "\n".join(lines)


def run_subprocess(out: str, full: bool = False, jobs: int | None = None,
                   timeout: float = 900, targets=tuple(TARGETS)) -> dict:
    """Run this script in a fresh interpreter without TRITON_INTERPRET (the test
    session has it set) and return its JSON: {"versions": ..., "rows": [...]}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, os.path.abspath(__file__), "--json", out]
    if full:
        command.append("--full")
    command += ["--target", ",".join(targets)]
    if jobs:
        command += ["--jobs", str(jobs)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode not in (0, 1):  # 1: some configuration failed the check
        raise RuntimeError(f"compile check crashed ({done.returncode}):\n"
                           f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true",
                        help="every flag combination of the scan kernels (slow)")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (all CPUs)")
    parser.add_argument("--json", help="write every configuration's numbers here")
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    parser.add_argument("--only", help="kernels to check, comma-separated (e.g. scan_fwd)")
    parser.add_argument("--target", default=",".join(TARGETS),
                        help=f"cards to compile for, comma-separated (default: all of "
                             f"{', '.join(TARGETS)})")
    args = parser.parse_args(argv)
    targets = args.target.split(",")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"--target {','.join(unknown)}: not one of {', '.join(TARGETS)}")
    configs = configurations(args.full, tuple(targets))
    if args.only:
        configs = [c for c in configs if c.kernel in args.only.split(",")]
    entries = compile_all(configs, args.jobs)
    rows = to_json(entries)
    info = versions()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(versions=info, rows=rows), f, indent=1)
    bad = [r for r in rows if r["problems"]]
    if args.markdown:
        print(f"Compiled {info['date']} with triton {info['triton']} and ptxas "
              f"({info['ptxas']}); {len(rows)} compilations.\n")
        print(markdown(rows))
    else:
        print(f"{len(rows)} compilations, {len(bad)} with problems "
              f"(triton {info['triton']}, {info['ptxas']})")
    for r in bad:
        print(f"  {r['kernel']} {r['sizes']} {r['variant']} {r['align']} {r['target']} "
              f"{r['tile']}: {'; '.join(r['problems'])}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
