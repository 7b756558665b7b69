"""Lists the GPU code a shared library embeds, by reading its .nv_fatbin section.

cuobjdump does the same where the CUDA toolkit ships it; the development and CI machines
have nvcc without cuobjdump, so this reads the fatbinary container headers directly:
a container (magic 0xBA55ED50) holds entries of kind 1 (PTX) or 2 (ELF/SASS), each naming
its SM number, with flag 0x100000 marking arch-specific ("a") code.

    python tests/fatbin.py libinfllmv2.so      # prints e.g. "sass sm_80 x8" lines
"""

import collections
import struct
import subprocess
import sys
import tempfile

MAGIC = 0xBA55ED50
KIND = {1: "ptx", 2: "sass"}
ARCH_SPECIFIC = 0x100000


def _section(lib_path):
    with tempfile.NamedTemporaryFile() as tmp:
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", lib_path, tmp.name], check=True)
        return open(tmp.name, "rb").read()


def fatbin_entries(lib_path):
    """Counter of (kind, arch) over the library's embedded GPU code, e.g. ("sass", "sm_90a")."""
    data = _section(lib_path)
    out = collections.Counter()
    off = 0
    while off + 16 <= len(data):
        if struct.unpack_from("<I", data, off)[0] != MAGIC:
            off += 8  # containers are 8-byte aligned
            continue
        _, _, header_size, fat_size = struct.unpack_from("<IHHQ", data, off)
        entry, end = off + header_size, off + header_size + fat_size
        while entry < end:
            kind, _, entry_header, size = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            flags = struct.unpack_from("<Q", data, entry + 40)[0]
            name = f"sm_{arch}{'a' if flags & ARCH_SPECIFIC else ''}"
            out[(KIND.get(kind, str(kind)), name)] += 1
            entry += entry_header + size
        off = end
    return out


if __name__ == "__main__":
    for (kind, arch), n in sorted(fatbin_entries(sys.argv[1]).items()):
        print(f"{kind} {arch} x{n}")
