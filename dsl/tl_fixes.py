"""Workarounds for TileLang 0.1.15 bugs, applied while the build step lowers a unit."""

import contextlib
import re


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


_PDL_ALLOWED = "programmaticStreamSerializationAllowed = 1;"
_KERNEL_DEFINITION = re.compile(r'^extern "C" __global__ void [^\n;]*\) \{$', re.M)
PDL_WAIT = '  asm volatile("griddepcontrol.wait;" ::: "memory");'


def pdl_safe_launch(code: str, sm: int) -> str:
    """TileLang 0.1.15's host wrapper launches every kernel with programmatic stream
    serialisation allowed (PDL), and no kernel here waits on its predecessor. On sm_90 such a
    kernel may start once the previous kernel's thread blocks have exited, before their writes
    are flushed (the implicit trigger at exit comes before the exit's memory barrier), and only
    griddepcontrol.wait orders its reads after those writes: a race at every kernel boundary,
    with ours and with the caller's kernels. So on sm_90 and later each kernel waits first
    thing (keeping PDL's early launch); below sm_90, where the instruction does not exist and an
    sm_80 or sm_89 unit's PTX may still be compiled for a Hopper GPU, the launch does not allow
    PDL. ``code`` is one unit's source, one kernel and one launch."""
    if code.count(_PDL_ALLOWED) != 1 or len(_KERNEL_DEFINITION.findall(code)) != 1:
        raise RuntimeError("expected one kernel definition and one PDL launch in TileLang's output")
    if sm < 90:
        return code.replace(_PDL_ALLOWED, "programmaticStreamSerializationAllowed = 0;")
    return _KERNEL_DEFINITION.sub(lambda m: m.group(0) + "\n" + PDL_WAIT, code)
