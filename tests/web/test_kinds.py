"""The UI's table of job statuses and event kinds (web/js/kinds.js) agrees with the server's enums
(server/kinds.py), and every kind the engine sends through its sink is one of them. No browser."""

from __future__ import annotations

import re
from pathlib import Path

from engine.kinds import EngineEvent
from server.kinds import METRIC_KINDS, EventKind, JobStatus
from server.services.jobs import TERMINAL, TRANSITIONS

ROOT = Path(__file__).resolve().parents[2]
KINDS_JS = ROOT / "web" / "js" / "kinds.js"
CSS = ROOT / "web" / "css" / "app.css"


def js_table(name: str) -> dict[str, dict[str, object]]:
    """``export const NAME = { key: { field: "text" | true | false, ... }, ... };`` as a dict."""
    found = re.search(rf"export const {name} = \{{\n(.*?)\n\}};", KINDS_JS.read_text(), re.S)
    assert found, f"no `export const {name} = {{ ... }};` in {KINDS_JS}"
    table: dict[str, dict[str, object]] = {}
    for line in found.group(1).splitlines():
        if not line.strip() or line.strip().startswith("//"):
            continue
        entry = re.fullmatch(r"\s*(\w+): \{ (.*) \},", line)
        assert entry, f"{name}: cannot read the line {line!r}"
        fields = re.findall(r'(\w+): ("[^"]*"|true|false)', entry.group(2))
        table[entry.group(1)] = {k: v.strip('"') if v.startswith('"') else v == "true" for k, v in fields}
    return table


def test_statuses_match_the_server() -> None:
    statuses = js_table("STATUSES")
    assert list(statuses) == list(JobStatus)  # the same names, in the same order (the filter's)
    for name, entry in statuses.items():
        assert set(entry) == {"label", "terminal", "css"}, (name, entry)
        assert entry["terminal"] is (name in TERMINAL), name
        assert entry["terminal"] is (not TRANSITIONS[JobStatus(name)]), name
        assert re.search(rf"\.{entry['css']}\b", CSS.read_text()), f"{entry['css']} has no style in {CSS}"


def test_event_kinds_match_the_server() -> None:
    kinds = js_table("EVENT_KINDS")
    assert list(kinds) == list(EventKind)
    for name, entry in kinds.items():
        assert set(entry) == {"label", "chart"}, (name, entry)
    assert {k for k, entry in kinds.items() if entry["chart"]} == set(METRIC_KINDS)


def test_every_kind_the_engine_sends_is_known() -> None:
    sent, bare = set(), set()
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        sent |= set(re.findall(r"(?:sink\.event|_event)\(\s*EngineEvent\.(\w+)", text))
        bare |= set(re.findall(r"(?:sink\.event|_event)\(\s*\"(\w+)\"", text))
    assert sent, "found no sink.event(EngineEvent...) call in engine/"
    assert not bare, f"engine/ sends kinds as bare strings (use engine.kinds.EngineEvent): {bare}"
    kinds = {EngineEvent[name] for name in sent}
    assert kinds <= set(EventKind), kinds - set(EventKind)
    assert set(EngineEvent) <= set(EventKind), set(EngineEvent) - set(EventKind)
