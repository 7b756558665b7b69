"""Sequence spans from offsets the kernels cannot trust. Not an op: the op modules share it.

A varlen kernel finds sequence b between offsets cu[b] and cu[b + 1], which it reads on the
device: the C ABI hands them over unread (reading them would cost a host synchronisation), so
they may disagree with the tensors. Every kernel takes its spans through `seq_span`, which
clamps them into the packed tensor. Offsets that agree with it come back unchanged; others give
wrong values but cannot send a load outside the tensor, nor a loop past its size: before, a
length near 2^31 kept the dense kernels, the selection and the sparse union walks busy for
minutes to hours (benchmarks/NOTES.md, "Session 50").
"""

import tilelang.language as T


def seq_start(cu, b, total):
    """Where sequence b starts in a tensor of `total` packed rows: cu[b] clamped into [0, total]."""
    return T.min(T.max(cu[b], 0), total)


def seq_len(cu, b, total, start):
    """The length of sequence b given its start (seq_start's value, where a kernel keeps it in a
    register: an expression is inlined at every use): cu[b + 1] clamped into [start, total],
    less start."""
    return T.min(T.max(cu[b + 1], start), total) - start


def seq_span(cu, b, total):
    """(start, length) of sequence b in a tensor of `total` packed rows, as seq_start and seq_len."""
    start = seq_start(cu, b, total)
    return start, seq_len(cu, b, total, start)
