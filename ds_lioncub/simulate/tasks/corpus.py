"""Byte-level training corpus that needs no network and has the same bytes on every machine.

By default the corpus is the ``.py`` sources of the DeepSpeed release that ds_lioncub pins
(``deepspeed==0.19.8`` in setup.py): every install of ds_lioncub has them, they are real text with
long-range structure, and a pinned release is the same bytes whatever the Python version, the platform
or the accelerator. They are read in sorted relative-path order, the one file DeepSpeed's build writes
(its git hash and compiled ops) left out, and checked against :data:`PINNED_SHA256` before use: a run
never trains on other bytes without saying so. A user file can be passed instead. Tokens are bytes
(vocabulary 256), so no tokenizer has to be downloaded or trained.

This module is the one place that decides the corpus's bytes (``examples/corpus.py`` re-exports it for the
training scripts; :mod:`ds_lioncub.simulate.tasks.gpt_task` reads it for ``python -m ds_lioncub.simulate``'s
default task): another source of bytes replaces this module, and every user follows.

Run as a module to write the corpus to a file:  python -m ds_lioncub.simulate.tasks.corpus --out corpus.bin
(``python -m examples.corpus`` in a checkout is the same).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_lioncub.errors import LionCubSetupError

DEFAULT_MAX_BYTES = 4_000_000
#: The package whose sources are the default corpus, and the release setup.py pins.
PINNED_PACKAGE = "deepspeed"
PINNED_VERSION = "0.19.8"
#: sha256 of the whole uncapped default corpus (every source, separators included), the bytes the
#: pinned release ships. A cap takes a prefix of these bytes, so one hash covers every cap.
PINNED_SHA256 = "798735a1468f557a40479145cdfaf26cf5ba368c9c6d6145745689114bc74719"
#: Written by DeepSpeed's build (the git hash and the ops compiled on that machine): differs between installs.
_BUILD_GENERATED = frozenset({"git_version_info_installed.py"})
# Separates files so that the model sees where one module ends and the next begins.
_FILE_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    source: str  # human-readable description of where the bytes came from


def pinned_root() -> Path:
    """The installed pinned package's directory, after checking its version (without importing it)."""
    try:
        version = importlib.metadata.version(PINNED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    spec = importlib.util.find_spec(PINNED_PACKAGE)
    if version != PINNED_VERSION or spec is None or not spec.submodule_search_locations:
        found = "is not installed" if version is None else f"is version {version}"
        raise LionCubSetupError(
            f"the default corpus is {PINNED_PACKAGE} {PINNED_VERSION}'s sources, and {PINNED_PACKAGE} {found}. "
            f"Fix: pip install {PINNED_PACKAGE}=={PINNED_VERSION} (ds_lioncub's own requirement), or pass a "
            "corpus file (--corpus)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def pinned_sources(root: Path | None = None) -> list[Path]:
    """The pinned package's .py files, sorted by relative POSIX path, the build-generated file left out."""
    root = pinned_root() if root is None else Path(root)
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py") and f not in _BUILD_GENERATED)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_pinned_bytes() -> bytes:
    """The whole default corpus, checked against :data:`PINNED_SHA256`."""
    root = pinned_root()
    blob = b"".join(path.read_bytes() + _FILE_SEPARATOR for path in pinned_sources(root))
    digest = hashlib.sha256(blob).hexdigest()
    if digest != PINNED_SHA256:
        raise LionCubSetupError(
            f"the {PINNED_PACKAGE} {PINNED_VERSION} sources under {root} are not the pinned corpus (sha256 "
            f"{digest[:16]}..., expected {PINNED_SHA256[:16]}...): files there were edited, added or removed. "
            f"Fix: pip install --force-reinstall --no-deps {PINNED_PACKAGE}=={PINNED_VERSION}, or pass a "
            "corpus file (--corpus)."
        )
    return blob


def _cache_path(cache_dir: Path, max_bytes: int) -> Path:
    # The pinned hash and the cap decide the bytes, so a cache under another key can never be reused.
    return cache_dir / f"pinned_corpus_{PINNED_SHA256[:16]}_{max_bytes}.bin"


def _read_cache(cached: Path) -> bytes | None:
    """The cached bytes if their sha256 is the one written beside them, else None (then they are rebuilt)."""
    digest_file = cached.with_suffix(".sha256")
    if not (cached.exists() and digest_file.exists()):
        return None
    blob = cached.read_bytes()
    return blob if hashlib.sha256(blob).hexdigest() == digest_file.read_text().strip() else None


def _write_atomically(path: Path, data: bytes) -> None:
    # Write then rename: several ranks may build the same cache at the same time.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def build_corpus(
    path: str | Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    cache_dir: str | Path | None = None,
) -> tuple[torch.Tensor, str]:
    """Return (uint8 tensor of bytes, description).

    path: a user file to read instead of the pinned sources. max_bytes <= 0 means no cap.
    cache_dir: where the default corpus may be cached with its sha256 (nothing is written anywhere else); a
        cache whose bytes do not match their digest is rebuilt from the checked sources.
    """
    if path is not None:
        path = Path(path)
        blob = path.read_bytes()
        if max_bytes > 0:
            blob = blob[:max_bytes]
        source = f"file {path} ({len(blob)} bytes)"
    else:
        cached = _cache_path(Path(cache_dir), max_bytes) if cache_dir is not None else None
        from_cache = _read_cache(cached) if cached is not None else None
        if from_cache is not None:
            blob = from_cache
        else:
            blob = _read_pinned_bytes()
            blob = blob[:max_bytes] if max_bytes > 0 else blob
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                # The bytes first, then their digest: a reader that finds the digest finds the bytes it covers.
                _write_atomically(cached, blob)
                _write_atomically(cached.with_suffix(".sha256"), hashlib.sha256(blob).hexdigest().encode())
        source = f"{PINNED_PACKAGE} {PINNED_VERSION} sources ({len(blob)} bytes, sha256 {PINNED_SHA256[:12]}...)"
    if len(blob) == 0:
        raise ValueError(f"empty corpus from {path or PINNED_PACKAGE}")
    # bytearray: torch.frombuffer needs a writable buffer to avoid a warning and a copy later.
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), source


