"""Building Glassbox's own C++ kernels for CPUs on first use, and where they are cached.

A kernel is one C++ source file of ``engine/model/cpu/csrc`` (it may include that folder's
headers) with C linkage and no torch headers, compiled here with ``$CXX`` (else ``g++``)::

    g++ -O3 -march=native -fopenmp -shared -fPIC <source>.cpp -o <so>

into ``<GLASSBOX_CACHE_ROOT>/kernels/<source stem>-<hash>.so`` and called through
``ctypes``. The hash covers the source, the compiler, the flags and the CPU's instruction
sets, so an edit makes a new file and a kernel built for one CPU is never loaded on another
(a cache directory shared between machines). Used by ``paged_attention_cpu.py`` and
``small_linear_cpu.py``; ``brgemm_linear_cpu.py``'s kernel calls into torch's own library, so
it is linked against it (``torch_link_flags``), and torch's version is in its hash.

OpenMP: torch ships ``libgomp.so.1`` and has loaded it before a kernel is opened, so a kernel
(linked against ``libgomp.so.1`` by ``-fopenmp``) shares torch's runtime and thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def compiler() -> str:
    """The C++ compiler kernels are built with: ``$CXX``, else ``g++``."""
    return os.environ.get("CXX") or "g++"


def missing_compiler() -> str | None:
    """Why nothing can be built here (no C++ compiler on PATH), or None."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        return (
            f"no C++ compiler ({cxx}{'' if os.environ.get('CXX') else '; set $CXX to use another'}) on PATH"
        )
    return None


def cpu_flags() -> str:
    """The instruction sets of this CPU (Linux's /proc/cpuinfo ``flags`` line), else its
    platform name."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.machine() + platform.processor()


def torch_link_flags() -> tuple[str, ...]:
    """Flags that link a kernel against torch's ``libtorch_cpu.so`` and ``libc10.so`` (for a
    kernel that calls torch's exported C++ functions), with torch's library folder as its run
    path, and torch's version (a define, so it is in the kernel's hash)."""
    import torch

    lib = str(Path(torch.__file__).resolve().parent / "lib")
    version = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
    return (f"-DGLASSBOX_TORCH_{version}", f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10")


def kernel_file(source: Path, link: tuple[str, ...] = ()) -> Path:
    """Where ``source``'s build lives (or will): ``<cache>/kernels/<stem>-<hash>.so``;
    ``link``: extra flags it is built with (``torch_link_flags()``), part of the hash."""
    from engine import envs

    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what a kernel may include (bfloat16.h)
        digest.update(header.read_bytes())
    # -march=native: a kernel built on one CPU may not run on another, so the CPU's
    # instruction sets are part of the name too.
    digest.update("\0".join((compiler(), *FLAGS, *link, cpu_flags())).encode())
    return (
        Path(envs.GLASSBOX_CACHE_ROOT).expanduser()
        / "kernels"
        / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    )


def build(source: Path, so: Path, what: str, link: tuple[str, ...] = ()) -> None:
    """Compile ``source`` into the shared library ``so`` with ``compiler()``, ``FLAGS`` and
    ``link`` (extra flags after the output: libraries to link against).

    Builds into a temporary file of ``so``'s directory, then renames it: two processes
    building at once each write their own file, and the rename is atomic. ``what`` names the
    kernel in errors ("the CPU_PAGED_CPP attention kernel").

    Raises:
        RuntimeError: no C++ compiler, or the build failed (the message holds the command
            and the compiler's stderr).
    """
    why = missing_compiler()
    if why:
        raise RuntimeError(f"cannot build {what}: {why}")
    so.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=so.stem + "-", suffix=".so.tmp", dir=so.parent)
    os.close(fd)
    cmd = [compiler(), *FLAGS, str(source), "-o", tmp, *link]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"building {what} failed: {' '.join(cmd)}\n{done.stderr.strip()}")
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def open_library(
    source: Path, what: str, signatures: dict[str, tuple[list, object]], link: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """Build ``source`` unless its build is cached (``kernel_file``), load it, and give each
    function of ``signatures`` (``name: (argtypes, restype)``) its ctypes signature.

    Raises:
        RuntimeError: no C++ compiler, or the build failed (see ``build``).
    """
    so = kernel_file(source, link)
    if not so.exists():
        build(source, so, what, link)
    lib = ctypes.CDLL(str(so))
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def unbuildable(source: Path, link: tuple[str, ...] = ()) -> str | None:
    """Why ``source`` cannot be built here where it is not built yet (no C++ compiler), else None."""
    return None if kernel_file(source, link).exists() else missing_compiler()
