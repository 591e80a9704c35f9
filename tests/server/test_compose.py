"""The deployment files: docker-compose.yml, docker-compose.worker.yml (another GPU host), the
Dockerfile and .dockerignore, read as data.

No Docker engine is needed: the compose files are parsed with PyYAML (anchors and merge keys
resolved), ``${VAR:-default}`` is resolved with every variable unset, as a plain
``docker compose up`` sees it (or with the variables of an example .env), and the commands the
containers run are parsed by the real CLI.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.cli import build_parser
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
WORKER_COMPOSE = ROOT / "docker-compose.worker.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
APP_SERVICES = ("api", "worker")
ONE_SHOT = ("minio-init",)  # run once and exit: no restart policy, no healthcheck
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}; never after a `$` ($$ is a `$`)
VARIABLE = re.compile(r"(?<!\$)\$\{(\w+)(?:(:?)([-?])([^${}]*))?\}")
STORAGE_KEYS = (
    "ROUNDHOUSE_STORAGE_URL",
    "ROUNDHOUSE_S3_ENDPOINT_URL",
    "ROUNDHOUSE_S3_ACCESS_KEY_ID",
    "ROUNDHOUSE_S3_SECRET_ACCESS_KEY",
    "ROUNDHOUSE_S3_REGION",
)


class Unset(Exception):
    """A required variable (``${VAR:?message}``) is not set."""


def interpolate(value: Any, env: Mapping[str, str] | None = None) -> Any:
    """Resolve the variables of ``value`` (innermost first) as compose does with ``env`` set
    (default: nothing set); ``$$`` stays (a literal ``$`` for the container).

    Raises:
        Unset: a required variable is unset (or empty, for ``:?``), with its message.
    """
    env = env or {}

    def one(m: re.Match[str]) -> str:
        name, colon, kind, word = m.groups()
        found = env.get(name)
        missing = found is None or (colon == ":" and found == "")
        if kind == "?" and missing:
            raise Unset(f"{name}: {word}")
        return (word or "") if missing and kind == "-" else (found or "")

    if isinstance(value, str):
        while True:
            resolved = VARIABLE.sub(one, value)
            if resolved == value:
                return resolved
            value = resolved
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Container path -> (source, read-only) of a service's short-syntax volumes."""
    out: dict[str, tuple[str, bool]] = {}
    for spec in service.get("volumes", []):
        parts = spec.split(":")
        assert len(parts) in (2, 3), spec
        out[parts[1]] = (parts[0], len(parts) == 3 and "ro" in parts[2].split(","))
    return out


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    return [str(part) for part in test]


# ---- docker-compose.yml ----


def test_services_and_the_postgres_profile(services: dict[str, dict[str, Any]]) -> None:
    assert {"api", "worker", "redis", "postgres"} <= set(services)
    assert services["postgres"]["profiles"] == ["postgres"]
    # a plain `docker compose up` starts the rest: none of them is behind a profile
    for name in ("api", "worker", "redis"):
        assert not services[name].get("profiles"), name
    for name, service in services.items():
        assert service.get("restart") == ("no" if name in ONE_SHOT else "unless-stopped"), name
    assert services["redis"]["image"].startswith("redis:7")
    assert services["postgres"]["image"].startswith("postgres:16")


def test_the_worker_reserves_every_nvidia_gpu(services: dict[str, dict[str, Any]]) -> None:
    worker = services["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and d.get("count") == "all" and "gpu" in d.get("capabilities", [])
        for d in devices
    ), devices
    assert "deploy" not in services["api"], "the API does not hold GPUs"
    size = re.fullmatch(r"(\d+)gb", str(worker["shm_size"]).lower())
    assert size is not None and int(size.group(1)) >= 8, worker["shm_size"]


def test_every_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        if name in ONE_SHOT:
            assert "healthcheck" not in service, f"{name} exits: its dependents wait for its success"
            continue
        argv = healthcheck_argv(service)
        assert argv[0] in ("CMD", "CMD-SHELL") and len(argv) > 1, name
        assert not service["healthcheck"].get("disable"), name
    api = " ".join(healthcheck_argv(services["api"]))
    assert "127.0.0.1:8000/api/health" in api and "'status'" in api
    assert healthcheck_argv(services["redis"])[1:] == ["redis-cli", "ping"]
    assert "pg_isready" in " ".join(healthcheck_argv(services["postgres"]))


