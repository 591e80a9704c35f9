"""create_app: where the web UI's files come from."""

from pathlib import Path

from fastapi.testclient import TestClient

from server.app import WEB, create_app
from server.settings import Settings


def test_the_ui_is_served_from_the_configured_web_dir(settings: Settings, tmp_path: Path) -> None:
    web = tmp_path / "web"
    (web / "js").mkdir(parents=True)
    (web / "index.html").write_text("<!doctype html><title>from ROUNDHOUSE_WEB_DIR</title>")
    (web / "js" / "app.js").write_text("export const here = 1;\n")
    with TestClient(create_app(settings.model_copy(update={"web_dir": web}))) as client:
        assert "from ROUNDHOUSE_WEB_DIR" in client.get("/").text
        assert client.get("/static/js/app.js").text == "export const here = 1;\n"


def test_the_source_tree_ui_is_the_default(settings: Settings) -> None:
    assert settings.web_dir is None
    with TestClient(create_app(settings)) as client:
        assert client.get("/").text == (WEB / "index.html").read_text()
