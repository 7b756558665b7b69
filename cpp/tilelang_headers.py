"""Print the root of the pinned tilelang release's headers, fetching them if needed.

The generated sources include TileLang's CUDA templates (``<root>/src/tl_templates``) and
CUTLASS (``<root>/3rdparty/cutlass/include``); they are coupled to the tilelang version that
generated them, so they come from that release at build time and are never committed.

Order: $INFLLMV2_TILELANG_ROOT; an installed tilelang of the pinned version (found without
importing it, which would need torch); else the pinned wheel, downloaded with pip into
``--cache`` and unpacked there (headers only). Usage: python tilelang_headers.py --cache DIR
"""

import argparse
import glob
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile

VERSION = "0.1.15"
NEEDED = ("src/tl_templates/cuda", "3rdparty/cutlass/include/cutlass")


def _complete(root):
    return root and all(os.path.isdir(os.path.join(root, p)) for p in NEEDED)


def _installed():
    try:
        if importlib.metadata.version("tilelang").split("+")[0] != VERSION:
            return None
        spec = importlib.util.find_spec("tilelang")
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    return root if _complete(root) else None


def _from_wheel(cache):
    root = os.path.join(cache, f"tilelang-{VERSION}", "tilelang")
    if _complete(root):
        return root
    wheel_dir = os.path.join(cache, "wheel")
    os.makedirs(wheel_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(wheel_dir, f"tilelang-{VERSION}-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
             "-d", wheel_dir, f"tilelang=={VERSION}"],
            check=True, stdout=sys.stderr,
        )
        wheels = glob.glob(os.path.join(wheel_dir, f"tilelang-{VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"could not obtain the tilelang {VERSION} wheel for its headers")
    prefixes = ("tilelang/src/tl_templates/", "tilelang/3rdparty/cutlass/include/")
    with zipfile.ZipFile(wheels[0]) as z:
        for name in z.namelist():
            if name.startswith(prefixes):
                z.extract(name, os.path.dirname(root))
    if not _complete(root):
        raise SystemExit(f"the tilelang {VERSION} wheel lacks {NEEDED}")
    return root


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    args = ap.parse_args()
    root = os.environ.get("INFLLMV2_TILELANG_ROOT")
    if root and not _complete(root):
        raise SystemExit(f"INFLLMV2_TILELANG_ROOT={root} lacks {NEEDED}")
    root = root or _installed() or _from_wheel(args.cache)
    print(os.path.abspath(root), end="")


if __name__ == "__main__":
    main()
