"""A plan priced by what ran: the rate scaled by a job's measured throughput (``calibrate``), and
the overheads a run measured on the box in place of the assumed ones (``use_measured_overhead``)."""

from __future__ import annotations

from dataclasses import replace

from engine.planner.report import PlanReport
from engine.planner.workload import HARDWARE_RANGES, Hardware


def use_measured_overhead(report: PlanReport, *, overhead_s: float) -> PlanReport:
    """The report priced with the overhead a run measured on the box (``measured_overhead``)
    instead of the assumed terms: ``total_s`` its steps plus that, ``estimate`` ``"measured"``.

    Raises:
        ValueError: a negative or non-finite overhead.
    """
    if not 0 <= overhead_s < float("inf"):
        raise ValueError(f"overhead_s={overhead_s!r} must be a finite number of seconds >= 0")
    total = report.eta_s + overhead_s if report.eta_s is not None and report.total_s is not None else None
    besides = {"measured_s": overhead_s, "total_s": overhead_s}
    return replace(report, overheads=besides, total_s=total, estimate="measured")


def calibrate(hardware: Hardware, *, predicted_tokens_per_s: float, measured_tokens_per_s: float) -> Hardware:
    """The hardware with its efficiency scaled so a past job's prediction matches its measurement
    (kept within ``HARDWARE_RANGES["efficiency"]``; past either end, the rate is scaled instead,
    within ``HARDWARE_RANGES["gpu_tflops"]``: a small model's steps are mostly fixed costs, far
    slower than its FLOPs at any efficiency).

    Raises:
        ValueError: a non-positive throughput.
    """
    if not (predicted_tokens_per_s > 0 and measured_tokens_per_s > 0):
        raise ValueError(
            "throughputs must be positive "
            f"(predicted {predicted_tokens_per_s!r}, measured {measured_tokens_per_s!r})"
        )
    scaled = hardware.efficiency * measured_tokens_per_s / predicted_tokens_per_s
    low, high = HARDWARE_RANGES["efficiency"]
    if scaled < low:
        tflops = max(HARDWARE_RANGES["gpu_tflops"][0], hardware.gpu_tflops * scaled / low)
        return replace(hardware, efficiency=low, gpu_tflops=tflops)
    if scaled <= high:
        return replace(hardware, efficiency=scaled)
    # faster than the peak assumed (a CPU host plans at efficiency 1): the rate itself goes up
    tflops = min(HARDWARE_RANGES["gpu_tflops"][1], hardware.gpu_tflops * scaled / high)
    return replace(hardware, efficiency=high, gpu_tflops=tflops)
