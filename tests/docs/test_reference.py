"""The reference pages in docs/reference/ are what the code says today: regenerating them
changes nothing (tests/docs/generate.py says where each comes from)."""

from __future__ import annotations

from pathlib import Path

from tests.docs import generate


def test_the_generated_reference_is_up_to_date(tmp_path: Path) -> None:
    generate.write(tmp_path)
    stale = []
    for name in generate.pages():
        committed = generate.OUT / name
        if not committed.exists() or committed.read_text() != (tmp_path / name).read_text():
            stale.append(f"docs/reference/{name}")
    assert stale == [], f"out of date: {stale}; run `{generate.COMMAND}` and commit the pages"


def test_every_key_has_a_comment_in_the_shipped_file() -> None:
    """The configuration reference takes each key's words from etc/turnkeeper.toml."""
    from supervisor.contract.config import Config

    comments = generate.toml_comments((generate.REPO / "etc" / "turnkeeper.toml").read_text())
    missing = []
    for section, field in Config.model_fields.items():
        model = field.annotation
        assert model is not None
        for key, sub in generate._keys(model):  # type: ignore[arg-type]
            entry = generate._entry_model(sub.annotation)
            names = (
                [f"{section}.{key}.{n}" for n, _ in generate._keys(entry)]
                if entry
                else [f"{section}.{key}"]
            )
            missing += [name for name in names if not comments.get(name)]
    assert missing == [], f"keys with no comment in etc/turnkeeper.toml: {missing}"


def test_the_status_shape_is_the_one_the_daemon_answers() -> None:
    """The documented /v1/status is the `Status` model's: host, hosts and hosts_error too."""
    text = (generate.OUT / "http-api.md").read_text()
    section = text.split("### Status\n", 1)[1].split("\n### ", 1)[0]
    from supervisor.http.schemas import Status

    for field in Status.model_fields:
        assert f"| `{field}` |" in section, field
