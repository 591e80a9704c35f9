"""Plans: a job request as the planner's workload, the training data's token counts, the hardware
the workers report, the job that measured this box, and the whole plan of ``POST /api/plan``.

A plan's ETA is the run end to end (``total_s``). Where jobs of the same base model, objective
and tuning ran to their end (in one go) on the host planned, the latest ones' measured times price
the plan (``estimate: "measured"``): the median of their steady tokens/s over their own plans'
scales the rate (``calibrate``), and the median of their wall times less their steady steps is
the overhead (start, load, data, warm-up, validation, checkpoints). Without any, the planner's
assumptions do (``estimate: "planner"``).

A job on several hosts (``placement.hosts``: N, or "auto") is planned on the boxes and the link
``plan_hosts`` picks: each box its share of the batch, the gradient exchange priced in."""

from __future__ import annotations

import json
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine import ConfigError, TrainConfig
from engine.planner import (
    HARDWARE_RANGES,
    Hardware,
    Shape,
    Workload,
    calibrate,
    image_stats,
    measured_overhead,
    plan_job,
    use_measured_overhead,
)
from server.kinds import JobStatus
from server.schemas import PlanRequest
from server.services import datasets, gpus, jobs, methods, models, tokenizers
from server.services.failures import Conflict, Invalid, NotFound
from server.services.plan_hosts import planned_hosts
from server.settings import Settings
from server.storage import Storage
from server.tables import Dataset, Job, Worker

NOT_READ = "(not read: planning only)"  # the training file and output folder a plan never touches
TOKEN_COUNT_ROWS = 20_000  # rows a plan tokenizes (the first ones): their lengths stand for all
IMAGE_ROWS = 1_000  # rows whose images a VLM's plan reads (the first ones): they stand for all
_CACHE_SIZE = 16  # datasets x tokenizers whose counts are kept
_lengths: dict[tuple[str, str, str], list[int]] = {}
_images: dict[tuple[str, str], tuple[list[int], list[tuple[int, int]]]] = {}  # by dataset and file
_counting = threading.Lock()  # one count at a time
REFERENCE_CANDIDATES = 50  # the latest finished jobs of the host a plan looks through for its references
REFERENCE_RUNS = (
    5  # the latest runs of the job's kind on the box whose measured times (their medians) price it
)
_measured: dict[str, Measured] = {}  # finished jobs' measurements, by id
_ratios: dict[tuple[str, Hardware], float] = {}  # finished jobs' measured over planned rates, by box


