"""Files the engine reads from its own package at run time — the bundled models and the C++
sources its CPU kernels are built from on first use — are in pyproject's package-data, so an
install that is not editable (``pip install .``, a wheel) has them too."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[3]


def packaged(package: str) -> set[Path]:
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        package
    ]
    return {p for pattern in globs for p in (ROOT / package).glob(pattern) if p.is_file()}


def test_every_kernel_source_and_header_is_package_data():
    csrc = ROOT / "engine" / "model" / "cpu" / "csrc"
    sources = {p for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    assert {p.name for p in sources} >= {"paged_attention_cpu.cpp", "small_linear_cpu.cpp", "brgemm_linear_cpu.cpp",
                                         "bfloat16.h"}  # fmt: skip
    assert sources - packaged("engine") == set()


def test_the_bundled_models_are_package_data():
    assets = ROOT / "engine" / "assets"
    files = {p for p in assets.rglob("*") if p.is_file() and p.parent.name in ("default_model", "moe_model")}
    assert files and files - packaged("engine") == set()
