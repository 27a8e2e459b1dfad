"""Where the service runs its models: the onnxruntime execution providers of a device
setting (``auto``, ``cpu``, ``cuda``) or of an explicit providers list. Torch-free and
cheap to import (onnxruntime is imported when providers are chosen); the settings check
their device/providers combination here, the app chooses its providers here.

``onnxruntime.get_available_providers()`` lists every provider compiled in: the
onnxruntime-gpu package lists CUDAExecutionProvider on a laptop without CUDA too, and a
session asked for it there logs two errors and a warning before it falls back to the
CPU. So the CUDA provider is asked for only when it can load (``cuda_unavailable``), or
when the operator lists it in ``providers``."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..settings import CPU, CUDA, DEVICES, device_conflict


def available_providers() -> list[str]:
    """The providers compiled into the installed onnxruntime (not: those that can load)."""
    import onnxruntime as ort

    return list(ort.get_available_providers())


def _library(stem: str, major: str | None = None) -> str:
    """A shared library's file name on this platform: ``libSTEM.so[.MAJOR]`` (Linux),
    ``STEM64_MAJOR.dll`` / ``STEM.dll`` (Windows)."""
    if sys.platform == "win32":
        return f"{stem}64_{major}.dll" if major else f"{stem}.dll"
    return f"lib{stem}.so.{major}" if major else f"lib{stem}.so"


def cuda_provider_library() -> Path:
    """onnxruntime-gpu's CUDA provider library, which onnxruntime loads from its own
    ``capi`` folder when a session asks for the CUDA provider."""
    import onnxruntime as ort

    return Path(ort.__file__).parent / "capi" / _library("onnxruntime_providers_cuda")


def _cuda_major() -> list[str]:
    """The CUDA major version onnxruntime was built for (onnxruntime-gpu records it),
    else the ones onnxruntime-gpu has been built for (13 since 1.24, 12 before)."""
    import onnxruntime as ort

    built = str(getattr(ort, "cuda_version", "") or "").split(".")[0]
    return [built] if built.isdigit() else ["13", "12"]


@functools.cache
def _preload_nvidia_wheels() -> None:
    """onnxruntime-gpu's ``preload_dlls()``: loads the CUDA and cuDNN libraries of NVIDIA's
    pip wheels (``nvidia-*``), which are not on the loader's search path, so that the
    provider library finds them. Quiet: it prints a line per library it cannot find."""
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)
    if preload is None:  # before onnxruntime 1.21, or the CPU package's stub
        return
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(Exception):
            preload()


def _open(library: str) -> None:
    """dlopen LIBRARY (a path or a file name the loader searches for); once more after
    ``_preload_nvidia_wheels`` if it fails. OSError (dlerror's line) when it cannot."""
    try:
        ctypes.CDLL(library)
    except OSError:
        _preload_nvidia_wheels()
        ctypes.CDLL(library)


@functools.cache
def cuda_unavailable() -> str | None:
    """Why onnxruntime's CUDA provider cannot run here, in one line (None: it can).

    The check does what onnxruntime would do, without its error lines, with ctypes (no
    torch, nothing printed), once per process. onnxruntime dlopens its CUDA provider
    library, whose dependencies are the CUDA libraries (cudart, cuBLAS, cuRAND) and the
    driver's libcuda: we dlopen the same file, after libonnxruntime_providers_shared
    loaded global as onnxruntime loads it (the provider needs a symbol of it; importing
    onnxruntime-gpu has loaded it already). Where a library is not on the loader's path,
    NVIDIA's pip wheels may hold it: ``onnxruntime.preload_dlls()`` loads those, and we
    try once more. The provider also needs cuDNN 9 (it loads it at run time, so the dlopen
    does not check it) and a device: cudaGetDeviceCount of the CUDA runtime the provider
    loaded (an error without a driver; 0 where CUDA_VISIBLE_DEVICES hides the devices)."""
    import onnxruntime as ort

    if CUDA not in available_providers():
        package = getattr(ort, "package_name", "onnxruntime")
        return f"{package} {ort.__version__} has no {CUDA}; onnxruntime-gpu has it"
    library = cuda_provider_library()
    if not library.is_file():
        return f"onnxruntime's CUDA provider library {str(library)!r} is missing"
    shared = library.with_name(library.name.replace("_cuda", "_shared"))
    try:
        if shared.is_file():
            ctypes.CDLL(str(shared), mode=getattr(ctypes, "RTLD_GLOBAL", 0))
        _open(str(library))
    except OSError as error:
        return f"cannot load {library.name}: {_one_line(error)}"
    cudnn = _library("cudnn", "9")
    try:
        _open(cudnn)
    except OSError as error:
        return f"cannot load {cudnn} (cuDNN 9, which the CUDA provider needs): " \
               f"{_one_line(error)}"
    return _no_device()


def _no_device() -> str | None:
    """Why the CUDA runtime sees no device (None: it sees one)."""
    error: OSError | None = None
    for major in _cuda_major():
        try:
            cudart = ctypes.CDLL(_library("cudart", major))
            break
        except OSError as e:
            error = e
    else:
        return f"cannot load the CUDA runtime: {_one_line(error)}"
    count = ctypes.c_int(0)
    status = cudart.cudaGetDeviceCount(ctypes.byref(count))
    if status != 0:
        cudart.cudaGetErrorString.restype = ctypes.c_char_p
        message = (cudart.cudaGetErrorString(status) or b"").decode(errors="replace")
        return f"cudaGetDeviceCount: {message or f'error {status}'}"
    if count.value < 1:
        return "cudaGetDeviceCount: 0 devices (CUDA_VISIBLE_DEVICES may hide them)"
    return None


def _one_line(error: object) -> str:
    return " ".join(str(error).split())


@dataclass(frozen=True)
class ProviderChoice:
    """The providers the inference sessions are created with, and why (for the log line)."""

    providers: list[str]
    why: str

    def __str__(self) -> str:
        return f"{', '.join(self.providers)}; {self.why}"


def select_providers(requested: list[str] | None = None,
                     device: str = "auto") -> ProviderChoice:
    """The execution providers for DEVICE, or the REQUESTED list (each must be available
    in this onnxruntime; it is used as given, checked only against the device).

    auto: CUDA then CPU when the CUDA provider can load here (``cuda_unavailable``),
    else CPU; cpu: CPU only; cuda: CUDA then CPU, or ValueError saying why CUDA cannot
    be had (the service must not serve on the CPU when it was asked for a GPU)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    conflict = device_conflict(device, requested or [])
    if conflict:
        raise ValueError(conflict)
    available = available_providers()
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise ValueError(f"providers {missing} are not available in this onnxruntime "
                             f"(available: {available})")
    if device == "cpu":
        return ProviderChoice(list(requested or [CPU]), "device cpu")
    if device == "cuda":
        reason = cuda_unavailable()
        if reason is not None:
            raise ValueError(f"device cuda, but CUDA cannot be used here: {reason} (device "
                             f"auto or cpu would serve on the CPU)")
        return ProviderChoice(list(requested or [CUDA, CPU]), "device cuda")
    if requested:
        return ProviderChoice(list(requested), "providers as set")
    reason = cuda_unavailable()
    if reason is None:
        return ProviderChoice([CUDA, CPU], "device auto, CUDA can load")
    return ProviderChoice([CPU] if CPU in available else available,
                          f"device auto, no CUDA here: {reason}")