def test_healthcheck_commands_are_valid_python(services: dict[str, dict[str, Any]]) -> None:
    for name in APP_SERVICES:
        argv = healthcheck_argv(services[name])
        assert argv[1:3] == ["python", "-c"], name
        compile(argv[3], f"<{name} healthcheck>", "exec")
    # the worker's check reads the GPUs through NVML, which the pins install
    assert "pynvml" in healthcheck_argv(services["worker"])[3]
    assert importlib.util.find_spec("pynvml") is not None


def test_depends_on_waits_for_healthy_services(services: dict[str, dict[str, Any]]) -> None:
    for name in APP_SERVICES:
        deps = services[name]["depends_on"]
        assert isinstance(deps, dict), f"{name}: depends_on needs the long syntax for conditions"
        assert deps["redis"]["condition"] == "service_healthy", name
        assert deps["redis"].get("required", True) is True, name
        # PostgreSQL only with its profile: not required, so `docker compose up` runs on SQLite
        assert deps["postgres"]["condition"] == "service_healthy", name
        assert deps["postgres"]["required"] is False, name
        # the bucket exists before anything is stored (only with the minio profile)
        assert deps["minio-init"] == {"condition": "service_completed_successfully", "required": False}, name
    # the api migrates the database before the worker starts
    assert services["worker"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert "worker" not in services["api"]["depends_on"]
    assert "depends_on" not in services["redis"] and "depends_on" not in services["postgres"]


def test_named_volumes_are_declared_and_mounted(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    declared = set(compose["volumes"])
    assert {"data", "models", "runs", "hf-cache"} <= declared
    for name in APP_SERVICES:
        home = environment(services[name])["ROUNDHOUSE_HOME"]
        settings = Settings(home=Path(home))
        found = mounts(services[name])
        assert found[home] == ("data", False), name
        assert found[str(settings.models_dir)] == ("models", False), name
        assert found[str(settings.runs_dir)] == ("runs", False), name
        hf_cache = environment(services[name])["ROUNDHOUSE_HF_CACHE"]
        assert found[hf_cache] == ("hf-cache", True), f"{name}: the HF cache is mounted read-only"
    for name, service in services.items():
        for source, _ in mounts(service).values():
            assert source.startswith(("/", ".")) or source in declared, f"{name}: volume {source}"
    assert mounts(services["postgres"])["/var/lib/postgresql/data"][0] == "postgres"


def test_api_and_worker_share_data_broker_and_database(services: dict[str, dict[str, Any]]) -> None:
    api, worker = environment(services["api"]), environment(services["worker"])
    shared = ("ROUNDHOUSE_HOME", "ROUNDHOUSE_REDIS_URL", "ROUNDHOUSE_DATABASE_URL", "ROUNDHOUSE_HF_CACHE")
    for key in (*shared, *STORAGE_KEYS):
        assert api[key] == worker[key], key
    assert api["ROUNDHOUSE_REDIS_URL"].startswith("redis://redis:6379/")
    assert mounts(services["api"]) == mounts(services["worker"])
    assert api["HF_HUB_OFFLINE"] == "1"
    # unset, the database URL is empty: the service falls back to SQLite inside the data volume
    settings = Settings(home=Path(api["ROUNDHOUSE_HOME"]), database_url=api["ROUNDHOUSE_DATABASE_URL"])
    assert settings.url == f"sqlite:///{api['ROUNDHOUSE_HOME']}/roundhouse.db"
    assert api["ROUNDHOUSE_PUBLIC_URL"] == "http://localhost:8000"


def test_the_api_publishes_port_8000(services: dict[str, dict[str, Any]]) -> None:
    ports = services["api"]["ports"]
    assert any(str(p).split(":")[-1] == "8000" for p in ports), ports


def test_the_shared_services_are_published_on_this_host_only_by_default() -> None:
    """PostgreSQL, Redis and MinIO are what other GPU hosts reach: published on
    ROUNDHOUSE_LAN_ADDRESS, which unset is 127.0.0.1 (nothing is open to the network)."""
    expected = {"redis": "6379", "postgres": "5432", "minio": "9000"}
    for env, address in (({}, "127.0.0.1"), ({"ROUNDHOUSE_LAN_ADDRESS": "10.0.0.5"}, "10.0.0.5")):
        services = interpolate(yaml.safe_load(COMPOSE.read_text()), env)["services"]
        for name, port in expected.items():
            assert services[name]["ports"] == [f"{address}:{port}:{port}"], (name, env)
        assert "ports" not in services["worker"] and "ports" not in services["minio-init"]


def test_the_commands_are_the_cli(services: dict[str, dict[str, Any]]) -> None:
    entrypoint = dockerfile_json("ENTRYPOINT")
    assert entrypoint == ["roundhouse"]
    parser = build_parser()
    serve = parser.parse_args(services["api"]["command"])
    assert (serve.command, serve.host, serve.port) == ("serve", "0.0.0.0", 8000)
    assert not serve.with_worker, "the worker runs in its own service"
    assert parser.parse_args(services["worker"]["command"]).command == "worker"
    assert parser.parse_args(dockerfile_json("CMD")).command == "serve"


def test_the_postgres_service_matches_the_documented_url(services: dict[str, dict[str, Any]]) -> None:
    from sqlalchemy.engine import make_url

    documented = re.search(r"ROUNDHOUSE_DATABASE_URL=(\S+)", COMPOSE.read_text())
    assert documented is not None, "the compose file documents the PostgreSQL URL"
    url = make_url(documented.group(1))
    env = environment(services["postgres"])
    assert url.drivername == "postgresql+psycopg"
    assert (url.host, url.port) == ("postgres", 5432)
    assert (url.username, url.password, url.database) == (
        env["POSTGRES_USER"],
        env["POSTGRES_PASSWORD"],
        env["POSTGRES_DB"],
    )


# ---- the object store (the minio profile) ----

# the .env the compose header documents for the minio profile
MINIO_ENV = {
    "COMPOSE_PROFILES": "postgres,minio",
    "ROUNDHOUSE_STORAGE_URL": "s3://roundhouse/",
    "ROUNDHOUSE_S3_ENDPOINT_URL": "http://minio:9000",
}


def test_the_minio_profile_runs_a_pinned_server_and_creates_the_bucket(
    services: dict[str, dict[str, Any]],
) -> None:
    minio, init = services["minio"], services["minio-init"]
    assert minio["profiles"] == init["profiles"] == ["minio"]
    for service in (minio, init):
        assert re.fullmatch(
            r"(quay\.io/)?minio/(minio|mc):RELEASE\.\d{4}-\d\d-\d\dT[\d-]+Z", service["image"]
        )
    assert minio["command"] == ["server", "/data"]
    assert mounts(minio) == {"/data": ("minio", False)}
    assert healthcheck_argv(minio) == ["CMD", "mc", "ready", "local"]
    assert init["depends_on"] == {"minio": {"condition": "service_healthy"}}
    # the server's root user is the one the API and the workers sign with
    env, app = environment(minio), environment(services["api"])
    assert env["MINIO_ROOT_USER"] == app["ROUNDHOUSE_S3_ACCESS_KEY_ID"] != ""
    assert env["MINIO_ROOT_PASSWORD"] == app["ROUNDHOUSE_S3_SECRET_ACCESS_KEY"]
    assert len(env["MINIO_ROOT_PASSWORD"]) >= 8, "MinIO refuses a shorter root password"


@pytest.mark.parametrize(
    ("url", "bucket"), [(None, "roundhouse"), ("s3://roundhouse/", "roundhouse"), ("s3://b-1/a/b", "b-1")]
)
def test_minio_init_creates_the_bucket_of_the_storage_url(
    tmp_path: Path, url: str | None, bucket: str
) -> None:
    """The one-shot's shell command, run by /bin/sh with a stand-in ``mc`` that records its calls."""
    env = {} if url is None else {"ROUNDHOUSE_STORAGE_URL": url}
    init = interpolate(yaml.safe_load(COMPOSE.read_text()), env)["services"]["minio-init"]
    assert init["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = init["command"]
    calls = tmp_path / "calls"
    mc = tmp_path / "mc"
    mc.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    mc.chmod(0o755)
    child = {"PATH": f"{tmp_path}:{os.environ['PATH']}", **environment(init)}
    subprocess.run(["/bin/sh", "-c", script.replace("$$", "$")], env=child, check=True, timeout=10)
    assert calls.read_text().splitlines() == [
        "alias set store http://minio:9000 roundhouse roundhouse-minio",
        f"mb --ignore-existing store/{bucket}",
    ]


def storage_of(env: Mapping[str, str], home: Path) -> Any:
    """``open_storage`` of the settings a container with environment ``env`` reads."""
    from server.storage import open_storage

    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("ROUNDHOUSE_")]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        settings = Settings(home=home)
    return settings, open_storage(settings)


def test_the_app_services_read_the_store_from_env(tmp_path: Path) -> None:
    from server.storage import LocalStorage

    # unset: the volumes, as before
    plain = interpolate(yaml.safe_load(COMPOSE.read_text()))["services"]
    _, store = storage_of(environment(plain["api"]), tmp_path)
    assert isinstance(store, LocalStorage)
    # the minio profile as documented: the bucket minio-init creates, at the minio service
    services = interpolate(yaml.safe_load(COMPOSE.read_text()), MINIO_ENV)["services"]
    for name in APP_SERVICES:
        settings, store = storage_of(environment(services[name]), tmp_path)
        assert (store.bucket, store.prefix) == ("roundhouse", ""), name
        assert store.client.meta.endpoint_url == "http://minio:9000", name
        assert (settings.s3_access_key_id, settings.s3_region) == ("roundhouse", "us-east-1")
    assert environment(services["worker"])["ROUNDHOUSE_WORKER_HOST"] == services["worker"]["hostname"]
    assert "ROUNDHOUSE_WORKER_HOST" not in environment(services["api"])


def test_the_documented_minio_settings_are_the_ones_tested() -> None:
    text = COMPOSE.read_text()
    for key, value in MINIO_ENV.items():
        assert re.search(rf"^#\s+{key}={re.escape(value)}(\s|$)", text, re.M), key


# ---- docker-compose.worker.yml ----

WORKER_ENV = {
    "ROUNDHOUSE_WORKER_HOST": "gpu-2",
    "ROUNDHOUSE_DATABASE_URL": "postgresql+psycopg://roundhouse:roundhouse@10.0.0.5:5432/roundhouse",
    "ROUNDHOUSE_REDIS_URL": "redis://10.0.0.5:6379/0",
    "ROUNDHOUSE_STORAGE_URL": "s3://roundhouse/",
    "ROUNDHOUSE_S3_ENDPOINT_URL": "http://10.0.0.5:9000",
}


def test_the_worker_file_requires_the_main_host_s_addresses() -> None:
    raw = yaml.safe_load(WORKER_COMPOSE.read_text())
    for key in (
        "ROUNDHOUSE_WORKER_HOST",
        "ROUNDHOUSE_DATABASE_URL",
        "ROUNDHOUSE_REDIS_URL",
        "ROUNDHOUSE_STORAGE_URL",
    ):
        with pytest.raises(Unset, match=key):
            interpolate(raw, {k: v for k, v in WORKER_ENV.items() if k != key})
    # the object store's endpoint may be left empty (AWS S3)
    interpolate(raw, {k: v for k, v in WORKER_ENV.items() if k != "ROUNDHOUSE_S3_ENDPOINT_URL"})


def test_the_worker_file_runs_only_a_worker_like_the_main_one(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    compose = interpolate(yaml.safe_load(WORKER_COMPOSE.read_text()), WORKER_ENV)
    (name,) = compose["services"]
    worker, main = compose["services"][name], services["worker"]
    assert name == "worker" and worker.get("restart") == "unless-stopped"
    assert build_parser().parse_args(worker["command"]).command == "worker"
    for key in ("image", "init", "deploy", "shm_size", "ulimits", "healthcheck", "stop_grace_period"):
        assert worker[key] == main[key], key
    assert "ports" not in worker and "depends_on" not in worker and "profiles" not in worker
    # its own data volume: a cache of the store, nothing shared with the main host
    env = environment(worker)
    assert mounts(worker) == {env["ROUNDHOUSE_HOME"]: ("data", False)} and set(compose["volumes"]) == {"data"}
    assert env["ROUNDHOUSE_WORKER_HOST"] == "gpu-2"
    # the host's network: the boxes of a job on several hosts reach each other on ephemeral ports
    assert worker["network_mode"] == "host" and "hostname" not in worker
    assert env["HF_HUB_OFFLINE"] == "1"
    # the main file's defaults for what .env may leave out (the minio service's credentials)
    defaults = environment(main)
    for key in STORAGE_KEYS[2:]:
        assert env[key] == defaults[key], key
    settings, store = storage_of(env, tmp_path)
    assert settings.host_name == "gpu-2" and settings.redis_url == WORKER_ENV["ROUNDHOUSE_REDIS_URL"]
    assert settings.url == WORKER_ENV["ROUNDHOUSE_DATABASE_URL"]
    assert (store.bucket, store.client.meta.endpoint_url) == ("roundhouse", "http://10.0.0.5:9000")


def test_the_worker_file_documents_every_variable_it_reads() -> None:
    text = WORKER_COMPOSE.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for key in set(re.findall(r"\$\{(\w+)", text)) - {"ROUNDHOUSE_IMAGE"}:
        assert key in header, key


# ---- Dockerfile ----


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, "a continuation line runs off the end"
    return out


def dockerfile_args() -> dict[str, str]:
    return dict(a.split("=", 1) for kind, a in dockerfile() if kind == "ARG" and "=" in a)


def with_args(text: str) -> str:
    """``text`` with each ``$NAME`` / ``${NAME}`` of a build argument replaced by its default."""
    args = dockerfile_args()
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def dockerfile_json(kind: str) -> list[str]:
    found = [yaml.safe_load(a) for k, a in dockerfile() if k == kind]
    assert found, f"no {kind}"
    return [str(part) for part in found[-1]]


def pip_installs() -> list[str]:
    """Each ``pip install`` of the Dockerfile, build arguments resolved to their defaults."""
    runs = [a for kind, a in dockerfile() if kind == "RUN"]
    return [with_args(part) for run in runs for part in run.split("&&") if "pip install" in part]


def test_torch_comes_from_a_cuda_index_before_the_pins() -> None:
    installs = pip_installs()
    torch_at = next(i for i, cmd in enumerate(installs) if "torch" in cmd)
    pins_at = next(i for i, cmd in enumerate(installs) if re.search(r"-r\s+requirements\.txt", cmd))
    assert torch_at < pins_at
    index = re.search(r"--index-url\s+(\S+)", installs[torch_at])
    assert index is not None and re.fullmatch(
        r"https://download\.pytorch\.org/whl/cu1\d{2,}", index.group(1)
    ), installs[torch_at]
    # the torch it installs is the pin of requirements.txt, read from that file
    assert "grep -E '^torch==' requirements.txt" in installs[torch_at]
    pins = (ROOT / "requirements.txt").read_text().splitlines()
    assert len([p for p in pins if re.match(r"^torch==", p)]) == 1


def test_pins_then_nodeps_then_the_package() -> None:
    installs = pip_installs()
    nodeps = [i for i, cmd in enumerate(installs) if "requirements-nodeps.txt" in cmd]
    assert len(nodeps) == 1 and "--no-deps" in shlex.split(installs[nodeps[0]])
    package = [i for i, cmd in enumerate(installs) if shlex.split(cmd)[-3:] == ["install", "--no-deps", "."]]
    assert len(package) == 1
    pins_at = next(i for i, cmd in enumerate(installs) if re.search(r"-r\s+requirements\.txt", cmd))
    assert pins_at < nodeps[0] < package[0]


def test_runtime_environment_user_and_healthcheck() -> None:
    steps = dockerfile()
    bases = [with_args(value.split()[0]) for kind, value in steps if kind == "FROM"]
    assert bases and all(base.startswith("python:3.11") for base in bases), bases
    # what the containers run is the last stage
    final = steps[max(i for i, (kind, _) in enumerate(steps) if kind == "FROM") :]
    env: dict[str, str] = {}
    for kind, value in final:
        if kind == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(value))
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["ROUNDHOUSE_HOME"] == "/data"
    users = [value for kind, value in final if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    health = [value for kind, value in final if kind == "HEALTHCHECK"]
    assert len(health) == 1 and "/api/health" in health[0]
    assert "8000" in [value for kind, value in final if kind == "EXPOSE"]
    # the installed package holds no web/: the image copies it and points the server at it
    copies = [value.split() for kind, value in final if kind == "COPY"]
    assert ["web", env["ROUNDHOUSE_WEB_DIR"]] in copies, copies


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and line[0] != "#"
    ]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns if not p.startswith("!"))

    copied = [a.split()[:-1] for kind, a in dockerfile() if kind == "COPY" and "--from" not in a]
    for sources in copied:
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not ignored(source), f"{source} is copied but ignored"
    for heavy in (".git", ".venv", "data", "runs"):
        assert ignored(heavy), heavy
