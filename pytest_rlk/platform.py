"""Hardware detection -> :class:`PlatformInfo` (platform tag h100/h200/a100/gb200/other-gpu/cpu)."""
from __future__ import annotations

import functools
import glob
import importlib.util
import os
import platform as py_platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from pytest_rlk.schema import DeviceInfo, PlatformInfo

# Device-name substrings -> tag. GB200 is checked before B200/H200-like names that share letters.
_NAME_TAGS: tuple[tuple[str, str], ...] = (
    ("GB200", "gb200"),
    ("H200", "h200"),
    ("H100", "h100"),
    ("A100", "a100"),
)
# Compute capability majors that, with an otherwise unknown name, still say which family it is.
_CAPABILITY_TAGS = {(8, 0): "a100", (10, 0): "gb200"}
# Hopper parts: H100 has 80/94 GB, H200 141 GB (torch reports ~85e9 and ~150e9 bytes).
_H200_MIN_BYTES = 120e9


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows (often only the
    architecture)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return py_platform.processor() or py_platform.machine() or "unknown CPU"


def tag_for(name: str, capability: tuple[int, int] | None, memory_bytes: int) -> str:
    """Platform tag from the device name, falling back to compute capability and memory."""
    upper = name.upper()
    for needle, tag in _NAME_TAGS:
        if needle in upper:
            return tag
    if capability == (9, 0):  # a Hopper with an unusual name (e.g. a MIG or OEM string)
        return "h200" if memory_bytes >= _H200_MIN_BYTES else "h100"
    if capability in _CAPABILITY_TAGS:
        return _CAPABILITY_TAGS[capability]
    return "other-gpu"


@functools.cache  # the driver does not change under a process; NVML init and shutdown cost each call
def _nvml_driver() -> str | None:
    if importlib.util.find_spec("pynvml") is None:
        return None
    import pynvml

    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None  # no NVIDIA driver on this machine: nothing to report


def _nvidia_driver_present() -> bool:
    """Cheap check before importing torch: no NVIDIA driver means no CUDA device."""
    return os.path.exists("/proc/driver/nvidia") or bool(glob.glob("/dev/nvidia[0-9]*"))


_TORCH_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*(None|'([^']*)')", re.MULTILINE)


