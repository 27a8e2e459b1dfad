"""Triton kernels of the fused recurrence (imported only when a kernel is about to run).

Forward: persistent programs loop over all T steps, C per block of BB sequences (a
group). Step t computes Z_t = U_t + H_{t-1} W^T with ``tl.dot`` and writes h_t into the
carried-state buffer [B, T + 1, n], which doubles as the saved residual and as the
exchange of h between the column tiles of a group. With C = 1 (the default) one program
walks every column tile of a step; with C > 1 (``GRID_SYNC``) program (g, c) takes the
tiles c, c + C, ... and the group's C programs meet at a grid-wide barrier per step: a
counter per group in global memory, a release add on arrival, an acquire spin before
reading what the others wrote (docs/gpu.md, "The split scan"). The launcher keeps the
grid within the SMs (every program resident, so a spin always ends) and, under the
interpreter, which runs programs one after another, launches a split scan once per
phase instead. When n fits one small
tile (``RESIDENT_MAX``) W^T is loaded once before the time loop and stays on chip;
larger n reads W^T every step in [BK, BN] blocks (from L1 while it fits there, 64 KiB
at n = 128, else from L2), so the registers a program needs do not grow with n.

Why the blocks are small (``docs/gpu.md`` has the compiled numbers): in full fp32
(``input_precision="ieee"``, PyTorch's default) ``tl.dot`` runs on FMA units and every
thread holds its rows and columns of both operands over the whole K extent of the
dot: with K = 128 (W^T resident at n = 128, as first written) that is hundreds of
values per thread, and the kernels spilled kilobytes. K blocks of 16 keep the operands
small in either precision, and 64-column tiles on 8 warps keep the rest of a tile to 4
elements per thread. The programs are few (one per 16 sequences), so blocks per SM do
not matter: the launch lets ptxas use every register a thread may have (``maxnreg``,
``dispatch.launch_options``); without it ptxas at times spills a few bytes instead.

Backward: the same program layout runs the reverse scan
    g_t <- g_t + dL/dstates_t;  dz_t = g'(z_t) (a) g_t;  g_{t-1} = dz_t W (+ b2 g_t)
(with padded steps passing g through unchanged) and writes dz [B, T, n]; dW, da, db2
and the modReLU bias gradient are then ordinary PyTorch products
(``reference.scan_parameter_grads``), dW as one [n, B T] x [B T, n] matmul.

The activation formulas are those of ``models.activations``, re-expressed in Triton,
one helper per kind in ``triton_activations``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activations import KINDS, check_kind
from .dispatch import check_launch, interpreter_requested, launch_options
from .triton_activations import _activation, _activation_grad, _bias_tile

#: Largest padded hidden size whose W^T is loaded once and stays on chip for the whole
#: scan, as one dot operand (a single K block of RESIDENT_MAX); at 64 that fp32 FMA dot
#: already spills on sm_80 and sm_90a. Above it W^T is streamed in [BK_TILE, BN] blocks
#: every step, in column tiles of BN = min(TILE, padded n).
RESIDENT_MAX = 32
TILE = 64
BK_TILE = 16
#: Elements of a [BLOCK_B, BN] tile per thread: warps = BLOCK_B BN / (32 TILE_PER_THREAD),
#: at least 4 (half as many elements with W^T resident: its K is the whole n). With 8
#: (BN = 128 on 8 warps), kernels whose loads cannot vectorize (n not a multiple of 16)
#: reach 255 registers and spill; 4 leaves a margin (at most ~215 registers).
TILE_PER_THREAD = 4
#: Sequences per program: tl.dot needs at least 16 rows.
BLOCK_B = 16

@triton.jit
def _load_exchanged(ptr, mask, GRID_SYNC: tl.constexpr):
    """A tile another program of the group wrote this step: from L2 (``.cg``), past an
    SM's L1, which is not coherent across SMs."""
    if GRID_SYNC:
        out = tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        out = tl.load(ptr, mask=mask, other=0.0)
    return out