def token_lengths(
    dataset: Dataset, *, tokenizer_folder: Path, file: Path | None = None, images_dir: Path | None = None
) -> list[int]:
    """Each of the dataset's first ``TOKEN_COUNT_ROWS`` rows' tokens as the run encodes them with
    this tokenizer (chat template included, before truncation); counted once per dataset file and
    tokenizer, then remembered by this process. A preference row counts both its sequences, the
    prompt with the preferred answer and with the rejected one, one after the other
    (``encode_pair``, as a DPO run batches them); a prompt row its prompt (``encode_prompt_row``:
    a GRPO run samples the completion). A vision-language model's rows go through its processor,
    their image tokens counted (their images read from ``images_dir``; only the first
    ``IMAGE_ROWS`` of a dataset with images: each image is decoded)."""
    from engine.data import encode_example, encode_pair, encode_prompt_row
    from server.services.datasets import first_examples

    key = (dataset.id, dataset.sha256, str(tokenizer_folder))
    with _counting:
        if key in _lengths:
            return _lengths[key]
        processor = tokenizers.load_processor(tokenizer_folder)
        tokenizer = processor or tokenizers.load(tokenizer_folder)
        big = 1 << 30  # no truncation: the planner cuts at the run's max_length
        lengths: list[int] = []
        rows = IMAGE_ROWS if processor is not None and images_dir is not None else TOKEN_COUNT_ROWS
        # file: the dataset's local copy (``datasets.local_file``); once counted, not needed
        for ex in first_examples(dataset, rows, file=file or Path(dataset.path), images_dir=images_dir):
            if ex.rejected is not None:
                pair = encode_pair(ex, tokenizer, big)
                lengths += [pair.chosen.length, pair.rejected.length]
            elif ex.fields is not None:  # a prompt row
                lengths.append(encode_prompt_row(ex, tokenizer, big).length)
            else:
                lengths.append(encode_example(ex, tokenizer, big).length)
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
    images: tuple[list[int], list[tuple[int, int]]] | None = None,
    home: Path,
) -> Workload:
    """The workload of a job request, through the TrainConfig ``POST /api/jobs`` would build.

    Args:
        request: the request's fields (``JobBase`` and ``base_model``), as a dict.
        home: the service's home (``jobs.build_config`` checks a ``file:`` tracking URI against it).
        num_sequences: the training dataset's rows (a DPO job's: pairs), when one is named (steps
            from ``hyper.epochs``; a DPO job's reference pass covers them).
        on_gpu: plan GPU workers (``compute_dtype: auto`` is bfloat16) or a CPU host (float32).
        token_lengths: the training rows' token counts (``token_lengths``), when known.
        num_validation: the validation dataset's rows, when one is named (a DPO job's reference
            pass covers them too).
        images: a VLM job's training rows' image counts and image sizes (``image_rows``).

    Raises:
        ValueError: an invalid section; a ``ConfigError`` whose ``field`` is the dotted field name.
    """
    config = jobs.build_config(
        request=request,
        model_path=request.get("base_model") or "demo",
        train_path=NOT_READ,
        validation_path=None,
        output_dir=Path(NOT_READ),
        home=home,
    )
    return Workload.from_train_config(
        config,
        on_gpu=on_gpu,
        num_sequences=num_sequences,
        token_lengths=token_lengths,
        num_validation=num_validation,
        image_counts=images[0] if images else None,
        image_sizes=images[1] if images else None,
    )


def image_rows(
    dataset: Dataset, *, file: Path, images_dir: Path | None
) -> tuple[list[int], list[tuple[int, int]]]:
    """The image count of each of the dataset's first ``IMAGE_ROWS`` rows and the (width,
    height) of their images (``engine.planner.image_stats``); read once per dataset file, then
    remembered by this process.

    Raises:
        ValueError: a row that changed on disk, an image not in ``images_dir``.
    """
    from server.services.datasets import first_examples

    key = (dataset.id, dataset.sha256)
    if key not in _images:
        rows = first_examples(dataset, IMAGE_ROWS, file=file, images_dir=images_dir)
        stats = image_stats([r.data for r in ex.images if r.data is not None] for ex in rows)
        while len(_images) >= _CACHE_SIZE:
            _images.pop(next(iter(_images)))
        _images[key] = stats
    return _images[key]


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
    if hosts and hosts[0]["cpu"].get("cores"):  # GRPO samples on the host's cores
        fields["host_cores"] = int(hosts[0]["cpu"]["cores"])
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


def model_config(name: str, *, settings: Settings) -> dict[str, Any]:
    """The config.json of the base model ``name`` (the demo's ships with the engine).

    Raises:
        NotFound: no such base model (naming ``base_model``).
        Invalid: a model that cannot be fine-tuned.
    """
    found = models.find(name, settings.models_dir, settings.hf_cache_dir)
    if found is None:
        raise NotFound(f"no base model {name!r} (see GET /api/models)", param="base_model")
    if not found.supported:
        reason = f"base model {name!r} cannot be fine-tuned: {found.unsupported_reason}"
        raise Invalid("unsupported_model", reason, param="base_model")
    if found.path is None:  # the demo before its first preparation: its config ships with the engine
        from engine.model import demo_config

        return demo_config()
    return dict(json.loads((found.path / "config.json").read_text()))


