"""One line on the installed torch build and the GPU, without importing torch (it is quick).

``make run`` and ``make test`` print it so the install is never a mystery::

    glassbox: torch 2.13.0+cpu (CPU build), no GPU found
    glassbox: torch 2.13.0 (CUDA 13.0 build), NVIDIA GPU found: NVIDIA H200

The build is read from ``torch/version.py`` (a few constants), the GPU from the NVIDIA
driver's files under ``/proc`` and ``/dev`` — importing torch would take seconds. Run it as
a script (``python engine/cli/torch_info.py``, which imports nothing of the engine) or as
``python -m engine.cli.torch_info``. Always exits 0: it informs, it does not judge.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


def torch_build() -> tuple[str | None, str]:
    """``(version, build)``: e.g. ``("2.13.0+cpu", "CPU build")``; version None if torch is missing."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, "not installed"
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    values: dict[str, object] = {}
    try:
        tree = ast.parse(version_file.read_text())
    except (OSError, SyntaxError):
        return "?", "unknown build"
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    version = str(values.get("__version__", "?"))
    if values.get("cuda"):
        return version, f"CUDA {values['cuda']} build"
    if values.get("hip"):
        return version, f"ROCm {values['hip']} build"
    if sys.platform == "darwin":
        return version, "CPU/MPS build"
    return version, "CPU build"


def nvidia_gpus() -> list[str]:
    """Names of the NVIDIA GPUs the driver knows (empty: none, or no NVIDIA driver)."""
    names = []
    if DRIVER_GPUS.is_dir():
        for info in sorted(DRIVER_GPUS.glob("*/information")):
            try:
                for line in info.read_text().splitlines():
                    if line.startswith("Model:"):
                        names.append(line.split(":", 1)[1].strip())
                        break
            except OSError:
                continue
    if not names and Path("/dev/nvidia0").exists():
        names.append("NVIDIA GPU")
    return names


def describe() -> str:
    version, build = torch_build()
    if version is None:
        return "glassbox: torch is not installed (run make install)"
    gpus = nvidia_gpus()
    if not gpus:
        gpu = "no GPU found"
    else:
        gpu = f"NVIDIA GPU found: {', '.join(gpus)}"
        if not build.startswith("CUDA"):
            gpu += ' (this torch cannot use it; see README: TORCH_SPEC="torch==... --index-url .../cu130")'
    return f"glassbox: torch {version} ({build}), {gpu}"


def main() -> int:
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
