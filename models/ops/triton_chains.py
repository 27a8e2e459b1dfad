"""Triton kernels of the factored transitions (imported only when a kernel runs).

Householder chain (Spectral-RNN eq. 8): a program owns BB row vectors [BB, n] on chip
and applies the m reflectors in turn, x <- x - (2 / u.u) (x.u) u. The backward walks
the chain in reverse, recovering each reflector's input from its output (H(u) is an
involution) and writing per-program partial sums of dL/du, summed afterwards.

Packed Givens chain (DizzyRNN 4.1, VPRNN): a program owns BC columns of x [n, N] and
applies the k rotations x <- cos x + sin x[partner] (after x <- x[perm] when
permutations are given) with ``tl.gather`` across rows (through a scratch buffer in
memory above ``GATHER_MAX`` rows). The backward mirrors
``models.ops.rotations.chain_backward``, with per-program partial row sums for dL/dcos
and dL/dsin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import check_launch, launch_options

BLOCK_ROWS = 16  # vectors per program (Householder), at most
BLOCK_COLS = 16  # columns per program (Givens), at most
#: Elements of the [rows, padded n] (Householder) or [padded n, columns] (Givens) tile
#: per thread. A program keeps one such tile in registers for the whole chain (two or
#: three in the backward, with the gathered rows), so warps grow with n up to MAX_WARPS
#: and then the rows (columns) per program shrink to hold this bound at every size the
#: dispatch takes. 32 per thread on 16 warps (the 128-register cap of 512 threads)
#: spilled ~600 bytes at n = 512 in the Givens backward.
TILE_PER_THREAD = 16
MAX_WARPS = 8
#: Most (padded) rows the Givens kernels permute in registers with ``tl.gather``. Triton
#: lowers it with the whole gathered axis inside one warp (32 rows per thread at 1024
#: rows) and picks the source register per element at run time, which spills kilobytes
#: at 1024 rows whatever the tile; above GATHER_MAX the rows go through memory instead
#: (a store to this program's columns of a scratch buffer, a barrier, a row-indexed load).
GATHER_MAX = 512


def _tile(padded: int, most: int) -> tuple[int, int]:
    """(warps, rows or columns per program) for a tile of up to ``most`` x ``padded``."""
    warps = min(MAX_WARPS, max(4, most * padded // (32 * TILE_PER_THREAD)))
    return warps, max(1, min(most, 32 * warps * TILE_PER_THREAD // padded))


@triton.jit
def _reflector(y_ptr, idx, cols, col_ok, M):
    """Column idx of Y and its scale 2 / ||u||^2 (0 for a zero column: the identity)."""
    u = tl.load(y_ptr + cols * M + idx, mask=col_ok, other=0.0)
    norm = tl.sum(u * u, axis=0)
    scale = tl.where(norm > 0, 2.0 / tl.where(norm > 0, norm, 1.0), 0.0)
    return u, scale


@triton.jit
def _householder_fwd_kernel(x_ptr, y_ptr, out_ptr, B, N, M, TRANSPOSE: tl.constexpr,
                            BB: tl.constexpr, NP: tl.constexpr):
    rows = (tl.program_id(0) * BB + tl.arange(0, BB)).to(tl.int64)
    cols = tl.arange(0, NP)
    col_ok = cols < N
    tile = (rows < B)[:, None] & col_ok[None, :]
    at = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + at, mask=tile, other=0.0)
    for i in range(M):
        if TRANSPOSE:  # x U: the leftmost reflector first
            idx = i
        else:  # x U^T: the rightmost first
            idx = M - 1 - i
        u, scale = _reflector(y_ptr, idx, cols, col_ok, M)
        x = x - (scale * tl.sum(x * u[None, :], axis=1))[:, None] * u[None, :]
    tl.store(out_ptr + at, x, mask=tile)


@triton.jit
def _householder_bwd_kernel(g_ptr, out_ptr, y_ptr, dx_ptr, dy_part_ptr, B, N, M,
                            TRANSPOSE: tl.constexpr, BB: tl.constexpr, NP: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BB + tl.arange(0, BB)).to(tl.int64)
    cols = tl.arange(0, NP)
    col_ok = cols < N
    tile = (rows < B)[:, None] & col_ok[None, :]
    at = rows[:, None] * N + cols[None, :]
    g = tl.load(g_ptr + at, mask=tile, other=0.0)
    x = tl.load(out_ptr + at, mask=tile, other=0.0)
    for i in range(M):  # reverse application order
        if TRANSPOSE:
            idx = M - 1 - i
        else:
            idx = i
        u, scale = _reflector(y_ptr, idx, cols, col_ok, M)
        x = x - (scale * tl.sum(x * u[None, :], axis=1))[:, None] * u[None, :]  # the input
        c = tl.sum(x * u[None, :], axis=1)
        gu = tl.sum(g * u[None, :], axis=1)
        d_u = (-scale * tl.sum(c[:, None] * g + gu[:, None] * x, axis=0)
               + scale * scale * tl.sum(c * gu, axis=0) * u)
        tl.store(dy_part_ptr + pid * N * M + cols * M + idx, d_u, mask=col_ok)
        g = g - (scale * gu)[:, None] * u[None, :]
    tl.store(dx_ptr + at, g, mask=tile)


def householder_launch_meta(n: int, transpose: bool):
    """(launch options, constexprs) of both Householder kernels for size n: 16 rows per
    program on 4 to 8 warps up to n = 256, then fewer rows (1 at n = 4096)."""
    padded = max(16, triton.next_power_of_2(n))
    warps, rows = _tile(padded, BLOCK_ROWS)
    return launch_options(warps), dict(TRANSPOSE=transpose, BB=rows, NP=padded)


def householder_forward(x, y, transpose: bool):
    check_launch(_householder_fwd_kernel, x)
    x, y = x.contiguous(), y.contiguous()
    batch, n = x.shape
    out = torch.empty_like(x)
    options, meta = householder_launch_meta(n, transpose)
    _householder_fwd_kernel[(triton.cdiv(batch, meta["BB"]),)](
        x, y, out, batch, n, y.shape[1], **meta, **options)
    return out


def householder_backward(grad, out, y, transpose: bool):
    check_launch(_householder_bwd_kernel, grad)
    grad, out, y = grad.contiguous(), out.contiguous(), y.contiguous()
    batch, n = grad.shape
    options, meta = householder_launch_meta(n, transpose)
    programs = triton.cdiv(batch, meta["BB"])
    d_x = torch.empty_like(grad)
    d_y_parts = y.new_empty(programs, *y.shape)
    _householder_bwd_kernel[(programs,)](
        grad, out, y, d_x, d_y_parts, batch, n, y.shape[1], **meta, **options)
    return d_x, d_y_parts.sum(0)


@triton.jit
def _gather_rows(x, idx, NP: tl.constexpr, BC: tl.constexpr):
    """x[idx] for a [NP, BC] tile and row indices idx [NP], in registers."""
    return tl.gather(x, tl.broadcast_to(idx.to(tl.int32)[:, None], (NP, BC)), 0)


@triton.jit
def _gather_rows_mem(x, idx, scratch_ptr, at, cols, tile, C):
    """x[idx] through memory: the tile goes to this program's columns of a scratch
    [n, C] buffer (L1) and comes back row-permuted. The barriers keep every thread's
    reads of the previous gather before the store, and the store before these reads."""
    tl.debug_barrier()
    tl.store(scratch_ptr + at, x, mask=tile)
    tl.debug_barrier()
    return tl.load(scratch_ptr + idx.to(tl.int64)[:, None] * C + cols[None, :], mask=tile,
                   other=0.0)


@triton.jit
def _rows(x, idx, scratch_ptr, at, cols, tile, C, NP: tl.constexpr, BC: tl.constexpr,
          GATHER_MEM: tl.constexpr):
    if GATHER_MEM:
        out = _gather_rows_mem(x, idx, scratch_ptr, at, cols, tile, C)
    else:
        out = _gather_rows(x, idx, NP, BC)
    return out


@triton.jit
def _givens_fwd_kernel(x_ptr, cos_ptr, sin_ptr, partner_ptr, perm_ptr, out_ptr, inputs_ptr,
                       N, C, K, HAS_PERM: tl.constexpr, KEEP: tl.constexpr,
                       NP: tl.constexpr, BC: tl.constexpr, GATHER_MEM: tl.constexpr):
    r = tl.arange(0, NP)
    r_ok = r < N
    cols = (tl.program_id(0) * BC + tl.arange(0, BC)).to(tl.int64)
    tile = r_ok[:, None] & (cols < C)[None, :]
    at = r[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + at, mask=tile, other=0.0)
    for s in range(K):
        j = K - 1 - s  # R_k Q_k acts first
        # Padded rows gather row 0; no real row ever reads them back.
        if HAS_PERM:
            x = _rows(x, tl.load(perm_ptr + j * N + r, mask=r_ok, other=0), out_ptr, at, cols,
                      tile, C, NP, BC, GATHER_MEM)
        if KEEP:
            tl.store(inputs_ptr + j * N * C + at, x, mask=tile)
        c = tl.load(cos_ptr + j * N + r, mask=r_ok, other=0.0)[:, None]
        sn = tl.load(sin_ptr + j * N + r, mask=r_ok, other=0.0)[:, None]
        q = tl.load(partner_ptr + j * N + r, mask=r_ok, other=0)
        x = c * x + sn * _rows(x, q, out_ptr, at, cols, tile, C, NP, BC, GATHER_MEM)
    if GATHER_MEM:
        tl.debug_barrier()  # out_ptr was the scratch: every read of it done
    tl.store(out_ptr + at, x, mask=tile)


@triton.jit
def _givens_bwd_kernel(g_ptr, inputs_ptr, cos_ptr, sin_ptr, partner_ptr, inverse_ptr,
                       dx_ptr, dcos_part_ptr, dsin_part_ptr, N, C, K,
                       HAS_PERM: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr,
                       GATHER_MEM: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, NP)
    r_ok = r < N
    cols = (pid * BC + tl.arange(0, BC)).to(tl.int64)
    tile = r_ok[:, None] & (cols < C)[None, :]
    at = r[:, None].to(tl.int64) * C + cols[None, :]
    g = tl.load(g_ptr + at, mask=tile, other=0.0)
    for j in range(K):  # R_1 first: it was applied last
        x_in = tl.load(inputs_ptr + j * N * C + at, mask=tile, other=0.0)
        c = tl.load(cos_ptr + j * N + r, mask=r_ok, other=0.0)[:, None]
        sn = tl.load(sin_ptr + j * N + r, mask=r_ok, other=0.0)[:, None]
        q = tl.load(partner_ptr + j * N + r, mask=r_ok, other=0)
        part = pid * K * N + j * N + r
        tl.store(dcos_part_ptr + part, tl.sum(g * x_in, axis=1), mask=r_ok)
        if GATHER_MEM:  # x_in[q] straight from the saved inputs (nothing writes them)
            x_q = tl.load(inputs_ptr + j * N * C + q.to(tl.int64)[:, None] * C + cols[None, :],
                          mask=tile, other=0.0)
        else:
            x_q = _gather_rows(x_in, q, NP, BC)
        tl.store(dsin_part_ptr + part, tl.sum(g * x_q, axis=1), mask=r_ok)
        g = g * c + _rows(g * sn, q, dx_ptr, at, cols, tile, C, NP, BC, GATHER_MEM)
        if HAS_PERM:
            g = _rows(g, tl.load(inverse_ptr + j * N + r, mask=r_ok, other=0), dx_ptr, at, cols,
                      tile, C, NP, BC, GATHER_MEM)
    if GATHER_MEM:
        tl.debug_barrier()  # dx_ptr was the scratch: every read of it done
    tl.store(dx_ptr + at, g, mask=tile)


KERNELS = {"householder_fwd": _householder_fwd_kernel,
           "householder_bwd": _householder_bwd_kernel,
           "givens_fwd": _givens_fwd_kernel, "givens_bwd": _givens_bwd_kernel}


def givens_launch_meta(n: int, has_perm: bool):
    """(launch options, constexprs) of both Givens kernels for n rows: 16 columns per
    program on 4 to 8 warps up to n = 256, then fewer columns (4 at n = 1024); rows
    permuted with ``tl.gather`` up to GATHER_MAX rows, through memory above."""
    padded = max(16, triton.next_power_of_2(n))
    warps, cols = _tile(padded, BLOCK_COLS)
    return launch_options(warps), dict(HAS_PERM=has_perm, NP=padded, BC=cols,
                                       GATHER_MEM=padded > GATHER_MAX)


def givens_forward(x, cos, sin, partner, perms, keep: bool):
    check_launch(_givens_fwd_kernel, x)
    x, cos, sin, partner = x.contiguous(), cos.contiguous(), sin.contiguous(), partner.contiguous()
    n, cols = x.shape
    k = cos.shape[0]
    out = torch.empty_like(x)
    inputs = x.new_empty(k, n, cols) if keep else x.new_empty(0)
    options, meta = givens_launch_meta(n, perms is not None)
    _givens_fwd_kernel[(triton.cdiv(cols, meta["BC"]),)](
        x, cos, sin, partner, perms.contiguous() if perms is not None else partner, out,
        inputs if keep else x, n, cols, k, KEEP=keep, **meta, **options)
    return out, inputs


def givens_backward(grad, inputs, cos, sin, partner, perms):
    check_launch(_givens_bwd_kernel, grad)
    grad, inputs = grad.contiguous(), inputs.contiguous()
    cos, sin, partner = cos.contiguous(), sin.contiguous(), partner.contiguous()
    n, cols = grad.shape
    k = cos.shape[0]
    options, meta = givens_launch_meta(n, perms is not None)
    programs = triton.cdiv(cols, meta["BC"])
    d_x = torch.empty_like(grad)
    d_cos = cos.new_empty(programs, k, n)
    d_sin = sin.new_empty(programs, k, n)
    inverse = torch.argsort(perms, dim=1).contiguous() if perms is not None else partner
    _givens_bwd_kernel[(programs,)](
        grad, inputs, cos, sin, partner, inverse, d_x, d_cos, d_sin, n, cols, k,
        **meta, **options)
    return d_x, d_cos.sum(0), d_sin.sum(0)
