"""The distribution's licence: an MIT LICENSE file, named by an SPDX expression in pyproject.toml
(setuptools deprecated the ``license = {text = ...}`` table), and metadata built without the
deprecation warning."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_license_is_an_spdx_string_with_its_file() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read SPDX
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 gpulock developers\n")


def test_metadata_builds_without_the_license_deprecation(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom setuptools import build_meta\n"
        "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-W", "always", "-c", code, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "deprecated" not in r.stderr.lower(), r.stderr
    meta = (tmp_path / r.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in meta and "License-File: LICENSE" in meta
