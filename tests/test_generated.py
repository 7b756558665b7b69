"""generated/ is exactly what the DSL build step writes: regenerate and compare byte for byte."""

import filecmp
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_regenerating_reproduces_generated(tmp_path):
    pytest.importorskip("tilelang", reason="regenerating needs the dsl extra (tilelang 0.1.15)")
    import sys

    sys.path.insert(0, ROOT)
    from dsl import build

    archs = sorted(d for d in os.listdir(os.path.join(ROOT, "generated")) if d.startswith("sm_"))
    build.build(archs, str(tmp_path), os.cpu_count() or 1)
    committed, fresh = [], []
    for base, out in ((os.path.join(ROOT, "generated"), committed), (str(tmp_path), fresh)):
        for dirpath, _, files in os.walk(base):
            out.extend(sorted(os.path.relpath(os.path.join(dirpath, f), base) for f in files))
    assert sorted(committed) == sorted(fresh)
    for rel in committed:
        assert filecmp.cmp(os.path.join(ROOT, "generated", rel), tmp_path / rel, shallow=False), f"{rel} differs"


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