def train_val_split(
    data: torch.Tensor, val_fraction: float = 0.1, block_bytes: int = 32_768
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-interleaved split: the data is cut into blocks and a val_fraction of them, spread
    evenly, becomes validation.

    A plain tail split would make the last directories in sorted order the whole validation set,
    code of another kind than the training split's.
    Blocks keep val text out of every training window except across a block boundary.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    blocks = list(data.split(block_bytes))
    # Block i is val when i * f and (i + 1) * f fall on different integers: exactly floor(n * f)
    # val blocks, evenly spaced, the first one at index ceil(1 / f) - 1.
    is_val = [math.floor((i + 1) * val_fraction) > math.floor(i * val_fraction) for i in range(len(blocks))]
    if not any(is_val) or all(is_val):  # too little data for blocks: fall back to a tail split
        n_val = max(1, int(len(data) * val_fraction))
        return data[:-n_val], data[-n_val:]
    train = torch.cat([b for b, v in zip(blocks, is_val, strict=True) if not v])
    val = torch.cat([b for b, v in zip(blocks, is_val, strict=True) if v])
    return train, val


def load_corpus(
    path: str | Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = 0.1,
    cache_dir: str | Path | None = None,
) -> Corpus:
    data, source = build_corpus(path, max_bytes, cache_dir)
    train, val = train_val_split(data, val_fraction)
    return Corpus(train=train, val=val, source=source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=None, help="read this file instead of the pinned sources")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="cap (<= 0: no cap)")
    parser.add_argument("--out", type=Path, default=None, help="write the corpus bytes here")
    args = parser.parse_args()
    data, source = build_corpus(args.corpus, args.max_bytes)
    print(f"{source}; sha256 {hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(data.numpy().tobytes())
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
