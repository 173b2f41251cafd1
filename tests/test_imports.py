"""The layout's contracts: imports follow the data path (the wheel's contents: tests/test_install.py).

The import rules live in pyproject.toml ([tool.importlinter]); import-linter checks them. Each test runs
the tool the way a developer would, as a subprocess, and one test shows that a back-arrow breaks them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=240,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
    )


def _copy_tree(dst: Path) -> Path:
    """The package as it would install: vgpu/ with its links to the design's folders resolved."""
    shutil.copytree(ROOT / "vgpu", dst / "vgpu", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pt", "*.csv.gz", "models"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "back_arrow", "named"),
    [
        ("profiler/sampler.py", "import vgpu.manager.core", "vgpu.profiler.sampler -> vgpu.manager.core"),
        ("manager/core.py", "import vgpu.allocator.core", "vgpu.manager.core -> vgpu.allocator.core"),
        ("allocator/service.py", "import vgpu.daemon.serve", "vgpu.allocator.service -> vgpu.daemon.serve"),
        ("allocator/core.py", "import torch", "vgpu.allocator.core -> torch"),
    ],
)
def test_a_back_arrow_breaks_a_contract_and_is_named(tmp_path: Path, module: str, back_arrow: str,
                                                     named: str) -> None:
    tree = _copy_tree(tmp_path)
    target = tree / "vgpu" / module
    target.write_text(target.read_text() + f"\n{back_arrow}  # a back-arrow\n")
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert named in result.stdout, result.stdout
