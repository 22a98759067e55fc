"""The default corpus is the pinned DeepSpeed release's sources, the same bytes everywhere, or an error.

The reference is pip's own record of the install (``RECORD`` in the dist-info folder: every installed
file with the sha256 of the bytes the release shipped), read without the corpus module.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import shutil
from pathlib import Path

import pytest

from ds_lioncub.errors import LionCubSetupError
from ds_lioncub.simulate.tasks import corpus


def recorded_sources() -> list[tuple[str, str]]:
    """(path under the package, urlsafe-base64 sha256) of each .py file pip installed, sorted by path."""
    dist = importlib.metadata.distribution(corpus.PINNED_PACKAGE)
    record = dist.read_text("RECORD")
    assert record is not None
    rows = []
    prefix = f"{corpus.PINNED_PACKAGE}/"
    for path, digest, _size in csv.reader(record.splitlines()):
        if path.startswith(prefix) and path.endswith(".py") and "__pycache__" not in path:
            rows.append((path[len(prefix) :], digest.removeprefix("sha256=")))
    return sorted(rows)


def urlsafe_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_the_default_corpus_is_the_pinned_release_as_pip_recorded_it() -> None:
    root = corpus.pinned_root()
    recorded = [(name, digest) for name, digest in recorded_sources() if name != "git_version_info_installed.py"]
    files = corpus.pinned_sources()
    assert [p.relative_to(root).as_posix() for p in files] == [name for name, _ in recorded]
    # Every file is the bytes the release shipped, and the corpus is them in that order.
    for path, (_name, digest) in zip(files, recorded, strict=True):
        assert urlsafe_sha256(path.read_bytes()) == digest, path
    expected = b"".join(path.read_bytes() + b"\n\n" for path in files)
    assert hashlib.sha256(expected).hexdigest() == corpus.PINNED_SHA256
    data, source = corpus.build_corpus(max_bytes=0)
    assert data.numpy().tobytes() == expected
    assert "deepspeed 0.19.8" in source
    # A cap is a prefix of the same bytes, so one hash pins every cap.
    capped, _ = corpus.build_corpus(max_bytes=100_000)
    assert capped.numpy().tobytes() == expected[:100_000]


def test_the_build_generated_file_is_left_out() -> None:
    # DeepSpeed's build writes its git hash and the ops compiled on that machine into this file.
    names = {p.name for p in corpus.pinned_sources()}
    assert "git_version_info_installed.py" not in names
    assert (corpus.pinned_root() / "git_version_info_installed.py").exists()


def test_edited_sources_are_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "deepspeed"
    # Only the .py files (and the folders): the corpus reads nothing else.
    root = corpus.pinned_root()
    for path in corpus.pinned_sources(root):
        destination = copy / path.relative_to(root)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, destination)
    monkeypatch.setattr(corpus, "pinned_root", lambda: copy)
    assert corpus.build_corpus(max_bytes=1000)[0].numel() == 1000  # the untouched copy passes
    target = copy / "constants.py"
    target.write_bytes(target.read_bytes() + b"# edited\n")
    with pytest.raises(LionCubSetupError, match=r"^LionCub: .*not the pinned corpus.*force-reinstall.*--corpus"):
        corpus.build_corpus(max_bytes=1000)


def test_another_release_is_refused_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus.importlib.metadata, "version", lambda name: "0.18.0")
    with pytest.raises(LionCubSetupError, match=r"is version 0\.18\.0.*pip install deepspeed==0\.19\.8"):
        corpus.build_corpus()


def test_a_user_file_replaces_the_pinned_sources(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_bytes(b"abcdef" * 10)
    data, source = corpus.build_corpus(text, max_bytes=20)
    assert data.numpy().tobytes() == (b"abcdef" * 10)[:20]
    assert str(text) in source


def test_the_cache_holds_the_checked_bytes_and_a_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    expected = b"".join(path.read_bytes() + b"\n\n" for path in corpus.pinned_sources())[:5000]
    first, _ = corpus.build_corpus(max_bytes=5000, cache_dir=tmp_path)
    cached = next(tmp_path.glob("*.bin"))
    assert corpus.PINNED_SHA256[:16] in cached.name and cached.read_bytes() == expected
    assert first.numpy().tobytes() == expected
    assert corpus.build_corpus(max_bytes=5000, cache_dir=tmp_path)[0].numpy().tobytes() == expected
    cached.write_bytes(b"x" + expected[1:])  # a damaged cache
    assert corpus.build_corpus(max_bytes=5000, cache_dir=tmp_path)[0].numpy().tobytes() == expected
    assert cached.read_bytes() == expected  # rebuilt
