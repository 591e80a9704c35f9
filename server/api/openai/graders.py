"""``/v1/fine_tuning/alpha/graders``: OpenAI's grader API over ``engine.graders``: check a grader
(``validate``) and try it on a model answer (``run``), or, our extension, on up to 20 answers at
once (``samples``), which the web UI's "try the grader" uses.

A grader that is not valid is a 400 naming the field (``param: "grader.graders.b.operation"``).
A grader that fails on a sample (a Python grader that raises, times out or returns no number)
is no error of the request: the reward is 0 and ``metadata.errors`` says what went wrong.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from engine import ConfigError
from engine.graders import GRADER_TYPES, Grader, GradeResult, GraderJson, validate_grader
from server.api.openai.shapes import documented
from server.deps import current_key
from server.errors import ApiError

router = APIRouter(
    prefix="/v1/fine_tuning/alpha/graders",
    tags=["openai"],
    dependencies=[Depends(current_key)],
    responses=documented(400, 401),
)
MAX_SAMPLES = 20
MAX_SAMPLE_CHARS = 200_000
GRADER = (
    f"a grader: type {', '.join(GRADER_TYPES)}, and its fields as OpenAI's graders have them "
    '(e.g. {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": '
    '"{{item.answer}}", "operation": "eq"}); regex, json_schema and length are ours'
)
# the JSON object as given, documented as engine.graders.GraderSpec; checked by validate_grader
GraderObject = Annotated[GraderJson, Field(description=GRADER)]
Item = Annotated[
    dict[str, Any],
    Field(description="the dataset row the answer is graded against: {{item.<field>}} reads its fields"),
]
ModelSample = Annotated[
    str,
    Field(
        max_length=MAX_SAMPLE_CHARS,
        description="the model's answer: {{sample.output_text}}, and {{sample.output_json}} when it is JSON",
    ),
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GraderValidate(_Request):
    grader: GraderObject


class GraderSample(_Request):
    model_sample: ModelSample
    item: Item = Field(default_factory=dict)


class GraderRun(_Request):
    """OpenAI's request (``grader``, ``model_sample``, ``item``), or ours: ``grader`` and
    ``samples``."""

    grader: GraderObject
    model_sample: ModelSample | None = None
    item: Item | None = None
    samples: list[GraderSample] | None = Field(
        None,
        min_length=1,
        max_length=MAX_SAMPLES,
        description=f"our extension, in place of model_sample and item: up to {MAX_SAMPLES} answers, each "
        "with its item; the answer then holds rewards (one per sample) and the mean reward and scores",
    )


class GraderValidated(BaseModel):
    grader: GraderJson = Field(description="the grader, with its defaults filled in")


class GraderErrors(BaseModel):
    """OpenAI's error flags of a run; ``messages`` (ours) says what each failure was."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False
    messages: list[str] = Field(
        default_factory=list, description="ours: each failure, as the grader reported it"
    )


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderErrors
    execution_time: float = Field(description="seconds")
    scores: dict[str, float] = Field(description="each sub-grader's score (a single grader: its own)")
    token_usage: int | None = None
    sampled_model_name: str | None = None


class GraderRunResult(BaseModel):
    reward: float = Field(description="the grader's score; with samples, the mean of rewards")
    metadata: GraderRunMetadata
    sub_rewards: dict[str, float]
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)
    rewards: list[float] | None = Field(None, description="ours, with samples: each sample's reward")
    sample_errors: list[str | None] | None = Field(
        None, description="ours, with samples: why each sample scored 0 (null where it was graded)"
    )
    sample_sub_rewards: dict[str, list[float]] | None = Field(
        None, description="ours, with samples: each sub-grader's score of each sample"
    )


