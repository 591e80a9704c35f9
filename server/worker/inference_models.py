"""The inference service's models: where each runs, loading them once, unloading them for training.

Where a model runs (``placement``): on the GPUs when the host has some and no job trains on them
(bf16, layers spread over several GPUs when it does not fit one); on the CPU (fp32) while a job
trains, if it has at most ``cpu_max_params`` parameters; a bigger one waits for the GPUs
(``Busy``: a 503 with ``Retry-After``). On a CPU-only host the CPU is where jobs train too: with no
job, any model runs there; while a job trains, only models up to ``cpu_max_params``.

One ``Model`` per base folder holds the base once; LoRA checkpoints are adapters on it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger("roundhouse.inference")
Placement = Literal["gpu", "cpu"]


class Busy(RuntimeError):
    """The model needs the devices a training job holds; ``retry_after`` seconds is a hint."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def placement(parameters: int, *, gpus: int, training: bool, cpu_max_params: int) -> Placement:
    """Where a model of ``parameters`` runs now.

    Raises:
        Busy: a job trains on the devices it needs (the GPUs; the CPU of a CPU-only host).
    """
    if gpus and not training:
        return "gpu"
    if not training or parameters <= cpu_max_params:
        return "cpu"
    where = "GPUs" if gpus else "CPU (this host has no GPU)"
    raise Busy(
        f"a training job holds this host's {where}: models above {cpu_max_params:,} parameters"
        f" ({parameters:,} here) answer once it ends (ROUNDHOUSE_INFERENCE_CPU_MAX_PARAMS)",
        retry_after=30,
    )


def _load_base(folder: str, where: Placement) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model import dense_load_kwargs, load_model, vision_architecture

    if where == "cpu":
        return load_model(folder).eval()
    # bf16 over the GPUs: accelerate fills the first GPU and spills the next layers to the others
    kwargs = dense_load_kwargs(folder)
    model_class: Any = AutoModelForCausalLM
    vision = vision_architecture(folder)
    if vision is not None:  # a VLM: its own class (the Auto class maps few of them)
        import transformers

        model_class = getattr(transformers, vision)
    return model_class.from_pretrained(folder, dtype=torch.bfloat16, device_map="auto", **kwargs).eval()


@dataclass
class Loaded:
    model: Any  # engine.inference.batching.Model
    placement: Placement
    parameters: int


class Models:
    """The loaded base models by folder, each with its tokenizers (base and adapters)."""

    def __init__(self, *, gpus: int, cpu_max_params: int) -> None:
        self.gpus, self.cpu_max_params = gpus, cpu_max_params
        self.training = False
        self.loaded: dict[str, Loaded] = {}
        self.tokenizers: dict[str, Any] = {}
        self._guard = threading.Lock()
        self._loading = threading.Lock()  # one load at a time: transformers' lazy imports are not thread-safe

    def get(self, folder: str, *, parameters: int, name: str) -> Loaded:
        """The base model of ``folder``, loaded where ``placement`` says if it is not loaded yet.

        Raises:
            Busy: a job trains on the devices it needs.
        """
        from engine.inference import Model

        with self._guard:
            hit = self.loaded.get(folder)
            training = self.training
        if hit is not None and not hit.model.closed:
            return hit
        where = placement(parameters, gpus=self.gpus, training=training, cpu_max_params=self.cpu_max_params)
        with self._loading:
            with self._guard:
                hit = self.loaded.get(folder)
            if hit is not None and not hit.model.closed:
                return hit
            log.info("loading %s on the %s", name, where.upper())
            loaded = Loaded(Model(_load_base(folder, where), name=name), where, parameters)
            with self._guard:
                if self.training and where == "gpu":  # a job took the GPUs while it loaded
                    raise Busy(f"a training job took this host's GPUs while {name} loaded", retry_after=30)
                self.loaded[folder] = loaded
        return loaded

    def tokenizer(self, folder: str) -> Any:
        from engine.model import load_tokenizer

        with self._guard:
            hit = self.tokenizers.get(folder)
        if hit is None:
            with self._loading:
                hit = load_tokenizer(folder)
            with self._guard:
                self.tokenizers[folder] = hit
        return hit

    def set_training(self, training: bool) -> list[Loaded]:
        """Record whether a job trains here; returns the models that must go (for a job: those
        on the GPUs, and on a CPU-only host those above ``cpu_max_params``)."""
        with self._guard:
            self.training = training
            if not training:
                return []
            going = [
                (folder, m)
                for folder, m in self.loaded.items()
                if m.placement == "gpu" or m.parameters > self.cpu_max_params
            ]
            for folder, _ in going:
                del self.loaded[folder]
        return [m for _, m in going]

    @staticmethod
    def free(loaded: Loaded) -> None:
        """Let go of an unloaded model's memory (its GPU memory returned to the driver)."""
        loaded.model.module = None
        if loaded.placement == "gpu":
            import gc

            import torch

            gc.collect()
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