def torch_cuda_build() -> tuple[bool, str | None] | None:
    """(whether the installed torch is a CUDA build, its CUDA version), read from ``torch/version.py``
    without importing torch; None where that file cannot say."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    match = _TORCH_CUDA.search(text)
    if match is None:
        return None
    return (match.group(1) != "None", match.group(2))


def visible_indices(visible: str | None, count: int, uuids: list[str]) -> list[int] | None:
    """The NVML indices of the devices CUDA shows under ``CUDA_VISIBLE_DEVICES=visible``, in order;
    None where CUDA's own reading is needed (MIG instances, an entry that is neither an index nor a
    ``GPU-`` UUID prefix).

    As torch reads it: unset shows every device, an empty value none; the list stops at its first
    entry that names no device (an index out of range, a negative one, an unknown or ambiguous
    UUID prefix); a device named twice shows none."""
    if visible is None:
        return list(range(count))
    if not visible.strip():
        return []
    shown: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith("GPU-"):
            found = [i for i, u in enumerate(uuids) if u.startswith(entry)]
            if len(found) != 1:
                break
            index = found[0]
        elif entry.isdigit() or (entry[:1] in "+-" and entry[1:].isdigit() and entry[1:]):
            index = int(entry)
            if not 0 <= index < count:
                break
        else:
            return None
        if index in shown:
            return []
        shown.append(index)
    return shown


def _nvml_devices(environ: Mapping[str, str]) -> list[DeviceInfo] | None:
    """The devices torch would report, read through NVML, with no torch import and no CUDA
    initialization. Those cost seconds in every pytest process of a GPU host that detects (a run's
    controller, its all-GPU phase, each pytest subprocess a test starts; xdist workers receive the
    platform), for a run that may never touch CUDA. None where NVML cannot answer as torch would:
    no pynvml, a torch whose build cannot be read, MIG, or devices that differ from one another
    (CUDA's order may then differ from NVML's)."""
    build = torch_cuda_build()
    if build is None or importlib.util.find_spec("pynvml") is None:
        return None
    if not build[0]:
        return []  # a CPU build of torch sees no device, whatever the machine has
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        found = []
        for handle in handles:
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            found.append((name.decode() if isinstance(name, bytes) else str(name),
                          uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                          int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), f"{major}.{minor}"))
    except (pynvml.NVMLError, AttributeError):  # AttributeError: a pynvml without one of these calls
        return None
    finally:
        pynvml.nvmlShutdown()
    if len({(name, memory, cap) for name, _, memory, cap in found}) > 1:
        return None
    shown = visible_indices(environ.get("CUDA_VISIBLE_DEVICES"), count, [u for _, u, _, _ in found])
    if shown is None:
        return None
    return [DeviceInfo(index=i, name=found[k][0], memory_bytes=found[k][2], capability=found[k][3])
            for i, k in enumerate(shown)]


def _torch_devices() -> tuple[list[DeviceInfo], str | None]:
    import torch

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(DeviceInfo(index=i, name=props.name, memory_bytes=int(props.total_memory),
                                      capability=f"{props.major}.{props.minor}"))
    return devices, torch.version.cuda


def detect(override: str | None = None) -> PlatformInfo:
    """Detect the CUDA devices; ``override`` replaces the tag (``--rlk-platform``).

    Through torch where it is already imported (it has made its CUDA reading); else, on a machine
    with an NVIDIA driver, through NVML where NVML can answer as torch would (importing torch and
    initializing CUDA cost seconds, in every pytest process and subprocess that detects); else through torch.
    Without a driver there is no device and torch is not imported."""
    devices: list[DeviceInfo] = []
    cuda_version = None
    if "torch" in sys.modules:
        devices, cuda_version = _torch_devices()
    elif _nvidia_driver_present() and importlib.util.find_spec("torch") is not None:
        nvml = _nvml_devices(os.environ)
        if nvml is None:
            devices, cuda_version = _torch_devices()
        else:
            devices, cuda_version = nvml, (torch_cuda_build() or (False, None))[1]
    if not devices:
        tag = "cpu"
        info = PlatformInfo(tag=tag, detected_tag=tag, cuda=cuda_version)
    else:
        first = devices[0]
        major, minor = (int(x) for x in first.capability.split("."))
        memory = min(d.memory_bytes for d in devices)
        tag = tag_for(first.name, (major, minor), memory)
        info = PlatformInfo(
            tag=tag,
            detected_tag=tag,
            device_name=first.name,
            device_count=len(devices),
            memory_bytes=memory,
            capability=first.capability,
            driver=_nvml_driver(),
            cuda=cuda_version,
            devices=devices,
        )
    return with_override(info, override)


def baseline_platform(tag: str, gpus: float) -> str:
    """The baselines directory of a test on ``gpus`` GPUs of a ``tag`` machine: ``tag`` for one
    GPU, ``<tag>x<k>`` for a test that needs k > 1 (its ``gpus(k)`` marker). A multi-GPU test's
    figures depend on its topology (the collectives' reduction order, the link between the GPUs),
    so they are kept apart from the single-GPU figures of the same device, which every GPU of a
    bigger machine reproduces."""
    return tag if gpus <= 1 else f"{tag}x{int(gpus)}"


def with_override(info: PlatformInfo, tag: str | None) -> PlatformInfo:
    """``--rlk-platform TAG``: replace the tag; ``cpu`` also hides the GPUs from the marker
    checks (``gpu``, ``gpus(n)``, ``gpu_mem(gb)``), so a GPU machine told it is a CPU one selects
    and skips exactly as a CPU machine does. ``detected_tag`` keeps what was found."""
    if not tag:
        return info
    if tag == "cpu":
        return PlatformInfo(tag="cpu", detected_tag=info.detected_tag, driver=info.driver, cuda=info.cuda)
    return info.model_copy(update={"tag": tag})
