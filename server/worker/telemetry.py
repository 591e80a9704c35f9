"""Device telemetry: NVML per GPU (utilization, memory, temperature, power), psutil for the host."""

from __future__ import annotations

import contextlib
from typing import Any

import psutil


def count_gpus() -> int:
    """The GPUs NVML sees on this host (0 without NVML): for the worker's placement queues."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: a CPU host
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class Sampler:
    """Samples the host's GPUs through NVML; on a host without NVML it says "no GPU"."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.reason = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception as exc:  # no driver, no library, or no device: a CPU host
            self.reason = f"no GPU on this host (NVML unavailable: {type(exc).__name__})"
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement

    def sample(self) -> tuple[list[dict[str, Any]], dict[str, float], str]:
        """(devices, cpu, message) now."""
        memory = psutil.virtual_memory()
        cpu = {
            "utilization": float(psutil.cpu_percent(interval=None)),
            "memory_used": float(memory.used),
            "memory_total": float(memory.total),
            "cores": float(psutil.cpu_count() or 0),
        }
        if self.nvml is None:
            return [], cpu, self.reason
        devices = [self._device(i) for i in range(self.nvml.nvmlDeviceGetCount())]
        message = f"{len(devices)} GPU(s)" if devices else "no GPU on this host (NVML found no device)"
        return devices, cpu, message

    def _device(self, index: int) -> dict[str, Any]:
        nv = self.nvml
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        out: dict[str, Any] = {"index": index, "name": str(nv.nvmlDeviceGetName(handle))}
        readings = {
            "utilization": lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu),
            "memory_used": lambda: int(nv.nvmlDeviceGetMemoryInfo(handle).used),
            "memory_total": lambda: int(nv.nvmlDeviceGetMemoryInfo(handle).total),
            "temperature": lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
            "power_w": lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        }
        for key, read in readings.items():
            try:
                out[key] = read()
            except Exception:  # a reading this device does not support stays empty
                out[key] = None
        return out

    def close(self) -> None:
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