def processor_settings(name: str, *, settings: Settings) -> dict[str, Any] | None:
    """The image processor's settings of the base model ``name`` (its folder's
    ``preprocessor_config.json``): what an image costs a VLM; None where it has none (a text
    model, or a folder without one: the family's defaults)."""
    folder = models.usable_folder(name, settings.models_dir, settings.hf_cache_dir)
    file = folder / "preprocessor_config.json" if folder is not None else None
    try:
        found = json.loads(file.read_text()) if file is not None and file.is_file() else None
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _dataset(session: Session, dataset_id: str | None, *, param: str) -> Dataset | None:
    if dataset_id is None:
        return None
    dataset = datasets.get_dataset(session, dataset_id=dataset_id)
    if dataset is None:
        raise NotFound(f"no dataset {dataset_id!r}", param=param)
    return dataset


def _token_lengths(
    dataset: Dataset | None, request: PlanRequest, *, settings: Settings, storage: Storage
) -> list[int] | None:
    """The training rows' token counts through the base model's tokenizer; None without a
    dataset, for a plan of a bare config.json, before the model's folder is ready (the demo before
    its preparation), or for a dataset the job's method does not train on (``POST /api/jobs``
    refuses that job: preference pairs are the preference methods' alone, prompts GRPO's): the
    plan then assumes every sequence is ``max_length`` long. A preference dataset's list each
    pair's two sequences; a prompts dataset's each prompt alone (the planner adds the completion)."""
    if dataset is None or request.config is not None:
        return None
    if not methods.fits(dataset.format, request.method):
        return None
    folder = models.usable_folder(request.base_model or "demo", settings.models_dir, settings.hf_cache_dir)
    if folder is None:
        return None
    try:
        file = datasets.local_file(storage, dataset, cache=settings.cache_dir)
        pictures = datasets.local_images(storage, dataset, cache=settings.cache_dir)
        return token_lengths(dataset, tokenizer_folder=folder, file=file, images_dir=pictures) or None
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable tokenizer or file: no counts
        return None


