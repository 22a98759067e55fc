"""The documentation a user reads stays true: the option reference is what the option models render, every
option has a docstring, and every relative link in README.md and docs/ leads somewhere."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from ds_lioncub.config import LionCubConfig
from ds_lioncub.config.reference import COMMAND, main, render

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


# ------------------------------------------------------------------------------------------------- links

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"(`+)[^`].*?\1", "", text, flags=re.DOTALL)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation other than - and _ dropped,
    spaces as -, a repeated anchor numbered -1, -2, ..."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.MULTILINE):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
        anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        unique, n = anchor, 0
        while unique in found:
            n += 1
            unique = f"{anchor}-{n}"
        found.add(unique)
    return found


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", target)]


def test_the_anchor_rule_is_githubs() -> None:
    page = REPO / "docs" / "user-guide.md"
    assert {"which-mode-for-my-cluster", "will-my-mode-keep-lions-loss-at-n-workers"} <= anchors(page)
    assert "zero-shard-inside-a-node-vote-across-nodes" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(
                f"{target}: no file {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved}"
            )
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(REPO)}")
    assert broken == [], f"{page.relative_to(REPO)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_no_page_repeats_a_heading(page: Path) -> None:
    """A section moved twice (the user guide once held two copies of two sections) shows as a repeated heading;
    a repeated heading also makes its anchor ambiguous."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)  # code, not headings
    headings = [line.strip() for line in text.splitlines() if line.startswith("#")]
    repeated = sorted({heading for heading in headings if headings.count(heading) > 1})
    assert repeated == [], f"{page.relative_to(REPO)} repeats {repeated}"


def test_the_pages_link_to_each_other() -> None:
    readme = set(relative_links(REPO / "README.md"))
    for page in ("user-guide.md", "options.md", "troubleshooting.md", "benchmarks.md", "design.md"):
        assert f"docs/{page}" in readme, f"README.md does not link docs/{page}"


# ------------------------------------------------------------------------------------------------ layout


def _code_map() -> list[tuple[str, str]]:
    """(first cell, whole row) of docs/design.md's code map table."""
    design = (REPO / "docs" / "design.md").read_text()
    table = design.split("Code map:", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return [(row.split("|")[1].strip(), row) for row in rows]


def test_the_code_map_lists_every_module_and_package() -> None:
    rows = _code_map()
    named = {cell.strip("`") for cell, _ in rows}
    package = REPO / "ds_lioncub"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        folder = path.parent.relative_to(REPO).as_posix() + "/"
        if path.parent != package and folder not in named:
            missing.append(f"{folder} (package)")
        if relative in named or (path.name == "__init__.py" and path.parent != package):
            continue
        package_rows = [row for cell, row in rows if cell.strip("`") == folder]
        if not any(f"`{path.name}`" in row for row in package_rows):
            missing.append(relative)
    assert missing == [], f"docs/design.md's code map does not name: {sorted(set(missing))}"


def test_the_user_guide_summary_names_every_option() -> None:
    guide = (REPO / "docs" / "user-guide.md").read_text().split("\n## Options\n")[1].split("\n## ")[0]
    missing = [name for name in LionCubConfig.model_fields if f"(options.md#{name})" not in guide]
    assert missing == [], f"docs/user-guide.md's option summary does not link {missing}"


# ------------------------------------------------------------------------------------ design.md citations

CITATION = re.compile(r"\b[Ss]ections? (\d+(?:\.\d+)?(?:(?:, | and | or )\d+(?:\.\d+)?)*)(?: \(([^()]+)\))?")


def _design_sections() -> dict[str, str]:
    """Section number -> title of docs/design.md's numbered headings (``## 3. ...``, ``### 4.6 ...``)."""
    text = re.sub(r"^```.*?^```", "", (REPO / "docs" / "design.md").read_text(), flags=re.MULTILINE | re.DOTALL)
    return dict(re.findall(r"^##+ (\d+(?:\.\d+)?)\.? (.+?)\s*$", text, flags=re.MULTILINE))


def _cited_files() -> list[Path]:
    skip = {".git", ".venv", "build", "runs", "node_modules"}
    return [
        path
        for path in sorted(REPO.rglob("*"))
        if path.suffix in (".py", ".md", ".cpp", ".cu", ".h", ".sh")
        and path.is_file()
        and not skip & set(path.relative_to(REPO).parts)
    ]


def test_every_cited_design_section_exists() -> None:
    sections = _design_sections()
    assert sections["3"] == "The 1-bit majority vote" and sections["4.6"].startswith("The vote as one")
    design = REPO / "docs" / "design.md"
    wrong = []
    for path in _cited_files():
        text = path.read_text(errors="replace")
        for match in CITATION.finditer(text):
            before = text[max(0, match.start() - 80) : match.start()]
            if path != design and "design.md" not in before:
                continue  # a section of some other document
            if "paper" in text[max(0, match.start() - 20) : match.start()]:
                continue  # a section of a cited paper
            numbers = re.findall(r"\d+(?:\.\d+)?", match.group(1))
            place = f"{path.relative_to(REPO)}: {match.group(0)!r}"
            wrong += [f"{place}: no section {n}" for n in numbers if n not in sections]
            title = match.group(2)
            if title in sections.values() and len(numbers) == 1 and sections.get(numbers[0]) != title:
                wrong.append(f"{place}: section {numbers[0]} is {sections.get(numbers[0])!r}")
    assert wrong == [], "citations of docs/design.md that point nowhere or at another section:\n" + "\n".join(wrong)
