"""Reading the machine code of a compiled cubin in tests: cuobjdump (the CUDA toolkit's, or the
copy in the Triton wheel) and the opcodes of each kernel function."""

from __future__ import annotations

import os
import re
import shutil
import subprocess


def cuobjdump() -> str | None:
    """The cuobjdump to use, or None where there is none."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.access(path, os.X_OK) else None


def dump_sass(cubin: bytes, tmp_path) -> str:
    """cuobjdump's SASS listing of ``cubin``."""
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True,
                          check=True).stdout


_OP = re.compile(r"^\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+ )?(\S+)", re.M)


def opcodes(sass: str) -> list[str]:
    """The opcodes of a SASS listing, in order (predicates dropped)."""
    return _OP.findall(sass)


def functions(sass: str) -> dict[str, list[str]]:
    """Each kernel function's opcodes, by mangled name."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    return {parts[i]: opcodes(parts[i + 1]) for i in range(1, len(parts) - 1, 2)}