def _image_rows(
    dataset: Dataset | None, *, settings: Settings, storage: Storage
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """A VLM job's training rows' images (``image_rows``); None without a dataset or when its
    file or images cannot be read (the plan then assumes no images)."""
    if dataset is None:
        return None
    try:
        file = datasets.local_file(storage, dataset, cache=settings.cache_dir)
        pictures = datasets.local_images(storage, dataset, cache=settings.cache_dir)
        return image_rows(dataset, file=file, images_dir=pictures)
    except (OSError, ValueError):
        return None


def reference_jobs(session: Session, *, base_model: str, workload: Workload, host: str | None) -> list[Job]:
    """The latest jobs (up to ``REFERENCE_RUNS``, newest first) of ``base_model`` with the
    workload's objective and tuning that ran to their end in one go (one claim, no restart) on
    ``host``: what such a run costs on this box. None when no host is planned (no worker online:
    the box is unknown)."""
    if host is None:
        return []
    q = (
        select(Job)
        .join(Worker, Worker.id == Job.worker_id)
        .where(
            Worker.hostname == host,
            Job.base_model == base_model,
            Job.status == JobStatus.SUCCEEDED,
            Job.attempts == 1,
            Job.retries == 0,
            Job.started_at.is_not(None),
            Job.finished_at.is_not(None),
        )
        .order_by(Job.finished_at.desc())
        .limit(REFERENCE_CANDIDATES)
    )
    found = []
    for job in session.scalars(q):
        method = job.config.get("method") or {}
        if (method.get("objective"), method.get("tuning")) == (workload.objective, workload.tuning):
            found.append(job)
        if len(found) == REFERENCE_RUNS:
            break
    return found


@dataclass(frozen=True)
class Measured:
    """What a job measured: each step's tokens/s and seconds, in the order logged, and the median
    tokens (padded, as the engine counts them) of its steps after the first (None: not logged)."""

    rates: list[float]
    step_times: list[float]
    tokens_per_step: float | None


def _measurements(session: Session, job: Job) -> Measured:
    """The job's measurements (a finished job's read once, then remembered by this process)."""
    if job.id in _measured:
        return _measured[job.id]
    rate, wall = "throughput/tokens_per_s", "time/step_s"
    series = jobs.metric_series(session, job_id=job.id, keys=[rate, wall])
    rates, times = ([p["value"] for p in series.get(k, [])] for k in (rate, wall))
    seconds = {p["step"]: p["value"] for p in series.get(wall, [])}
    tokens = [p["value"] * seconds[p["step"]] for p in series.get(rate, []) if p["step"] in seconds]
    measured = Measured(rates, times, statistics.median(tokens[1:] or tokens) if tokens else None)
    if job.status in jobs.TERMINAL:
        while len(_measured) >= _CACHE_SIZE:
            _measured.pop(next(iter(_measured)))
        _measured[job.id] = measured
    return measured


def _overhead(session: Session, job: Job) -> float | None:
    """What the finished job spent besides its steady steps (None: not finished, or not measured)."""
    if job.status != JobStatus.SUCCEEDED or job.started_at is None or job.finished_at is None:
        return None
    duration = (job.finished_at - job.started_at).total_seconds()
    try:
        step_times = _measurements(session, job).step_times
        return measured_overhead(duration_s=duration, steps=job.step, step_times=step_times)
    except ValueError:
        return None


def _rate_ratio(session: Session, *, settings: Settings, job: Job, hardware: Hardware) -> float:
    """What a finished or running job measured on this box over what the plan of its own run
    says on ``hardware``: the median of its tokens/s after the first step (whose warm-up is an
    overhead), against the plan at the tokens a step of it measured (else at its ``max_length``).
    A finished job's ratio is remembered by this process.

    Raises:
        Conflict: no throughput measured yet (``calibrate_job_id``).
        Invalid: the job's own plan does not hold on this hardware.
    """
    key = (job.id, hardware)
    if key in _ratios:
        return _ratios[key]
    measured = _measurements(session, job)
    if not measured.rates:
        raise Conflict(
            "not_measured", f"job {job.id!r} has no throughput measured yet", param="calibrate_job_id"
        )
    try:
        past = Workload.from_train_config(
            TrainConfig.model_validate(job.config), on_gpu=hardware.device != "cpu"
        )
        if measured.tokens_per_step is not None:
            past = replace(past, mean_seq_len=measured.tokens_per_step / past.sequences)
        own = model_config(job.base_model, settings=settings)
        processor = processor_settings(job.base_model, settings=settings)
        predicted = plan_job(own, hardware, past, processor=processor).tokens_per_s
    except ValueError as exc:  # e.g. the past job does not fit the hardware given: nothing to scale
        raise Invalid("invalid_request", str(exc), param="calibrate_job_id") from exc
    steady = statistics.median(measured.rates[1:] or measured.rates)
    if not (predicted > 0 and steady > 0):
        message = f"job {job.id!r}: no rate to scale by (measured {steady!r} tokens/s, planned {predicted!r})"
        raise Invalid("invalid_request", message, param="calibrate_job_id")
    ratio = steady / predicted
    if job.status in jobs.TERMINAL:
        while len(_ratios) >= _CACHE_SIZE * REFERENCE_RUNS:
            _ratios.pop(next(iter(_ratios)))
        _ratios[key] = ratio
    return ratio


def plan(session: Session, *, request: PlanRequest, settings: Settings, storage: Storage) -> dict[str, Any]:
    """The plan of a job request (``POST /api/plan``): fit (and what to change), memory by stage,
    host RAM, longest sequence, tokens/s, the ETA of its steps and of the run end to end, and the
    job it was calibrated by (``calibrate_job_id``, else the latest of this box's reference jobs).

    Raises:
        NotFound: no such base model, dataset or job to calibrate by.
        Invalid: an invalid config, section or hardware (naming the field).
        Conflict: the job to calibrate by has no throughput measured yet.
    """
    name = request.base_model or "demo"
    config = request.config if request.config is not None else model_config(name, settings=settings)
    processor = processor_settings(name, settings=settings) if request.config is None else None
    try:
        vlm = Shape.from_config(config, processor=processor).tower is not None
    except ConfigError as exc:
        where = f"config.{exc.field}" if request.config is not None else "base_model"
        raise Invalid("invalid_config", str(exc), param=where) from exc
    dataset = _dataset(session, request.dataset_id, param="dataset_id")
    validation = _dataset(session, request.validation_dataset_id, param="validation_dataset_id")
    given = request.hardware.model_dump(exclude_none=True)
    host = request.placement.host if request.placement is not None else None
    stale = settings.telemetry_seconds * 5
    box = hardware(session, given=given, stale_after=stale, host=host)
    images = _image_rows(dataset, settings=settings, storage=storage) if vlm else None

    def job_on(box: Hardware) -> Workload:
        try:
            return workload(
                request=request.model_dump(),
                num_sequences=int(dataset.rows) if dataset is not None else None,
                on_gpu=box.device != "cpu",
                token_lengths=_token_lengths(dataset, request, settings=settings, storage=storage),
                num_validation=int(validation.rows) if validation is not None else None,
                images=images,
                home=settings.home,
            )
        except ValueError as exc:
            field = exc.field if isinstance(exc, ConfigError) else None
            raise Invalid("invalid_config", str(exc), param=field) from exc

    job = job_on(box)
    placed = request.placement.model_dump() if request.placement is not None else None
    boxes = planned_hosts(session, where=placed, workload=job, stale_after=stale)
    if boxes.hosts.count > 1 and boxes.host is not None:  # every box as the smallest of them
        host = boxes.host
        device = box.device
        box = hardware(session, given=given, stale_after=stale, host=host)
        job = job_on(box) if box.device != device else job
    references: list[Job] = []  # the jobs whose measured times price the plan, newest first
    ratios: list[float] = []
    if request.calibrate_job_id:
        named = jobs.get_job(session, job_id=request.calibrate_job_id)
        if named is None:
            raise NotFound(f"no job {request.calibrate_job_id!r}", param="calibrate_job_id")
        ratios.append(_rate_ratio(session, settings=settings, job=named, hardware=box))
        references.append(named)
    elif request.config is None and not given:  # the box itself, not hardware the caller names
        planned = gpus.plan_host(session, stale_after=settings.telemetry_seconds * 5, host=host)
        for past in reference_jobs(
            session,
            base_model=request.base_model or "demo",
            workload=job,
            host=planned["hostname"] if planned is not None else None,
        ):
            try:
                ratios.append(_rate_ratio(session, settings=settings, job=past, hardware=box))
                references.append(past)
            except (Conflict, Invalid):  # nothing it measured scales this plan
                continue
    if references:
        box = calibrate(box, predicted_tokens_per_s=1.0, measured_tokens_per_s=statistics.median(ratios))
    try:
        report = plan_job(config, box, job, processor=processor, hosts=boxes.hosts)
    except ValueError as exc:  # a ConfigError names the field; the partitioner's own checks do not
        param = exc.field if isinstance(exc, ConfigError) else None
        if param in HARDWARE_RANGES:  # given, detected on a worker, or calibrated
            param = f"hardware.{param}"
        elif param == "hosts":
            param = "placement.hosts"
        raise Invalid("invalid_request", str(exc), param=param) from exc
    if references:
        report.estimate = "calibrated"
        overheads = [o for o in (_overhead(session, past) for past in references) if o is not None]
        if overheads:
            report = use_measured_overhead(report, overhead_s=statistics.median(overheads))
    report.assumptions |= boxes.facts
    if report.assumptions["vision"] is not None:  # the images a row holds: the data's, or none assumed
        report.assumptions["vision"]["images_from_data"] = bool(images and images[0])
    return report.to_dict() | {"calibrated_from": references[0].id if references else None}
