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
