"""Is there an MLX here that can run a session? Checked in the notebook's process at start.

On Linux the plain ``mlx`` wheel has no backend: the compute library ``libmlx.so``
comes from ``mlx-cpu`` (``mlx[cpu]``), ``mlx-cuda-12`` (``mlx[cuda12]``) or ``mlx-cuda-13``
(``mlx[cuda13]``), which mlx_nbdist's extras ``cpu``, ``cuda`` and ``cuda13`` install. Without
one, ``import mlx.core`` fails with ``libmlx.so: cannot open shared object file``. On
macOS the plain wheel pulls ``mlx-metal``. :func:`check_mlx` turns each of these cases
into a :class:`~mlx_nbdist.errors.SetupError` that says which platform it saw and the
``pip install`` that fixes it.

Importing this module does not import ``mlx.core`` (``import mlx_nbdist`` stays light);
:func:`check_mlx` does.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata

from .enums import TextEnum
from .errors import SetupError

#: the lowest MLX mlx_nbdist works with (``distributed.is_available(backend)`` came in
#: 0.30.1, ``FullyShardedModule`` in 0.32.1); pyproject.toml declares the same floor
MIN_MLX = (0, 32, 1)

#: the Linux distributions that ship ``mlx/lib/libmlx.so``, and the extra of
#: mlx_nbdist that installs each
LINUX_BUILDS = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda", "mlx-cuda-13": "cuda13"}


class OS(TextEnum):
    """The operating system as far as choosing an MLX build goes."""

    LINUX = "Linux"
    MACOS = "macOS"
    OTHER = "other"


class MLXBuildWarning(UserWarning):
    """More than one MLX build (CPU, CUDA 12, CUDA 13) is installed side by side."""


@dataclass(frozen=True)
class Platform:
    """What :func:`check_mlx` saw: the OS, the CPU architecture, an NVIDIA driver."""

    os: OS
    machine: str
    nvidia: bool

    def describe(self) -> str:
        gpu = ", NVIDIA driver present" if self.nvidia else ""
        if self.os is OS.OTHER:
            return f"{sys.platform} {self.machine}"
        return f"{self.os} {self.machine}{gpu}"


def detect_platform() -> Platform:
    """This machine's :class:`Platform` (NVIDIA: ``nvidia-smi`` or the kernel driver)."""
    if sys.platform.startswith("linux"):
        os_ = OS.LINUX
    elif sys.platform == "darwin":
        os_ = OS.MACOS
    else:
        os_ = OS.OTHER
    nvidia = os_ is OS.LINUX and (
        shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia/version")
    )
    return Platform(os_, platform.machine() or "unknown", nvidia)


def install_hint(p: Platform) -> str:
    """The ``pip install`` that gives platform ``p`` an MLX with a backend."""
    cuda = (
        "pip install 'mlx_nbdist[cuda]' (CUDA 12) or 'mlx_nbdist[cuda13]' (CUDA 13), "
        "in an environment without mlx-cpu"
    )
    if p.os is OS.LINUX and p.nvidia:
        return f"for the GPU {cuda}; for the CPU pip install 'mlx_nbdist[cpu]'"
    if p.os is OS.LINUX:
        return f"pip install 'mlx_nbdist[cpu]' (with an NVIDIA GPU: {cuda})"
    if p.os is OS.MACOS:
        if p.machine != "arm64":
            return "MLX runs on Apple silicon (arm64) Macs; this Python is not an arm64 one"
        return "pip install --force-reinstall mlx (plain mlx runs on Metal; no extra needed)"
    return "MLX runs on Linux (extras cpu, cuda, cuda13) and on Apple silicon Macs"


def installed_builds() -> list[str]:
    """The Linux MLX builds installed here (``mlx-cpu``, ``mlx-cuda-12``, ``mlx-cuda-13``)."""
    found = []
    for dist in LINUX_BUILDS:
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):  # 0.33.0rc1: stop at the pre-release tag
            break
    return tuple(parts)


def check_mlx(p: Platform | None = None) -> None:
    """Raise :class:`SetupError` unless MLX imports here with a distributed backend.

    Covers: MLX not installed; an MLX older than :data:`MIN_MLX`; the bare Linux
    wheel without a build (``import mlx.core`` fails); an MLX whose
    ``distributed.is_available()`` is False. Warns (:class:`MLXBuildWarning`) when
    several Linux builds are installed together: they overwrite each other's
    ``libmlx.so``.

    Args:
        p: the platform to name in the message (default: :func:`detect_platform`).
    """
    p = p or detect_platform()
    where = f"detected {p.describe()}"
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        raise SetupError(f"MLX is not installed ({where}): {install_hint(p)}") from None
    need = ".".join(map(str, MIN_MLX))
    if _version_tuple(version) < MIN_MLX:
        raise SetupError(
            f"mlx {version} is installed but mlx_nbdist needs mlx>={need} ({where}): "
            f"pip install -U 'mlx>={need}'; {install_hint(p)}"
        )
    builds = installed_builds() if p.os is OS.LINUX else []
    if len(builds) > 1:
        warnings.warn(
            f"{' and '.join(builds)} are installed together and overwrite each other's "
            "mlx/lib/libmlx.so (the last installed wins; uninstalling one deletes it): "
            f"keep one: pip uninstall -y {' '.join(builds)}, then pip install "
            "'mlx_nbdist[EXTRA]' with EXTRA one of cpu, cuda, cuda13",
            MLXBuildWarning,
            stacklevel=2,
        )
    try:
        import mlx.core as mx
    except ImportError as e:
        missing = (
            f"mlx {version} is installed without a build for this machine "
            "(no mlx-cpu, mlx-cuda-12 or mlx-cuda-13)"
            if p.os is OS.LINUX and not builds
            else f"mlx {version} is installed but does not load"
        )
        raise SetupError(
            f"{missing} ({where}): import mlx.core failed with {e}. Fix: {install_hint(p)}"
        ) from None
    if not mx.distributed.is_available():
        raise SetupError(
            f"this MLX (mlx {mx.__version__}) has no distributed backend ({where}). "
            f"Fix: {install_hint(p)}"
        )
