"""The kernels under compute-sanitizer: no out-of-bounds or misaligned access (memcheck), no
shared-memory race (racecheck), no misused barrier (synccheck), no read of global memory that
nothing wrote (initcheck), for every kernel family, native and through the sm_80 / sm_89 PTX;
and no out-of-bounds access when the offsets, lengths, tables and selections the kernels read on
the device disagree with the tensors (memcheck of the inconsistent_inputs family), nor a call that
does not return (the same family without the sanitizer, under a time limit).

Each case runs ``tests/sanitize_calls.py FAMILY [ARCH]`` in a child process under the tool, with
only this library's kernels instrumented (``--kernel-name kns=infllmv2``; initcheck instruments
everything, since it must see torch's kernels write the inputs). Skipped where
``compute-sanitizer`` is not on PATH. ``pytest -m sanitizer`` runs these alone, ``-m "gpu and not
sanitizer"`` the rest of the GPU tier."""

import os
import shutil
import subprocess
import sys

import pytest

import infllmv2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from sanitize_calls import FAMILIES, INCONSISTENT  # noqa: E402

# racecheck is about 100x slower than a plain run; these families are the small ones that still
# reach the sparse and decoding kernels' shared-memory designs (the forward's cluster pair, dQ's
# units, both dK/dV units, the selection, decoding and the cache updates). The sm_90a dense
# kernels (warp-specialised: a TMA producer warpgroup and two consumers spinning on each other's
# mbarriers) are checked through the sm_80 / sm_89 variants only: under racecheck a native run
# now and then never finishes (H200: 4 of 9 runs of the family, 1 of 9 with one kernel
# instrumented at a time, the forward's, and 1 of 30 with setmaxnreg removed), with no hazard in
# the runs that finish and no hang in hundreds of plain calls, so a native case would be flaky
# (benchmarks/NOTES.md, "Session 43" and "Session 44").
RACECHECK = ("attention_g16", "attention_g4", "decode_g16", "attention_kvcache", "dense_decode_kvcache")
CASES = (
    [pytest.param("memcheck", f, None, id=f"memcheck-{f}") for f in FAMILIES]
    + [pytest.param("synccheck", f, None, id=f"synccheck-{f}") for f in FAMILIES]
    + [pytest.param("racecheck", f, None, id=f"racecheck-{f}") for f in RACECHECK]
    + [pytest.param("initcheck", f, None, id=f"initcheck-{f}") for f in FAMILIES]
    + [pytest.param(tool, f, arch, id=f"{tool}-{f}-{arch}") for arch in ("sm_80", "sm_89")
       for tool in ("memcheck", "racecheck")
       for f in ("attention_g16", "dense_attn", "attention_kvcache", "dense_decode_kvcache")]
    + [pytest.param("memcheck", INCONSISTENT, arch, id=f"memcheck-{INCONSISTENT}-{arch or 'native'}")
       for arch in (None, "sm_80")]
)
# the plain run of the inconsistent family took 10 s on an H200 (session 49); a stall shows as a
# failure after this long, not as a hung tier
INCONSISTENT_SECONDS = 120


def _run_family(prefix, family, arch, timeout, env_extra=None):
    """``tests/sanitize_calls.py FAMILY [ARCH]`` in a child process (after ``prefix``, a tool's
    command line) with this library; asserts it finished and printed its ok line, and returns its
    output."""
    # the child imports infllmv2 as conftest does (the installed wheel, else python/), and this library
    env = dict(os.environ, INFLLMV2_LIBRARY=infllmv2.library_path(), **(env_extra or {}))
    cmd = prefix + [sys.executable, os.path.join(HERE, "sanitize_calls.py"), family] + ([arch] if arch else [])
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{family} {arch or 'native'} did not return within {timeout} s")
    text = run.stdout + run.stderr
    assert run.returncode == 0 and f"{family} {arch or 'native'} ok" in text, text[-6000:]
    return text


@pytest.mark.gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("tool,family,arch", CASES)
def test_kernels_under_compute_sanitizer(tool, family, arch):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer is not on PATH")
    if arch and arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} not compiled into this build")
    # every tensor its own allocation, so that a read past one is not inside another
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if tool in ("memcheck", "initcheck") else {}
    cmd = [exe, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20"]
    if tool != "initcheck":
        cmd += ["--kernel-name", "kns=infllmv2"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "hazard"]
    text = _run_family(cmd, family, arch, 300, env)
    assert "ERROR SUMMARY: 0 errors" in text or "RACECHECK SUMMARY: 0 hazards" in text, text[-6000:]


@pytest.mark.gpu
def test_inconsistent_inputs_return():
    """The inconsistent_inputs family without a sanitizer, in a child process with a time limit:
    with torch's caching allocator handing the kernels reused memory, every call returns. A
    dK/dV loop bounded by member-list offsets that bad cu_seqlens_k left unwritten once ran for
    minutes here (benchmarks/NOTES.md, "Session 49")."""
    _run_family([], INCONSISTENT, None, INCONSISTENT_SECONDS)