@triton.jit
def _arrive(counter_ptr, GRID_SYNC: tl.constexpr):
    """End of a phase: every thread's stores issued (CTA scope); with GRID_SYNC one
    release add to the group's counter publishes them to the other column programs."""
    tl.debug_barrier()
    if GRID_SYNC:
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(counter_ptr, target, GRID_SYNC: tl.constexpr):
    """Spin until the group's counter reaches ``target`` arrivals (acquire): the grid-wide
    barrier of a cooperative scan. Every program of the grid is resident (the launcher
    caps the grid at the SM count), so the programs it waits for are running."""
    if GRID_SYNC:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _resident_matrix(m_ptr, k_lane, lane, N, RESIDENT: tl.constexpr):
    """M [N, N], row-major, loaded once for all T steps when it fits one tile (RESIDENT:
    BK = BN >= N, C = 1); otherwise a placeholder that ``_times_matrix`` never reads."""
    if RESIDENT:
        m = tl.load(m_ptr + k_lane[:, None] * N + lane[None, :],
                    mask=(k_lane[:, None] < N) & (lane[None, :] < N), other=0.0)
    else:
        m = 0.0
    return m


@triton.jit
def _times_matrix(acc, x_row, m_ptr, m_res, row_ok, cols, col_ok, k_lane, N,
                  BK: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr,
                  GRID_SYNC: tl.constexpr):
    """acc + X[rows, :N] M[:N, cols] for X at ``x_row`` (one row a sequence) and M
    row-major at ``m_ptr``: M is ``m_res`` (on chip, one K block) if RESIDENT, else
    streamed in [BK, BN] blocks (from L1 / L2), which keeps the registers bounded."""
    if RESIDENT:
        x = tl.load(x_row + k_lane[None, :], mask=row_ok[:, None] & (k_lane[None, :] < N),
                    other=0.0)
        acc = tl.dot(x, m_res, acc, input_precision=PRECISION)
    else:
        for k0 in range(0, N, BK):
            ks = k0 + k_lane
            k_ok = ks < N
            x = _load_exchanged(x_row + ks[None, :], row_ok[:, None] & k_ok[None, :], GRID_SYNC)
            m = tl.load(m_ptr + ks[:, None] * N + cols[None, :],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(x, m, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _scan_fwd_kernel(u_ptr, wt_ptr, len_ptr, a_ptr, b2_ptr, bias_ptr,
                     states_ptr, pre_ptr, carried_ptr, counter_ptr, B, T, N, C, P0, P1, slope,
                     KIND: tl.constexpr, GATED: tl.constexpr, HAS_LEN: tl.constexpr,
                     STORE_PRE: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr,
                     GRID_SYNC: tl.constexpr):
    # wt_ptr: W^T [N, N], row-major (the launcher transposes W once). Program (g, c) runs
    # the sequences of group g and the column tiles c, c + C, ... of every step t in
    # [P0, P1); with C > 1 (GRID_SYNC) the C programs of a group meet at a barrier per step.
    group = tl.program_id(0)
    rows = (group * BB + tl.arange(0, BB)).to(tl.int64)
    row_ok = rows < B
    seq_rows = rows * T * N  # [BB] offsets of each sequence in u, states, pre
    carried_rows = rows * (T + 1) * N
    counter = counter_ptr + group
    first_col = tl.program_id(1) * BN
    lane = tl.arange(0, BN)
    k_lane = tl.arange(0, BK)
    if HAS_LEN:
        length = tl.load(len_ptr + rows, mask=row_ok, other=0)
    if GATED:
        a = tl.load(a_ptr)
        b2 = tl.load(b2_ptr)
    w_res = _resident_matrix(wt_ptr, k_lane, lane, N, RESIDENT)  # W^T
    for t in range(P0, P1):
        _wait(counter, t * C, GRID_SYNC)  # every column of h_{t-1} written
        prev_row = carried_ptr + (carried_rows + t * N)[:, None]  # h_{t-1}
        seq_row = (seq_rows + t * N)[:, None]
        for j0 in range(first_col, N, C * BN):
            cols = j0 + lane
            col_ok = cols < N
            tile = row_ok[:, None] & col_ok[None, :]
            seq = seq_row + cols[None, :]
            z = tl.load(u_ptr + seq, mask=tile, other=0.0)
            z = _times_matrix(z, prev_row, wt_ptr, w_res, row_ok, cols, col_ok, k_lane, N,
                              BK, RESIDENT, PRECISION, GRID_SYNC)  # Z_t = U_t + H_{t-1} W^T
            if STORE_PRE:
                tl.store(pre_ptr + seq, z, mask=tile)
            new = _activation(z, _bias_tile(bias_ptr, cols, col_ok, KIND, BN), slope, KIND)
            h_prev = tl.load(prev_row + cols[None, :], mask=tile, other=0.0)
            if GATED:  # FastRNN / SGORNN eq. 1
                new = a * new + b2 * h_prev
            out = new
            if HAS_LEN:  # padded steps carry h_{t-1} and output zeros
                live = (t < length)[:, None]
                new = tl.where(live, new, h_prev)
                out = tl.where(live, new, 0.0)
            tl.store(prev_row + N + cols[None, :], new, mask=tile)
            tl.store(states_ptr + seq, out, mask=tile)
        _arrive(counter, GRID_SYNC)  # h_t complete before any tile of step t + 1 reads it


@triton.jit
def _scan_bwd_kernel(d_states_ptr, w_ptr, pre_ptr, len_ptr, a_ptr, b2_ptr, bias_ptr,
                     d_pre_ptr, d_out_ptr, g_ptr, counter_ptr, B, T, N, C, P0, P1, slope,
                     KIND: tl.constexpr, GATED: tl.constexpr, HAS_LEN: tl.constexpr,
                     HAS_D_STATES: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr,
                     GRID_SYNC: tl.constexpr):
    # g_ptr [B, N] holds dL/dh_t between steps: dL/dlast on entry, dL/dh0 on exit.
    # Phase 2s is pass 1 of step t = T - 1 - s, phase 2s + 1 its pass 2; program (g, c)
    # runs phases [P0, P1) on its column tiles, and pass 2 (which reads every column of
    # dz_t) waits for the C programs of its group to finish pass 1.
    group = tl.program_id(0)
    rows = (group * BB + tl.arange(0, BB)).to(tl.int64)
    row_ok = rows < B
    seq_rows = rows * T * N
    g_row = g_ptr + (rows * N)[:, None]
    counter = counter_ptr + group
    first_col = tl.program_id(1) * BN
    lane = tl.arange(0, BN)
    k_lane = tl.arange(0, BK)
    if HAS_LEN:
        length = tl.load(len_ptr + rows, mask=row_ok, other=0)
    if GATED:
        a = tl.load(a_ptr)
        b2 = tl.load(b2_ptr)
    w_res = _resident_matrix(w_ptr, k_lane, lane, N, RESIDENT)  # W[k, j]
    for p in range(P0, P1):
        s = p // 2
        t = T - 1 - s
        seq_row = (seq_rows + t * N)[:, None]
        if p % 2 == 0:
            # pass 1, per column tile: dz_t and the part of g_{t-1} that bypasses W
            for j0 in range(first_col, N, C * BN):
                cols = j0 + lane
                col_ok = cols < N
                tile = row_ok[:, None] & col_ok[None, :]
                seq = seq_row + cols[None, :]
                g = tl.load(g_row + cols[None, :], mask=tile, other=0.0)
                if HAS_LEN:
                    live = (t < length)[:, None]
                if HAS_D_STATES:
                    d_s = tl.load(d_states_ptr + seq, mask=tile, other=0.0)
                    if HAS_LEN:
                        d_s = tl.where(live, d_s, 0.0)
                    g = g + d_s
                g_new = g
                if HAS_LEN:
                    g_new = tl.where(live, g, 0.0)
                z = tl.load(pre_ptr + seq, mask=tile, other=0.0)
                bias = _bias_tile(bias_ptr, cols, col_ok, KIND, BN)
                dz = g_new * _activation_grad(z, bias, slope, KIND)
                carry = tl.zeros([BB, BN], dtype=tl.float32)
                if GATED:
                    dz = dz * a
                    tl.store(d_out_ptr + seq, g_new, mask=tile)
                    carry = g_new * b2
                if HAS_LEN:
                    carry = carry + tl.where(live, 0.0, g)  # padded steps pass g through
                tl.store(d_pre_ptr + seq, dz, mask=tile)
                tl.store(g_row + cols[None, :], carry, mask=tile)
            _arrive(counter, GRID_SYNC)  # all of dz_t written before pass 2 reads it
        else:
            _wait(counter, (s + 1) * C, GRID_SYNC)
            # pass 2: g_{t-1} = carry + dz_t W
            dz_row = d_pre_ptr + seq_row
            for j0 in range(first_col, N, C * BN):
                cols = j0 + lane
                col_ok = cols < N
                tile = row_ok[:, None] & col_ok[None, :]
                g = tl.load(g_row + cols[None, :], mask=tile, other=0.0)
                g = _times_matrix(g, dz_row, w_ptr, w_res, row_ok, cols, col_ok, k_lane, N,
                                  BK, RESIDENT, PRECISION, GRID_SYNC)
                tl.store(g_row + cols[None, :], g, mask=tile)
            tl.debug_barrier()  # g of this program's columns whole before pass 1 reads it


KERNELS = {"scan_fwd": _scan_fwd_kernel, "scan_bwd": _scan_bwd_kernel}


def _config(n: int, columns: int = 1) -> tuple[int, bool, int, int, int]:
    """(column tile BN, W resident on chip, warps, K block BK, column programs) for hidden
    size n split over ``columns`` programs per group of sequences: the smallest tile (a
    power of two, 16 at least, tl.dot's smallest, TILE at most) that ``columns`` programs
    cover n with, and never more programs than tiles. Idempotent: the programs it returns,
    asked for again, give the same tile."""
    padded = max(16, triton.next_power_of_2(n))
    if padded <= RESIDENT_MAX:  # K = padded in one dot: half the tile elements per thread
        return padded, True, max(4, BLOCK_B * padded // (16 * TILE_PER_THREAD)), padded, 1
    block = max(16, min(TILE, triton.next_power_of_2(triton.cdiv(n, columns))))
    columns = max(1, min(columns, triton.cdiv(n, block)))
    return (block, False, max(4, BLOCK_B * block // (32 * TILE_PER_THREAD)), BK_TILE,
            columns)


def _precision() -> str:
    # fp32 tl.dot uses TF32 tensor cores only when PyTorch's matmuls may (the same switch).
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def launch_meta(n: int, kind: str, gated: bool, has_len: bool, precision: str,
                columns: int = 1):
    """(launch options, constexprs, column programs) of both scan kernels for hidden size
    n and ``columns`` programs per group requested: what the launchers below pass, and
    what ``scripts/compile_check.py`` compiles."""
    block, resident, warps, k_block, columns = _config(n, columns)
    options = launch_options(warps)
    if columns > 1:  # a grid larger than can be resident: a CUDA error, not a spin forever
        options["launch_cooperative_grid"] = True
    return options, dict(
        KIND=KINDS.index(check_kind(kind)), GATED=gated, HAS_LEN=has_len, BB=BLOCK_B, BN=block,
        BK=k_block, RESIDENT=resident, PRECISION=precision, GRID_SYNC=columns > 1), columns


def resident_programs(device: torch.device) -> int | None:
    """How many programs of the scan are certain to run at once: one per SM on a GPU (a
    program's registers fill most of an SM). None under the interpreter, which runs the
    programs one after another."""
    if device.type != "cuda" or interpreter_requested():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def column_programs(n: int, batch: int, requested: int, device: torch.device) -> int:
    """The column programs per group a launch uses: ``requested`` (``scan.columns_for``),
    at most the tiles of n, and on a GPU at most what keeps the whole grid resident (a
    spinning program must never wait for one that cannot start)."""
    groups = triton.cdiv(batch, BLOCK_B)
    resident = resident_programs(device)
    if resident is not None:
        requested = min(requested, resident // groups)
    return _config(n, max(1, requested))[4]


def _phases(kernel, grid, args, phases: int, columns: int, device, meta) -> None:
    """Run ``phases`` phases: one launch on a GPU (the programs meet at their barriers);
    under the interpreter with several column programs, one launch per phase (it runs a
    grid's programs in turn, so a barrier inside a launch would wait forever)."""
    if columns == 1 or resident_programs(device) is not None:
        kernel[grid](*args, 0, phases, **meta)
        return
    for p in range(phases):
        kernel[grid](*args, p, p + 1, **meta)


def _common(u, weight, lengths, a, b2, bias, kind, columns=1):
    columns = column_programs(u.shape[-1], u.shape[0], columns, u.device)
    options, meta, columns = launch_meta(u.shape[-1], kind, a is not None, lengths is not None,
                                         _precision(), columns)
    dummy = u  # never read: the matching constexpr switch is off
    groups = triton.cdiv(u.shape[0], BLOCK_B)
    return dict(args=(lengths if lengths is not None else dummy,
                      a if a is not None else dummy, b2 if b2 is not None else dummy,
                      bias.contiguous() if bias is not None else dummy),
                meta=dict(meta, **options), columns=columns, grid=(groups, columns),
                counter=torch.zeros(groups, dtype=torch.int32, device=u.device))


def scan_forward(u, weight, h0, lengths, a, b2, bias, kind: str, slope: float,
                 keep: bool = True, columns: int = 1):
    """(states, last, pre, carried) as ``reference.scan_forward``; pre is empty unless
    ``keep`` (nothing to save without a backward). ``columns``: programs per group of
    sequences (``column_programs``)."""
    check_launch(_scan_fwd_kernel, u)
    u, weight = u.contiguous(), weight.contiguous()
    batch, steps, n = u.shape
    states = torch.empty_like(u)
    pre = torch.empty_like(u) if keep else u.new_empty(0)
    carried = u.new_empty(batch, steps + 1, n)
    carried[:, 0] = h0
    c = _common(u, weight, lengths, a, b2, bias, kind, columns)
    lens, a_, b2_, bias_ = c["args"]
    args = (u, weight.t().contiguous(), lens, a_, b2_, bias_, states, pre, carried, c["counter"],
            batch, steps, n, c["columns"])
    _phases(_scan_fwd_kernel, c["grid"], args, steps, c["columns"], u.device,
            dict(c["meta"], slope=float(slope), STORE_PRE=keep))
    return states, carried[:, steps].clone(), pre, carried


def scan_backward(d_states, d_last, weight, pre, lengths, a, b2, bias, kind: str, slope: float,
                  columns: int = 1):
    """(dL/dZ, dL/d(cell output) or None, dL/dh0) as ``reference.scan_backward``."""
    check_launch(_scan_bwd_kernel, pre)
    weight, pre = weight.contiguous(), pre.contiguous()
    batch, steps, n = pre.shape
    g = pre.new_zeros(batch, n) if d_last is None else d_last.contiguous().clone()
    d_pre = torch.empty_like(pre)
    d_out = torch.empty_like(pre) if a is not None else None
    c = _common(pre, weight, lengths, a, b2, bias, kind, columns)
    lens, a_, b2_, bias_ = c["args"]
    args = (d_states.contiguous() if d_states is not None else pre, weight, pre, lens, a_, b2_,
            bias_, d_pre, d_out if d_out is not None else pre, g, c["counter"], batch, steps, n,
            c["columns"])
    _phases(_scan_bwd_kernel, c["grid"], args, 2 * steps, c["columns"], pre.device,
            dict(c["meta"], slope=float(slope), HAS_D_STATES=d_states is not None))
    return d_pre, d_out, g
