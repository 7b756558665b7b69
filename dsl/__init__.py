"""TileLang kernel programs of infllmv2 and the ahead-of-time build step (`python -m dsl.build`).

Each op module defines `VARIANTS`: the compile-time configurations it is built in, and a
`program(**config)` factory returning the TileLang PrimFunc; optionally `builds(arch=...,
**config)`, whether a variant is built for an arch (all are, without it). Nothing here runs on
a GPU.
"""

# nvcc flags of the modules whose kernels exponentiate (the attention softmaxes and the
# selection's probabilities): without flush-to-zero, exp2f compiles to MUFU.EX2 wrapped in
# range fix-ups for subnormal results. Measured on an H100 (kernels alone, every output bitwise
# equal on the benchmark inputs): sparse dQ 76.2 -> 72.7 ms and dK/dV 128.5 -> 124.0 ms at 32K x 8,
# select_blocks 13.3 -> 12.7 ms, the dense forward 3.47 -> 3.26 ms at 4K x 8. Only fp32 values
# below 1.2e-38 change (to zero): probabilities and products too small to move a bf16 result.
EXP_NVCC_FLAGS = ("-ftz=true",)
