"""The documentation a user reads stays true: the option reference is what the option models render, every
option has a docstring, and every relative link in README.md and docs/ leads somewhere."""

from __future__ import annotations

import inspect
from pathlib import Path

from pydantic import BaseModel

from ds_lioncub.config import LionCubConfig
from ds_lioncub.config_reference import COMMAND, main, render

REPO = Path(__file__).resolve().parents[2]


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and every option block nested in it, by walking the fields' annotations."""
    found = [model]
    for field in model.model_fields.values():
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if inspect.isclass(candidate) and issubclass(candidate, BaseModel) and candidate not in found:
                found += [m for m in _models(candidate) if m not in found]
    return found


def test_the_committed_option_reference_is_current() -> None:
    committed = (REPO / "docs" / "options.md").read_text()
    assert committed == render(), f"docs/options.md is stale: run `{COMMAND}` and commit the result"


def test_the_reference_command_writes_and_checks(tmp_path: Path) -> None:
    stale = tmp_path / "options.md"
    stale.write_text("# hand-edited\n")
    assert main(["--check", str(stale)]) == 1
    assert main(["--write", str(stale)]) == 0 and stale.read_text() == render()
    assert main(["--check", str(stale)]) == 0


def test_every_option_of_every_block_has_a_docstring() -> None:
    models = _models(LionCubConfig)
    assert {m.__name__ for m in models} >= {
        "LionCubConfig",
        "MomentumSyncConfig",
        "ConsistencyCheckConfig",
        "HybridConfig",
        "NetworkConfig",
        "TelemetryConfig",
    }
    undocumented = [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert undocumented == [], f"options without a docstring under the field: {undocumented}"
    assert all((model.__doc__ or "").strip() for model in models)


def test_every_option_appears_in_the_reference() -> None:
    text = render()
    for model in _models(LionCubConfig):
        for name in model.model_fields:
            assert f"`{name}`" in text or f".{name}`" in text, name
