"""TileLang kernel programs of infllmv2 and the ahead-of-time build step (`python -m dsl.build`).

Each op module defines `VARIANTS`: the compile-time configurations it is built in, and a
`program(**config)` factory returning the TileLang PrimFunc. Nothing here runs on a GPU.
"""
