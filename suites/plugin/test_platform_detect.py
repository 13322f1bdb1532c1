"""Platform detection: through NVML on a GPU host (no torch import, no CUDA initialization), as torch
would report it; through torch where NVML cannot answer as torch would."""
from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import types

import pytest
from rlk_plugin_testing import REPO_ROOT, checkout_pythonpath

from pytest_rlk import platform

UUIDS = ["GPU-a1b2", "GPU-c3d4"]


@pytest.mark.parametrize(("visible", "shown"), [
    (None, [0, 1]),           # unset: every device
    ("", []),                 # empty: none
    ("1,0", [1, 0]),          # in the order given
    ("1,5,0", [1]),           # stops at the first index out of range
    ("0,-1,1", [0]),          # and at a negative one
    ("0,0", []),              # a device named twice shows none
    ("GPU-c3,0", [1, 0]),     # UUID prefixes and indices
    ("GPU-,1", []),           # an ambiguous prefix names no device
    ("MIG-x", None),          # MIG: CUDA's own reading
    ("1gpu", None),           # neither an index nor a UUID: CUDA's own reading
])
def test_visible_devices_read_as_torch_reads_them(visible, shown):
    assert platform.visible_indices(visible, 2, UUIDS) == shown


def test_the_torch_build_is_read_without_importing_it():
    build = platform.torch_cuda_build()
    torch = pytest.importorskip("torch")
    assert build == (torch.version.cuda is not None, torch.version.cuda)


class _Memory:
    def __init__(self, total: int) -> None:
        self.total = total


def _stand_in_nvml(devices: list[tuple[str, str, int, tuple[int, int]]]) -> types.ModuleType:
    """A stand-in for the NVIDIA driver's NVML (pynvml): this host may have no GPU."""
    nvml = types.ModuleType("pynvml")
    nvml.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: len(devices)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: devices[h][0]
    nvml.nvmlDeviceGetUUID = lambda h: devices[h][1]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: _Memory(devices[h][2])
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: devices[h][3]
    return nvml


H100 = ("NVIDIA H100 80GB HBM3", 85_520_809_984, (9, 0))


@pytest.fixture
def cuda_torch(monkeypatch):
    monkeypatch.setattr(platform, "torch_cuda_build", lambda: (True, "13.0"))


def test_nvml_gives_the_visible_devices(monkeypatch, cuda_torch):
    name, memory, cap = H100
    monkeypatch.setitem(sys.modules, "pynvml", _stand_in_nvml([(name, UUIDS[0], memory, cap), (name, UUIDS[1], memory, cap)]))
    (device,) = platform._nvml_devices({"CUDA_VISIBLE_DEVICES": "1"})
    assert (device.index, device.name, device.memory_bytes, device.capability) == (0, name, memory, "9.0")
    assert len(platform._nvml_devices({})) == 2


def test_nvml_hands_unlike_devices_and_a_cpu_torch_over(monkeypatch, cuda_torch):
    name, memory, cap = H100
    mixed = [(name, UUIDS[0], memory, cap), ("NVIDIA L4", UUIDS[1], 24_000_000_000, (8, 9))]
    monkeypatch.setitem(sys.modules, "pynvml", _stand_in_nvml(mixed))
    assert platform._nvml_devices({}) is None  # CUDA's order may differ from NVML's: torch answers
    assert platform._nvml_devices({"CUDA_VISIBLE_DEVICES": "MIG-1"}) is None
    monkeypatch.setattr(platform, "torch_cuda_build", lambda: (False, None))
    assert platform._nvml_devices({}) == []  # a CPU build of torch sees no device


DETECT = ("import json, sys; from pytest_rlk import platform; info = platform.detect(); "
          "print(json.dumps({'torch_imported': 'torch' in sys.modules, 'info': info.model_dump(mode='json')}))")


@pytest.mark.skipif(not platform._nvidia_driver_present(), reason="the NVML path needs an NVIDIA driver; this host has none")
def test_on_a_gpu_host_nvml_reports_what_torch_reports():
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(os.environ.get("PYTHONPATH"))}
    done = subprocess.run([sys.executable, "-c", DETECT], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          check=True, timeout=120)
    seen = json.loads(done.stdout)
    assert not seen["torch_imported"]  # detection did not pay for torch and CUDA
    devices, cuda = platform._torch_devices()
    info = seen["info"]
    assert (info["tag"], info["device_count"], info["cuda"]) == (platform.detect().tag, len(devices), cuda)
    assert [(d["name"], d["capability"]) for d in info["devices"]] == [(d.name, d.capability) for d in devices]
    # NVML's total counts memory that CUDA keeps for itself (about 0.5 GB on an H100)
    assert all(abs(d["memory_bytes"] - t.memory_bytes) < 2e9 for d, t in zip(info["devices"], devices))
