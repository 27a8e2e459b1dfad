"""Triton kernels of the fused recurrence (imported only when a kernel is about to run).

Forward: one persistent program per block of BB sequences loops over all T steps.
Step t computes Z_t = U_t + H_{t-1} W^T with ``tl.dot`` and writes h_t into the
carried-state buffer [B, T + 1, n], which doubles as the saved residual and as the
on-chip exchange of h between the column tiles of one program. When n fits one small
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
one helper per kind below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activations import KINDS, check_kind
from .dispatch import check_launch, launch_options

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

TANH, RELU, LEAKY_RELU, MODRELU, ABS = (KINDS.index(k) for k in
                                         ("tanh", "relu", "leaky_relu", "modrelu", "abs"))


# -- activations: one helper per kind (forward, derivative), as models.activations --
@triton.jit
def _sign(z):
    return tl.where(z > 0, 1.0, 0.0) - tl.where(z < 0, 1.0, 0.0)


@triton.jit
def _tanh(z):  # via exp(-2|z|): no overflow, no cancellation near 0
    e = tl.exp(-2.0 * tl.abs(z))
    return _sign(z) * (1.0 - e) / (1.0 + e)


@triton.jit
def _tanh_grad(z):
    t = _tanh(z)
    return 1.0 - t * t


@triton.jit
def _relu(z):
    return tl.maximum(z, 0.0)


@triton.jit
def _relu_grad(z):
    return tl.where(z > 0, 1.0, 0.0)


@triton.jit
def _leaky_relu(z, slope):
    return tl.where(z > 0, z, z * slope)


@triton.jit
def _leaky_relu_grad(z, slope):
    return tl.where(z > 0, 1.0, 0.0) * (1.0 - slope) + slope


@triton.jit
def _modrelu(z, bias):  # scoRNN eq. 3: sign(z) relu(|z| + b)
    return _sign(z) * tl.maximum(tl.abs(z) + bias, 0.0)


@triton.jit
def _modrelu_grad(z, bias):
    return tl.where(((tl.abs(z) + bias) > 0) & (z != 0), 1.0, 0.0)


@triton.jit
def _abs(z):
    return tl.abs(z)


@triton.jit
def _abs_grad(z):
    return _sign(z)


@triton.jit
def _activation(z, bias, slope, KIND: tl.constexpr):
    if KIND == 0:
        out = _tanh(z)
    elif KIND == 1:
        out = _relu(z)
    elif KIND == 2:
        out = _leaky_relu(z, slope)
    elif KIND == 3:
        out = _modrelu(z, bias)
    else:  # KIND == 4 (the launcher passes KINDS.index of a checked kind)
        out = _abs(z)
    return out


@triton.jit
def _activation_grad(z, bias, slope, KIND: tl.constexpr):
    if KIND == 0:
        out = _tanh_grad(z)
    elif KIND == 1:
        out = _relu_grad(z)
    elif KIND == 2:
        out = _leaky_relu_grad(z, slope)
    elif KIND == 3:
        out = _modrelu_grad(z, bias)
    else:  # KIND == 4
        out = _abs_grad(z)
    return out


@triton.jit
def _bias_tile(bias_ptr, cols, col_ok, KIND: tl.constexpr, BN: tl.constexpr):
    if KIND == 3:
        b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    else:
        b = tl.zeros([BN], dtype=tl.float32)
    return b[None, :]


@triton.jit
def _scan_fwd_kernel(u_ptr, wt_ptr, len_ptr, a_ptr, b2_ptr, bias_ptr,
                     states_ptr, pre_ptr, carried_ptr, B, T, N, slope,
                     KIND: tl.constexpr, GATED: tl.constexpr, HAS_LEN: tl.constexpr,
                     STORE_PRE: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr):
    # wt_ptr: W^T [N, N], row-major (the launcher transposes W once).
    rows = (tl.program_id(0) * BB + tl.arange(0, BB)).to(tl.int64)
    row_ok = rows < B
    seq_rows = rows * T * N  # [BB] offsets of each sequence in u, states, pre
    carried_rows = rows * (T + 1) * N
    lane = tl.arange(0, BN)
    k_lane = tl.arange(0, BK)
    if HAS_LEN:
        length = tl.load(len_ptr + rows, mask=row_ok, other=0)
    if GATED:
        a = tl.load(a_ptr)
        b2 = tl.load(b2_ptr)
    if RESIDENT:  # one tile (BK = BN >= N): W^T loaded once for all T steps
        w_res = tl.load(wt_ptr + k_lane[:, None] * N + lane[None, :],
                        mask=(k_lane[:, None] < N) & (lane[None, :] < N), other=0.0)
    for t in range(T):
        prev_row = carried_ptr + (carried_rows + t * N)[:, None]  # h_{t-1}
        seq_row = (seq_rows + t * N)[:, None]
        for j0 in range(0, N, BN):
            cols = j0 + lane
            col_ok = cols < N
            tile = row_ok[:, None] & col_ok[None, :]
            seq = seq_row + cols[None, :]
            z = tl.load(u_ptr + seq, mask=tile, other=0.0)
            if RESIDENT:
                h = tl.load(prev_row + k_lane[None, :],
                            mask=row_ok[:, None] & (k_lane[None, :] < N), other=0.0)
                z = tl.dot(h, w_res, z, input_precision=PRECISION)
            else:  # W^T streamed in [BK, BN] blocks (from L1 / L2): bounded registers
                for k0 in range(0, N, BK):
                    ks = k0 + k_lane
                    k_ok = ks < N
                    h = tl.load(prev_row + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                                other=0.0)
                    w = tl.load(wt_ptr + ks[:, None] * N + cols[None, :],
                                mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    z = tl.dot(h, w, z, input_precision=PRECISION)
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
        tl.debug_barrier()  # h_t complete before any tile of step t + 1 reads it


@triton.jit
def _scan_bwd_kernel(d_states_ptr, w_ptr, pre_ptr, len_ptr, a_ptr, b2_ptr, bias_ptr,
                     d_pre_ptr, d_out_ptr, g_ptr, B, T, N, slope,
                     KIND: tl.constexpr, GATED: tl.constexpr, HAS_LEN: tl.constexpr,
                     HAS_D_STATES: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr):
    # g_ptr [B, N] holds dL/dh_t between steps: dL/dlast on entry, dL/dh0 on exit.
    rows = (tl.program_id(0) * BB + tl.arange(0, BB)).to(tl.int64)
    row_ok = rows < B
    seq_rows = rows * T * N
    g_row = g_ptr + (rows * N)[:, None]
    lane = tl.arange(0, BN)
    k_lane = tl.arange(0, BK)
    if HAS_LEN:
        length = tl.load(len_ptr + rows, mask=row_ok, other=0)
    if GATED:
        a = tl.load(a_ptr)
        b2 = tl.load(b2_ptr)
    if RESIDENT:  # W[k, j], loaded once (BK = BN >= N)
        w_res = tl.load(w_ptr + k_lane[:, None] * N + lane[None, :],
                        mask=(k_lane[:, None] < N) & (lane[None, :] < N), other=0.0)
    for s in range(T):
        t = T - 1 - s
        seq_row = (seq_rows + t * N)[:, None]
        # pass 1, per column tile: dz_t and the part of g_{t-1} that bypasses W
        for j0 in range(0, N, BN):
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
        tl.debug_barrier()  # all of dz_t written before pass 2 reads it
        # pass 2: g_{t-1} = carry + dz_t W
        dz_row = d_pre_ptr + seq_row
        for j0 in range(0, N, BN):
            cols = j0 + lane
            col_ok = cols < N
            tile = row_ok[:, None] & col_ok[None, :]
            g = tl.load(g_row + cols[None, :], mask=tile, other=0.0)
            if RESIDENT:
                dz = tl.load(dz_row + k_lane[None, :],
                             mask=row_ok[:, None] & (k_lane[None, :] < N), other=0.0)
                g = tl.dot(dz, w_res, g, input_precision=PRECISION)
            else:  # W streamed in [BK, BN] blocks
                for k0 in range(0, N, BK):
                    ks = k0 + k_lane
                    k_ok = ks < N
                    dz = tl.load(dz_row + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                                 other=0.0)
                    w = tl.load(w_ptr + ks[:, None] * N + cols[None, :],
                                mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    g = tl.dot(dz, w, g, input_precision=PRECISION)
            tl.store(g_row + cols[None, :], g, mask=tile)
        tl.debug_barrier()


KERNELS = {"scan_fwd": _scan_fwd_kernel, "scan_bwd": _scan_bwd_kernel}


def _config(n: int) -> tuple[int, bool, int, int]:
    """(column tile BN, W resident on chip, warps, K block BK) for hidden size n."""
    padded = max(16, triton.next_power_of_2(n))
    if padded <= RESIDENT_MAX:  # K = padded in one dot: half the tile elements per thread
        return padded, True, max(4, BLOCK_B * padded // (16 * TILE_PER_THREAD)), padded
    block = min(TILE, padded)
    return block, False, max(4, BLOCK_B * block // (32 * TILE_PER_THREAD)), BK_TILE


def _precision() -> str:
    # fp32 tl.dot uses TF32 tensor cores only when PyTorch's matmuls may (the same switch).
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def launch_meta(n: int, kind: str, gated: bool, has_len: bool, precision: str):
    """(launch options, constexprs) of both scan kernels for hidden size n: what the
    launchers below pass, and what ``scripts/compile_check.py`` compiles."""
    block, resident, warps, k_block = _config(n)
    return launch_options(warps), dict(
        KIND=KINDS.index(check_kind(kind)), GATED=gated, HAS_LEN=has_len, BB=BLOCK_B, BN=block,
        BK=k_block, RESIDENT=resident, PRECISION=precision)


def _common(u, weight, lengths, a, b2, bias, kind):
    options, meta = launch_meta(u.shape[-1], kind, a is not None, lengths is not None,
                                _precision())
    dummy = u  # never read: the matching constexpr switch is off
    return dict(args=(lengths if lengths is not None else dummy,
                      a if a is not None else dummy, b2 if b2 is not None else dummy,
                      bias.contiguous() if bias is not None else dummy),
                meta=dict(meta, **options))


def scan_forward(u, weight, h0, lengths, a, b2, bias, kind: str, slope: float,
                 keep: bool = True):
    """(states, last, pre, carried) as ``reference.scan_forward``; pre is empty unless
    ``keep`` (nothing to save without a backward)."""
    check_launch(_scan_fwd_kernel, u)
    u, weight = u.contiguous(), weight.contiguous()
    batch, steps, n = u.shape
    states = torch.empty_like(u)
    pre = torch.empty_like(u) if keep else u.new_empty(0)
    carried = u.new_empty(batch, steps + 1, n)
    carried[:, 0] = h0
    c = _common(u, weight, lengths, a, b2, bias, kind)
    lens, a_, b2_, bias_ = c["args"]
    _scan_fwd_kernel[(triton.cdiv(batch, BLOCK_B),)](
        u, weight.t().contiguous(), lens, a_, b2_, bias_, states, pre, carried, batch, steps, n,
        float(slope),
        STORE_PRE=keep, **c["meta"])
    return states, carried[:, steps].clone(), pre, carried


def scan_backward(d_states, d_last, weight, pre, lengths, a, b2, bias, kind: str, slope: float):
    """(dL/dZ, dL/d(cell output) or None, dL/dh0) as ``reference.scan_backward``."""
    check_launch(_scan_bwd_kernel, pre)
    weight, pre = weight.contiguous(), pre.contiguous()
    batch, steps, n = pre.shape
    g = pre.new_zeros(batch, n) if d_last is None else d_last.contiguous().clone()
    d_pre = torch.empty_like(pre)
    d_out = torch.empty_like(pre) if a is not None else None
    c = _common(pre, weight, lengths, a, b2, bias, kind)
    lens, a_, b2_, bias_ = c["args"]
    _scan_bwd_kernel[(triton.cdiv(batch, BLOCK_B),)](
        d_states.contiguous() if d_states is not None else pre, weight, pre, lens, a_, b2_,
        bias_, d_pre, d_out if d_out is not None else pre, g, batch, steps, n, float(slope),
        HAS_D_STATES=d_states is not None, **c["meta"])
    return d_pre, d_out, g
