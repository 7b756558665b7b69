"""Workarounds for TileLang 0.1.15 bugs, active while the build step lowers a unit."""

import contextlib


@contextlib.contextmanager
def wgmma_fences_per_warpgroup():
    """TileLang fences a wgmma accumulator with (M // 64) x (the registers of its atoms), M the
    whole tile's rows. Where two warpgroups stack along M (M = 128: the dense kernels' consumer
    warpgroups on sm_90a), each thread's fence then names twice the registers it holds, reading
    and writing past its register array: undefined behaviour, which nvcc 13.0 happens to drop
    (the dense units' SASS is the same with and without the fix), and which put a kernel at 255
    registers into local memory (session 39's bwd_dkdv pair unit, benchmarks/NOTES.md). A
    warpgroup's M atoms are the emitter's own wgmma_num_inst_m (4 warps x warp_row_tiles rows);
    with one warpgroup along M the count is unchanged."""
    from tilelang.cuda.intrinsics.macro import wgmma_macro_generator as g

    emitter = g.TensorCoreIntrinEmitter
    orig = emitter.wgmma_accum_regs

    def per_warpgroup(self):
        bits = g.DataType(self.accum_dtype).bits
        return (self.wgmma_num_inst_m * self.warp_cols * self.local_size_out * bits + 31) // 32

    emitter.wgmma_accum_regs = property(per_warpgroup)
    try:
        yield
    finally:
        emitter.wgmma_accum_regs = orig