def unicode_only(value: Any, field: str) -> None:
    """Refuse a string in ``value`` (keys too) that is not Unicode text: JSON can carry a lone
    surrogate (``"\\ud800"``), which no answer could then be written with."""
    stack = [(value, field)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode()
            except UnicodeEncodeError as exc:
                message = f"{path}: must be Unicode text (it holds a lone surrogate)"
                raise ApiError(400, "invalid_request", message, param=path) from exc
        elif isinstance(node, dict):
            for key, item in node.items():
                stack.append((key, path))
                stack.append((item, f"{path}.{key}" if str(key).isascii() else path))
        elif isinstance(node, list):
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(node))


def checked(spec: dict[str, Any]) -> Grader:
    """The grader of a request, or the 400 naming its bad field."""
    try:
        return validate_grader(spec, "grader")
    except ConfigError as exc:
        raise ApiError(400, "invalid_grader", str(exc), param=exc.field) from exc


@router.post(
    "/validate",
    response_model=GraderValidated,
    description="Check a grader: a 400 naming the field at fault, or the grader with its defaults. A "
    "python grader's source runs once in a sandboxed child process to find grade(sample, item).",
)
def validate(body: GraderValidate) -> Any:
    """Validate a grader."""
    unicode_only(body.grader, "grader")
    with checked(body.grader) as grader:
        return {"grader": grader.spec()}


@router.post(
    "/run",
    response_model=GraderRunResult,
    description="Grade model_sample against item (OpenAI's), or each of samples (ours). A sample the "
    "grader fails on scores 0; metadata.errors says why.",
)
def run(body: GraderRun) -> Any:
    """Run a grader."""
    if body.samples is not None and (body.model_sample is not None or body.item is not None):
        message = "samples: give either samples or model_sample (and item), not both"
        raise ApiError(400, "invalid_request", message, param="samples")
    if body.samples is None and body.model_sample is None:
        message = "model_sample: required (or, our extension, samples)"
        raise ApiError(400, "invalid_request", message, param="model_sample")
    unicode_only(body.grader, "grader")
    unicode_only(body.item, "item")
    for i, sample in enumerate(body.samples or ()):
        unicode_only(sample.item, f"samples.{i}.item")
    if body.samples is not None:
        answers = [s.model_sample for s in body.samples]
        items = [s.item for s in body.samples]
    else:
        answers, items = [body.model_sample or ""], [body.item or {}]
    with checked(body.grader) as grader:
        start = time.perf_counter()
        result = grader.grade_batch(answers, items)
        seconds = time.perf_counter() - start
        name, kind = grader.name, grader.type
    return _answer(result, name=name, kind=kind, seconds=seconds, many=body.samples is not None)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _answer(result: GradeResult, *, name: str, kind: str, seconds: float, many: bool) -> dict[str, Any]:
    sub = {key: _mean(values) for key, values in result.sub_rewards.items()}
    answer: dict[str, Any] = {
        "reward": _mean(result.rewards),
        "metadata": {
            "name": name,
            "type": kind,
            "errors": _errors(result),
            "execution_time": seconds,
            "scores": sub,
            "token_usage": None,
            "sampled_model_name": None,
        },
        "sub_rewards": sub,
        "model_grader_token_usage_per_model": {},
    }
    if many:
        answer |= {
            "rewards": result.rewards,
            "sample_errors": result.errors,
            "sample_sub_rewards": result.sub_rewards,
        }
    return answer


def _errors(result: GradeResult) -> dict[str, Any]:
    """OpenAI's error flags for the failures of a run."""
    flags: dict[str, Any] = {"messages": [e for e in result.errors if e]}
    for error, kind in zip(result.errors, result.error_kinds, strict=False):
        if not error:
            continue
        if kind == "runtime":
            flags["python_grader_runtime_error"] = True
            flags.setdefault("python_grader_runtime_error_details", error)
        elif kind == "crashed":
            flags["python_grader_server_error"] = True
            flags.setdefault("python_grader_server_error_type", error)
        elif kind == "timeout":
            flags["unresponsive_reward_error"] = True
        elif kind == "formula":
            flags["formula_parse_error"] = True
        elif kind == "template":
            flags["invalid_variable_error"] = True
        else:
            flags["other_error"] = True
    return flags
