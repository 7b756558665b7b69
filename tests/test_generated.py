"""generated/ is exactly what the DSL build step writes: regenerate and compare byte for byte."""

import filecmp
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_regenerating_reproduces_generated(tmp_path):
    pytest.importorskip("tilelang", reason="regenerating needs the dsl extra (tilelang 0.1.15)")
    import sys

    sys.path.insert(0, ROOT)
    from dsl import build

    archs = sorted(d for d in os.listdir(os.path.join(ROOT, "generated")) if d.startswith("sm_"))
    # INFLLMV2_REGEN_ARCHS (CI sets it, see .ci/run) regenerates only the archs it names; the
    # others' committed units are copied in, so that registry.h and units.cmake are still
    # rebuilt over every arch and compared with the rest
    only = os.environ.get("INFLLMV2_REGEN_ARCHS", "").split()
    regen = [a for a in archs if a in only] if only else archs
    assert regen, f"INFLLMV2_REGEN_ARCHS={only} names none of {archs}"
    for a in archs:
        if a not in regen:
            shutil.copytree(os.path.join(ROOT, "generated", a), tmp_path / a)
    build.build(regen, str(tmp_path), os.cpu_count() or 1)
    committed, fresh = [], []
    for base, out in ((os.path.join(ROOT, "generated"), committed), (str(tmp_path), fresh)):
        for dirpath, _, files in os.walk(base):
            out.extend(sorted(os.path.relpath(os.path.join(dirpath, f), base) for f in files))
    assert sorted(committed) == sorted(fresh)
    for rel in committed:
        assert filecmp.cmp(os.path.join(ROOT, "generated", rel), tmp_path / rel, shallow=False), f"{rel} differs"



@pytest.mark.slow
def test_regenerating_some_kernels_keeps_the_others(tmp_path):
    """`python -m dsl.build --ops OP --kernels K ...` rewrites K's units of every arch and leaves
    every other unit, manifest entry and table as it finds them."""
    pytest.importorskip("tilelang", reason="regenerating needs the dsl extra (tilelang 0.1.15)")
    import sys

    sys.path.insert(0, ROOT)
    from dsl import build

    out = tmp_path / "generated"
    shutil.copytree(os.path.join(ROOT, "generated"), out)
    archs = sorted(d for d in os.listdir(out) if d.startswith("sm_"))
    # one unit of the kernel that is rebuilt, one of a kernel of the same op that is not
    for a in archs:
        for name in ("sparse_attn_bwd_members_scan.cu", "sparse_attn_bwd_members.cu"):
            with open(out / a / name, "a") as f:
                f.write("// stale\n")
    written = build.build(archs, str(out), 1, ["dsl.sparse_attn"], ["bwd_members_scan"])
    assert sorted(written) == [f"{a}/sparse_attn_bwd_members_scan.cu" for a in archs]
    for dirpath, _, files in os.walk(os.path.join(ROOT, "generated")):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, "generated"))
            same = filecmp.cmp(os.path.join(dirpath, f), out / rel, shallow=False)
            assert same == (f != "sparse_attn_bwd_members.cu"), rel
    with pytest.raises(SystemExit, match="--kernels: nope not among the kernels of dsl.sparse_attn"):
        build.build(archs, str(out), 1, ["dsl.sparse_attn"], ["nope"])

def _units_by_arch(kernel):
    """(arch, the manifest entries of `kernel`) for each arch in generated/, none of them empty."""
    import json

    for arch in sorted(d for d in os.listdir(os.path.join(ROOT, "generated")) if d.startswith("sm_")):
        with open(os.path.join(ROOT, "generated", arch, "manifest.json")) as f:
            units = [u for u in json.load(f) if u["kernel"] == kernel]
        assert units, arch
        yield arch, units


@pytest.mark.parametrize("kernel", ["sparse_attn_fwd", "sparse_attn_bwd_dq"])
def test_sparse_tiled_units_serve_every_group_size(kernel):
    """A forward or dQ unit with small tiles (min_groups > 1) serves large groups only: for each
    arch, dtype and head dim there must also be a unit for every group size (min_groups 1), and
    units of several tiles a cluster only where clusters exist (sm_90)."""
    for arch, units in _units_by_arch(kernel):
        by_config = {}
        for u in units:
            by_config.setdefault((u["config"]["dtype"], u["config"]["head_dim"]), []).append(u["constants"])
        for config, constants in by_config.items():
            assert min(c["min_groups"] for c in constants) == 1, (arch, config, constants)
            for c in constants:
                # a unit's tiles hold min_groups x t_max rows at least where it is used
                assert c["min_groups"] == 1 or c["min_groups"] * c["t_max"] == c["block_m"], (arch, config, c)
                assert c["cluster"] == 1 or (arch.startswith("sm_90") and c["min_groups"] > 1), (arch, config, c)


def test_dkdv_units_serve_every_group_size():
    """Each arch, dtype and head dim has a dK/dV unit for every group size (boxes 0); a unit for
    one group size whose rows load as TMA boxes (boxes > 0) exists only where TMA does (sm_90)."""
    for arch, units in _units_by_arch("sparse_attn_bwd_dkdv"):
        by_config = {}
        for u in units:
            by_config.setdefault((u["config"]["dtype"], u["config"]["head_dim"]), []).append(u["config"]["boxes"])
        for config, boxes in by_config.items():
            assert 0 in boxes, (arch, config, boxes)
            assert all(b == 0 or (arch.startswith("sm_90") and 64 % b == 0) for b in boxes), (arch, config, boxes)


def test_no_kernel_reads_before_its_predecessor_is_flushed():
    """TileLang launches every kernel with PDL allowed (dsl/tl_fixes.pdl_safe_launch): on sm_90a
    each kernel must wait on its predecessor (griddepcontrol.wait) before anything else, and
    below sm_90 the launch must not allow PDL at all."""
    import re

    definition = re.compile(r'^extern "C" __global__ void [^\n;]*\) \{\n(.*)$', re.M)
    units = 0
    for arch in sorted(d for d in os.listdir(os.path.join(ROOT, "generated")) if d.startswith("sm_")):
        folder = os.path.join(ROOT, "generated", arch)
        for name in sorted(f for f in os.listdir(folder) if f.endswith(".cu")):
            with open(os.path.join(folder, name)) as f:
                code = f.read()
            first_lines = definition.findall(code)
            assert len(first_lines) == 1, f"{arch}/{name}: expected one kernel definition"
            allowed = re.findall(r"programmaticStreamSerializationAllowed = (\d);", code)
            assert len(allowed) == 1, f"{arch}/{name}: expected one launch"
            if int(arch[3:5]) >= 90:
                assert first_lines[0].strip() == 'asm volatile("griddepcontrol.wait;" ::: "memory");', f"{arch}/{name}"
            else:
                assert allowed == ["0"] and "griddepcontrol" not in code, f"{arch}/{name}"
            units += 1
    assert units >= 200
