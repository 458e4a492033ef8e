"""PowerSGD's numerical kernel: orthonormalization, random ``Q``, batched matrix views and products.

Pure tensor code with no communication and no state: what to compress and when is decided by the hooks
(:mod:`gradcomm.hooks.powersgd.hook`), and what is kept between steps by the state
(:mod:`gradcomm.hooks.powersgd.state`), as in epfml/powersgd's split of policy from kernel.

Every matrix a product or an orthonormalization reads or writes is handed to it at a multiple of
:data:`ALIGNMENT` bytes, wherever it lies in the bucket or in the ``P`` and ``Q`` messages. BLAS kernels round
differently with the alignment of their operands (MKL's matrix-vector product, which rank 1 uses, sums in
another order when a matrix starts 4 bytes off a 16-byte boundary), so without this a matrix's ``P`` and
``Q`` would depend on the parameters before it in its bucket: a run resumed on a fresh DDP, whose first
iteration has other buckets than the saved run (see :mod:`gradcomm.hooks.parameter_keys`), would drift from
the uninterrupted one by an ulp. A matrix that lies unaligned goes through an aligned copy
(:func:`staged`, :func:`bmm`); the messages keep torch's compact layout, so what is sent is unchanged.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ALIGNMENT",
    "Batch",
    "bmm",
    "decompress_with_error",
    "empty_batch",
    "fill_random",
    "gather",
    "orthogonalize",
    "prepare_qs",
    "scatter",
    "split",
    "square_side",
    "staged",
]

ALIGNMENT = 64


def padded(numel: int, element_size: int) -> int:
    """``numel`` rounded up to a whole number of :data:`ALIGNMENT`-byte blocks of elements."""
    per_block = max(1, ALIGNMENT // element_size)
    return -(-numel // per_block) * per_block


def is_aligned(matrices: torch.Tensor) -> bool:
    """Whether every matrix of the ``(batch, rows, cols)`` tensor starts at an aligned address."""
    if matrices.data_ptr() % ALIGNMENT:
        return False
    return matrices.shape[0] < 2 or (matrices.stride(0) * matrices.element_size()) % ALIGNMENT == 0


def aligned_empty(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat tensor of ``numel`` elements starting at an aligned address (torch's allocators align to 64
    bytes or more; sliced out of a larger one where one did not)."""
    flat = like.new_empty(numel)
    if flat.data_ptr() % ALIGNMENT == 0:
        return flat
    spare = max(1, ALIGNMENT // like.element_size())
    larger = like.new_empty(numel + spare)
    start = (-larger.data_ptr() % ALIGNMENT) // like.element_size()
    return larger[start : start + numel]


def empty_batch(batch: int, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """A new ``(batch, rows, cols)`` tensor of aligned matrices."""
    stride = padded(rows * cols, like.element_size())
    return aligned_empty(batch * stride, like).view(batch, stride)[:, : rows * cols].view(batch, rows, cols)


def staged(matrices: torch.Tensor) -> torch.Tensor:
    """``matrices`` (a ``(batch, rows, cols)`` tensor) if aligned, else an aligned copy."""
    if is_aligned(matrices):
        return matrices
    copy = empty_batch(*matrices.shape, like=matrices)
    copy.copy_(matrices)
    return copy


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` per matrix, rounded as with every operand aligned, wherever ``out`` lies (``a`` and ``b``
    must be aligned, e.g. through :func:`staged`; transposed views of aligned matrices are)."""
    if is_aligned(out):
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b, out=empty_batch(*out.shape, like=out)))


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalize, in place, the columns of each matrix of a ``(batch, rows, cols)`` tensor.

    QR is usually faster from 3 columns on, but has no half-precision kernels.
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(
            f"expected a batch of matrices with no more columns than rows, got {tuple(matrices.shape)}"
        )
    work = staged(matrices)
    _orthogonalize(work, epsilon)
    if work is not matrices:
        matrices.copy_(work)


def _orthogonalize(matrices: torch.Tensor, epsilon: float) -> None:
    if matrices.shape[2] <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        orthogonalize_gram_schmidt(matrices, epsilon)
    else:
        r = matrices.new_empty(matrices.shape[0], matrices.shape[2], matrices.shape[2])
        torch.linalg.qr(matrices, out=(matrices, r))


def orthogonalize_gram_schmidt(matrices: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt; a column of zeros stays zeros (torch's divides it by its zero norm when epsilon is 0)."""
    num_cols = matrices.shape[2]
    for i in range(num_cols):
        col = matrices[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        if epsilon == 0:
            col /= norm.masked_fill_(norm == 0, 1)
        else:
            col /= norm + epsilon
        if i + 1 < num_cols:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def fill_random(matrices: Sequence[torch.Tensor], rng: np.random.RandomState) -> None:
    """Fill with standard normal values, the same on every rank, from one seed drawn from ``rng``."""
    generator = torch.Generator().manual_seed(int(rng.randint(1_000_000_000)))
    for matrix in matrices:
        matrix.copy_(torch.randn(matrix.shape, generator=generator, dtype=matrix.dtype))


def prepare_qs(
    qs: Sequence[torch.Tensor], memory: torch.Tensor, fresh: bool, rng: np.random.RandomState, epsilon: float
) -> None:
    """Orthonormalize the bucket's ``Q`` matrices (views into ``memory``), drawn at random if ``fresh``.

    A warm-started column that is zero (its gradient was exactly zero last step, as for a branch not used
    yet) would stay zero under power iteration, and that direction would never be sent again: torch's hook
    then divides by zero, or, with an epsilon, stalls. Such columns are drawn afresh. Q is the same on every
    rank, so every rank draws for the same columns.
    """
    if fresh:
        fill_random(qs, rng)
    for q in qs:
        orthogonalize(q, epsilon)
    if fresh or not qs:
        return
    live_columns = sum(q.shape[0] * q.shape[2] for q in qs)
    if torch.sum(memory.square(), dtype=torch.float32).item() > live_columns - 0.5:
        return  # every column has norm 1: nothing to revive (checked with one reduction)
    generator = torch.Generator().manual_seed(int(rng.randint(1_000_000_000)))
    for q in qs:
        dead = torch.nonzero(q.abs().amax(dim=1) == 0).tolist()
        for batch, column in dead:
            q[batch, :, column].copy_(torch.randn(q.shape[1], generator=generator, dtype=q.dtype))
        if dead:
            orthogonalize(q, epsilon)

@dataclass(frozen=True)
class Batch:
    """Same-shaped gradient matrices of a bucket compressed together: their offsets in the bucket."""

    offsets: tuple[int, ...]
    rows: int
    cols: int
    rank: int

    @property
    def matrix_numel(self) -> int:
        return self.rows * self.cols

    @property
    def p_numel(self) -> int:
        return len(self.offsets) * self.rows * self.rank

    @property
    def q_numel(self) -> int:
        return len(self.offsets) * self.cols * self.rank

    def _view(self, flat: torch.Tensor, offset: int) -> torch.Tensor:
        return flat[offset : offset + self.matrix_numel].view(1, self.rows, self.cols)

    def matrices(self, flat: torch.Tensor) -> torch.Tensor:
        """``(batch, rows, cols)`` aligned matrices: a view of ``flat`` for one aligned matrix, else a copy."""
        views = [self._view(flat, o) for o in self.offsets]
        if len(views) == 1 and is_aligned(views[0]):
            return views[0]
        copy = empty_batch(len(views), self.rows, self.cols, flat)
        for i, view in enumerate(views):
            copy[i].copy_(view[0])
        return copy

    def decompress(self, p: torch.Tensor, q: torch.Tensor, matrices: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``P Q^T`` for each matrix into ``out`` (the bucket), through an aligned copy where needed
        (``matrices``, if it is a copy, is overwritten)."""
        p, q_t = staged(p), staged(q).transpose(1, 2)
        if len(self.offsets) == 1:
            bmm(p, q_t, self._view(out, self.offsets[0]))
            return
        torch.bmm(p, q_t, out=matrices)
        for i, o in enumerate(self.offsets):
            out[o : o + self.matrix_numel].view(self.rows, self.cols).copy_(matrices[i])


def split(memory: torch.Tensor, sizes: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Consecutive ``(batch, rows, rank)`` views of a flat tensor."""
    views, offset = [], 0
    for batch, rows, rank in sizes:
        views.append(memory[offset : offset + batch * rows * rank].view(batch, rows, rank))
        offset += batch * rows * rank
    return views


def gather(flat: torch.Tensor, spans: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
    """Copy the ``(offset, numel)`` spans of ``flat`` to consecutive pieces of ``out`` (inverse of :func:`scatter`)."""
    position = 0
    for offset, numel in spans:
        out[position : position + numel].copy_(flat[offset : offset + numel])
        position += numel


def scatter(flat: torch.Tensor, spans: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` to the ``(offset, numel)`` spans of ``out``."""
    position = 0
    for offset, numel in spans:
        out[offset : offset + numel].copy_(flat[position : position + numel])
        position += numel

def square_side(length: int) -> int:
    """Side of the smallest square holding ``length`` elements."""
    return math.isqrt(length - 1) + 1 if length > 0 else 0

def decompress_with_error(
    p: torch.Tensor, q: torch.Tensor, buffer: torch.Tensor, error: torch.Tensor, side: int
) -> None:
    """``buffer = (P Q^T)[:length]`` and ``error -= P Q^T``, without a padded temporary.

    Whole rows go straight into the bucket; the (at most two) rows that hold the padding go through a small
    temporary.
    """
    length = buffer.numel()
    if length == 0:  # an empty bucket: a 0 x 0 matrix, nothing to write or to subtract
        return
    full_rows = length // side
    head = full_rows * side
    torch.matmul(p[:full_rows], q.t(), out=buffer[:head].view(full_rows, side))
    tail = torch.matmul(p[full_rows:], q.t()).view(-1)
    buffer[head:].copy_(tail[: length - head])
    flat_error = error.view(-1)
    flat_error[:length].sub_(buffer)
    flat_error[length:].sub_(tail[length - head :])

