"""The built library: every arch in build_info is really embedded, and nothing else is linked."""

import os
import subprocess
import sys

import infllmv2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fatbin import fatbin_entries  # noqa: E402


def test_library_embeds_sass_for_every_arch_and_ptx_for_portable_ones():
    info = infllmv2.build_info()
    entries = fatbin_entries(infllmv2.library_path())
    for arch in info["archs"]:
        units = sum(1 for u in info["kernels"] if u["arch"] == arch)
        assert entries[("sass", arch)] == units, (arch, entries)
        if not arch.endswith("a"):
            # the PTX lets newer GPUs JIT these, and lets them be checked on Hopper
            assert entries[("ptx", arch)] == units, (arch, entries)
    assert {a for _, a in entries} == set(info["archs"])


def test_library_needs_no_cudart_torch_or_tilelang():
    deps = subprocess.run(["ldd", infllmv2.library_path()], capture_output=True, text=True, check=True).stdout
    for name in ("libcudart", "libtorch", "tilelang", "libcuda.so"):
        assert name not in deps, deps


def test_library_holds_no_temporary_file_names():
    # nvcc's per-process temporary names would make two builds of the same sources differ
    with open(infllmv2.library_path(), "rb") as f:
        assert b"tmpxft_" not in f.read()
