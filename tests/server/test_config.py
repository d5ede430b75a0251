"""Settings: env parsing, API keys and key files, the open-server bind rule."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.config import Settings, parse_api_keys
from ntk_service.server import create_app, serve


def test_settings_read_ntk_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NTK_PORT", "9123")
    monkeypatch.setenv("NTK_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("NTK_API_KEYS", "a:read, b:write")
    monkeypatch.setenv("NTK_MODEL_FACTORIES", "lab.models:resnet, lab.models:vit")
    monkeypatch.setenv("NTK_COMPUTE_CONCURRENCY", "3")
    monkeypatch.setenv("NTK_LOG_LEVEL", "DEBUG")
    settings = Settings()
    assert settings.port == 9123
    assert settings.data_dir == tmp_path
    assert settings.api_key_scopes() == {"a": "read", "b": "write"}
    assert settings.allowed_factories == frozenset({"lab.models:resnet", "lab.models:vit"})
    assert settings.compute_concurrency == 3
    assert settings.log_level == "debug"
    assert not settings.is_open


def test_key_file_is_merged_with_keys(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# lab keys\nalice:write\n\nbob:read\n")
    settings = Settings(api_keys="carol:read", api_key_file=key_file)
    assert settings.api_key_scopes() == {"carol": "read", "alice": "write", "bob": "read"}


@pytest.mark.parametrize("text", ["just-a-key", "k:admin", ":read"])
def test_malformed_key_entries_are_refused_with_the_expected_format(text: str) -> None:
    with pytest.raises(ValueError, match="is not 'key:scope' with scope 'read' or 'write'"):
        parse_api_keys(text)
    with pytest.raises(ValidationError, match="NTK_API_KEYS"):
        Settings(api_keys=text)


def test_a_key_no_client_could_send_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="entry 2 has a non-ASCII or control character at position 3; .*ASCII"):
        parse_api_keys("ok-key:read, clé:write")
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# lab keys\nalice:write\nbéa:read\n", encoding="utf-8")
    with pytest.raises(ValidationError, match="NTK_API_KEY_FILE .*entry 2 has a non-ASCII"):
        Settings(api_key_file=key_file)
    # `ntk-service serve` reports it as one line before binding anything.
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)], env={"NTK_API_KEYS": "clé:write"})
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: serve: invalid configuration: ") and "non-ASCII" in result.stderr


def test_missing_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="NTK_API_KEY_FILE: cannot read"):
        Settings(api_key_file=tmp_path / "absent.txt")


def test_open_server_refuses_non_loopback_host(tmp_path: Path) -> None:
    settings = Settings(host="0.0.0.0", data_dir=tmp_path)
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without API keys"):
        serve(settings)
    with pytest.raises(ValueError, match="NTK_API_KEYS"):
        create_app(settings)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_open_server_may_bind_loopback(host: str, tmp_path: Path) -> None:
    create_app(Settings(host=host, data_dir=tmp_path))


def test_keyed_server_may_bind_any_host(tmp_path: Path) -> None:
    create_app(Settings(host="0.0.0.0", api_keys="k:write", data_dir=tmp_path))
