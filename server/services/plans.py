"""Plans: a job request as the planner's workload, the training data's token counts, and the
hardware the workers report."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from engine.planner import Hardware, Workload
from server.services import gpus, jobs
from server.tables import Dataset

NOT_READ = "(not read: planning only)"  # the training file and output folder a plan never touches
TOKEN_COUNT_ROWS = 20_000  # rows a plan tokenizes (the first ones): their lengths stand for all
_CACHE_SIZE = 16  # datasets x tokenizers whose counts are kept
_TOKENIZERS = 4  # tokenizers kept loaded
_lengths: dict[tuple[str, str, str], list[int]] = {}
_tokenizers: dict[str, Any] = {}
_lock = threading.Lock()  # one tokenizer load and one count at a time (transformers' first import)


def token_lengths(dataset: Dataset, *, tokenizer_folder: Path, file: Path | None = None) -> list[int]:
    """Each of the dataset's first ``TOKEN_COUNT_ROWS`` rows' tokens as the run encodes them with
    this tokenizer (chat template included, before truncation); counted once per dataset file and
    tokenizer, then remembered by this process. A preference row counts both its sequences, the
    prompt with the preferred answer and with the rejected one, one after the other
    (``encode_pair``, as a DPO run batches them)."""
    from engine.data.encode import encode, encode_pair
    from engine.model.loading import load_tokenizer
    from server.services.datasets import first_examples

    key = (dataset.id, dataset.sha256, str(tokenizer_folder))
    with _lock:
        if key in _lengths:
            return _lengths[key]
        tokenizer = _tokenizers.get(str(tokenizer_folder))
        if tokenizer is None:
            while len(_tokenizers) >= _TOKENIZERS:
                _tokenizers.pop(next(iter(_tokenizers)))
            tokenizer = _tokenizers[str(tokenizer_folder)] = load_tokenizer(tokenizer_folder)
        big = 1 << 30  # no truncation: the planner cuts at the run's max_length
        lengths: list[int] = []
        # file: the dataset's local copy (``datasets.local_file``); once counted, not needed
        for ex in first_examples(dataset, TOKEN_COUNT_ROWS, file=file or Path(dataset.path)):
            if ex.rejected is not None:
                pair = encode_pair(ex, tokenizer, big)
                lengths += [pair.chosen.length, pair.rejected.length]
            else:
                lengths.append(encode(ex, tokenizer, big).length)
        while len(_lengths) >= _CACHE_SIZE:
            _lengths.pop(next(iter(_lengths)))
        _lengths[key] = lengths
        return lengths


def workload(
    *,
    request: dict[str, Any],
    num_sequences: int | None,
    on_gpu: bool = True,
    token_lengths: Sequence[int] | None = None,
    num_validation: int | None = None,
) -> Workload:
    """The workload of a job request, through the TrainConfig ``POST /api/jobs`` would build.

    Args:
        request: the request's fields (``JobBase`` and ``base_model``), as a dict.
        num_sequences: the training dataset's rows (a DPO job's: pairs), when one is named (steps
            from ``hyper.epochs``; a DPO job's reference pass covers them).
        on_gpu: plan GPU workers (``compute_dtype: auto`` is bfloat16) or a CPU host (float32).
        token_lengths: the training rows' token counts (``token_lengths``), when known.
        num_validation: the validation dataset's rows, when one is named (a DPO job's reference
            pass covers them too).

    Raises:
        ValueError: an invalid section; a ``ConfigError`` whose ``field`` is the dotted field name.
    """
    config = jobs.build_config(
        request=request,
        model_path=request.get("base_model") or "demo",
        train_path=NOT_READ,
        validation_path=None,
        output_dir=Path(NOT_READ),
    )
    return Workload.from_train_config(
        config,
        on_gpu=on_gpu,
        num_sequences=num_sequences,
        token_lengths=token_lengths,
        num_validation=num_validation,
    )


def hardware(
    session: Session, *, given: dict[str, Any], stale_after: float, host: str | None = None
) -> Hardware:
    """The given hardware; what it leaves out is read off the workers' telemetry when one has GPUs.

    When workers are online and none reports a GPU, and the caller names no GPUs, the box is a CPU
    host (``Hardware.cpu_host``): one CPU worker, as ``devices: "auto"`` runs there.

    Args:
        given: ``Hardware`` fields the caller set (GPU count and memory, rate, link, host RAM).
        stale_after: seconds after which a worker that stopped sampling counts as offline.
        host: the worker host to plan for (``placement.host``); default: the online host with the
            most GPUs. A job runs on one host's GPUs: several hosts' GPUs never add up.
    """
    fields = dict(given)
    detected = []
    picked = gpus.plan_host(session, stale_after=stale_after, host=host)
    hosts = [picked] if picked is not None else []
    several = len({h["hostname"] for h in gpus.hosts(session, stale_after=stale_after) if h["online"]}) > 1
    if picked is not None and (host is not None or several):
        detected.append(f"host {picked['hostname']}")
    with_gpus = [h for h in hosts if h["gpu"]]
    if with_gpus:
        devices = with_gpus[0]["devices"]
        if "num_gpus" not in fields:
            fields["num_gpus"] = len(devices)
            detected.append("GPU count")
        memory = [d["memory_total"] for d in devices if d.get("memory_total")]
        if memory and "gpu_memory_gb" not in fields:
            fields["gpu_memory_gb"] = min(memory) / 1e9
            detected.append("GPU memory")
    if hosts and "host_ram_gb" not in fields and hosts[0]["cpu"].get("memory_total"):
        fields["host_ram_gb"] = hosts[0]["cpu"]["memory_total"] / 1e9
        detected.append("host RAM")
    gpu_named = {"num_gpus", "gpu_memory_gb"} & set(given)
    if hosts and not with_gpus and not gpu_named:
        cpu = hosts[0]["cpu"]
        cores = int(cpu.get("cores") or 1)
        detected.append("no GPU")
        if cpu.get("cores"):
            detected.append("CPU cores")
        base = Hardware.cpu_host(cores=cores, ram_gb=fields.get("host_ram_gb"), detected=tuple(detected))
        rates = {k: v for k, v in fields.items() if k in ("gpu_tflops", "efficiency", "link_gb_s")}
        return replace(base, **rates)
    return Hardware(**fields, detected=tuple(detected))
