"""Keys and browser logins: one-time login links traded for a session cookie that holds no key,
``?token=`` only on the event streams, and ``roundhouse keys list | revoke`` and ``login-url``."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from server.deps import COOKIE, QUERY_TOKEN_ROUTES
from server.services import keys
from server.settings import Settings
from server.tables import BrowserSession, now
from tests.server.test_api import every_route
from tests.utils import child_env, roundhouse

LIFETIME = timedelta(minutes=10)


def new_link(client: TestClient, *, key_id: int | None = None) -> str:
    """A one-time login token for ``key_id`` (None: the first key), as ``roundhouse login-url`` makes."""
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        return keys.create_login(session, key_id=key_id, lifetime=LIFETIME)


def anonymous(client: TestClient, base_url: str = "http://testserver") -> TestClient:
    return TestClient(client.app, base_url=base_url)


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = child_env(**settings.child_environment())
    return subprocess.run(roundhouse(*args), env=env, capture_output=True, text=True, timeout=120)


def test_a_login_link_works_once_then_says_it_was_used(client: TestClient) -> None:
    token = new_link(client)
    assert token.startswith("rhl_")
    browser = anonymous(client)
    assert browser.get("/api/health").json()["authenticated"] is False
    r = browser.get("/login", params={"token": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert browser.get("/api/health").json()["authenticated"] is True
    assert browser.get("/api/datasets").status_code == 200
    # the same link again, in another browser (or the same one): refused, with what to do instead
    for again in (anonymous(client), browser):
        r = again.get("/login", params={"token": token}, follow_redirects=False)
        assert r.status_code == 401 and "set-cookie" not in r.headers
        assert "already used or has expired" in r.text and "roundhouse login-url" in r.text
    assert anonymous(client).get("/login", params={"token": "rhl_never_issued"}).status_code == 401


def test_an_expired_link_and_an_expired_session_are_refused(client: TestClient) -> None:
    stale, fresh = new_link(client), new_link(client)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        session.execute(update(BrowserSession).values(link_expires_at=now() - timedelta(seconds=1)))
        session.commit()
    r = anonymous(client).get("/login", params={"token": stale}, follow_redirects=False)
    assert r.status_code == 401 and "already used or has expired" in r.text
    assert anonymous(client).get("/login", params={"token": fresh}).status_code == 401

    browser = anonymous(client)
    assert browser.get("/login", params={"token": new_link(client)}).status_code == 200
    assert browser.get("/api/jobs").status_code == 200
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        session.execute(update(BrowserSession).values(expires_at=now() - timedelta(seconds=1)))
        session.commit()
    assert browser.get("/api/jobs").status_code == 401


def test_the_cookie_is_a_session_that_holds_no_key(client: TestClient, app_and_key: tuple[Any, str]) -> None:
    _, key = app_and_key
    token = new_link(client)
    browser = anonymous(client)
    r = browser.get("/login", params={"token": token}, follow_redirects=False)
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=rhs_")
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and f"Max-Age={30 * 86400}" in cookie
    assert "secure" not in cookie.lower()  # plain http: a Secure cookie would not be sent back
    secret = browser.cookies[COOKIE]
    assert key not in cookie and secret != key and not secret.startswith("rh_")
    # the database keeps hashes only: neither the link's token nor the cookie is stored
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        (row,) = session.scalars(select(BrowserSession)).all()
        stored = " ".join(str(v) for v in vars(row).values())
    assert token not in stored and secret not in stored and row.session_hash and row.used_at
    # the session is the browser's: not a bearer key, and a cookie holding a key is no session
    bearer = anonymous(client)
    assert bearer.get("/api/jobs", headers={"Authorization": f"Bearer {secret}"}).status_code == 401
    old_style = anonymous(client)
    old_style.cookies.set(COOKIE, key)
    assert old_style.get("/api/jobs").status_code == 401
    old_style.cookies.clear()
    old_style.cookies.set("roundhouse_key", key)  # what the old login link stored
    assert old_style.get("/api/jobs").status_code == 401
    # over https the cookie is Secure
    https = anonymous(client, "https://testserver")
    r = https.get("/login", params={"token": new_link(client)}, follow_redirects=False)
    assert r.status_code == 303 and "; secure" in r.headers["set-cookie"].lower()


def test_query_token_only_on_the_event_streams(client: TestClient, app_and_key: tuple[Any, str]) -> None:
    _, key = app_and_key
    routes = [r for r in every_route(client.app.routes) if isinstance(r, APIRoute)]  # type: ignore[attr-defined]
    assert {r.path for r in routes if r.path.endswith("/stream")} == QUERY_TOKEN_ROUTES
    with anonymous(client).stream("GET", "/api/gpus/stream", params={"token": key}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    # a job's stream: past the key check, to the job lookup
    r = anonymous(client).get("/api/jobs/nope/stream", params={"token": key})
    assert r.status_code == 404 and r.json()["error"]["param"] == "job_id"
    assert anonymous(client).get("/api/jobs/nope/stream", params={"token": "rh_wrong"}).status_code == 401
    # everywhere else a key in the URL alone is refused
    assert anonymous(client).get("/api/datasets", params={"token": key}).status_code == 401
    checked = 0
    for route in routes:
        if route.path in QUERY_TOKEN_ROUTES or route.path in ("/api/health", "/", "/login"):
            continue
        path = route.path.replace("{job_id}", "x").replace("{dataset_id}", "x").replace("{step}", "1")
        for method in route.methods or ():
            r = anonymous(client).request(method, path, params={"token": key})
            assert r.status_code == 401, (method, path, r.status_code)
            checked += 1
    assert checked >= 19
    assert anonymous(client).get("/api/health", params={"token": key}).json()["authenticated"] is False


def test_keys_list_shows_no_secret_and_revoke_ends_the_key_and_its_sessions(
    client: TestClient, settings: Settings
) -> None:
    created = cli(settings, "keys", "create", "--name", "ci")
    assert created.returncode == 0, created.stderr
    ci_key = created.stdout.strip()
    assert ci_key.startswith("rh_") and "login?token=rhl_" in created.stderr
    assert "works once, for 10 minutes" in created.stderr
    scripts = anonymous(client)
    scripts.headers["Authorization"] = f"Bearer {ci_key}"
    assert scripts.get("/api/jobs").status_code == 200
    link = cli(settings, "login-url", "--key", ci_key[:8])
    assert link.returncode == 0, link.stderr
    browser = anonymous(client)
    token = parse_qs(urlsplit(link.stdout.strip()).query)["token"][0]
    assert browser.get("/login", params={"token": token}).status_code == 200
    assert browser.get("/api/jobs").status_code == 200

    listed = cli(settings, "keys", "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "PREFIX", "CREATED", "LAST", "USED", "SESSIONS"]
    first_key = client.headers["Authorization"].removeprefix("Bearer ")
    rows = {line.split()[1]: line for line in lines[1:]}
    assert set(rows) == {"first", "ci"}
    assert ci_key[:8] in rows["ci"] and rows["ci"].split()[-1] == "1"  # one browser session
    assert first_key[:8] in rows["first"]
    for secret in (ci_key, first_key, token, browser.cookies[COOKIE]):
        assert secret not in listed.stdout and secret[8:16] not in listed.stdout

    assert cli(settings, "keys", "revoke", "rh_nothing").returncode == 1
    revoked = cli(settings, "keys", "revoke", ci_key[:8])
    assert revoked.returncode == 0, revoked.stderr
    assert "1 browser session(s) ended" in revoked.stdout
    assert scripts.get("/api/jobs").status_code == 401
    assert browser.get("/api/jobs").status_code == 401
    assert browser.get("/api/health").json()["authenticated"] is False
    assert client.get("/api/jobs").status_code == 200  # the other key is untouched
    assert [line.split()[1] for line in cli(settings, "keys", "list").stdout.splitlines()[1:]] == ["first"]
    # a link for the revoked key can no longer be made; revoke by id works too
    assert cli(settings, "login-url", "--key", ci_key[:8]).returncode == 1
    assert cli(settings, "keys", "revoke", "1").returncode == 0
    assert client.get("/api/jobs").status_code == 401


def test_login_url_without_a_key_binds_the_first_key(client: TestClient, settings: Settings) -> None:
    out = cli(settings, "login-url")
    assert out.returncode == 0, out.stderr
    url = urlsplit(out.stdout.strip())
    assert (url.scheme, url.netloc, url.path) == ("http", f"{settings.host}:{settings.port}", "/login")
    browser = anonymous(client)
    assert browser.get(f"/login?{url.query}").status_code == 200
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        ((first, sessions),) = keys.list_keys(session)
    assert first.name == "first" and sessions == 1


def test_migration_0003_adds_browser_sessions_as_declared(database_url: str) -> None:
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect

    from server.db import MIGRATIONS, make_engine
    from server.tables import Base

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    steps = ((command.upgrade, "0002"), (command.upgrade, "0003"), (command.downgrade, "0002"))
    for step, target in (*steps, (command.upgrade, "0003")):
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, target)
            tables = inspect(conn).get_table_names()
            assert ("browser_sessions" in tables) == (target == "0003"), target
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert [d for d in diff if "browser_sessions" in repr(d)] == []
