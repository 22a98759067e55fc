"""Byte-level training corpus that needs no network.

By default the corpus is the Python standard library's own ``.py`` sources: every Python install
has them, they are real text with long-range structure, and reading them is deterministic (sorted
relative paths) for a given Python version. A user file can be passed instead. Tokens are bytes
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
import math
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4_000_000
# Third-party packages live inside the stdlib directory on most installs; they are not part of the
# standard library and differ between machines, so they would break determinism.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Separates files so that the model sees where one module ends and the next begins.
_FILE_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    source: str  # human-readable description of where the bytes came from


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """All .py files under the stdlib directory, sorted by relative POSIX path.

    os.walk with pruning instead of rglob: it never descends into site-packages, which can be far
    larger than the stdlib itself.
    """
    root = stdlib_root() if root is None else Path(root)
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_stdlib_bytes(max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_sources():
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable file (permissions, broken link): skipping keeps the order stable
        chunks.append(data + _FILE_SEPARATOR)
        total += len(data) + len(_FILE_SEPARATOR)
        if 0 < max_bytes <= total:
            break
    blob = b"".join(chunks)
    return blob[:max_bytes] if max_bytes > 0 else blob


def _cache_path(cache_dir: Path, max_bytes: int) -> Path:
    # The key covers everything the stdlib corpus depends on, so a stale cache cannot be reused.
    key = f"{sys.version}|{stdlib_root()}|{max_bytes}".encode()
    return cache_dir / f"stdlib_corpus_{hashlib.sha256(key).hexdigest()[:16]}.bin"


def build_corpus(
    path: str | Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    cache_dir: str | Path | None = None,
) -> tuple[torch.Tensor, str]:
    """Return (uint8 tensor of bytes, description).

    path: a user file to read instead of the stdlib. max_bytes <= 0 means no cap.
    cache_dir: where the stdlib corpus may be cached (nothing is written anywhere else).
    """
    if path is not None:
        path = Path(path)
        blob = path.read_bytes()
        if max_bytes > 0:
            blob = blob[:max_bytes]
        source = f"file {path} ({len(blob)} bytes)"
    else:
        cached = _cache_path(Path(cache_dir), max_bytes) if cache_dir is not None else None
        if cached is not None and cached.exists():
            blob = cached.read_bytes()
        else:
            blob = _read_stdlib_bytes(max_bytes)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                # Write then rename: several ranks may build the same cache at the same time.
                fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, cached)
        source = f"python {sys.version_info.major}.{sys.version_info.minor} stdlib sources ({len(blob)} bytes)"
    if len(blob) == 0:
        raise ValueError(f"empty corpus from {path or stdlib_root()}")
    # bytearray: torch.frombuffer needs a writable buffer to avoid a warning and a copy later.
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), source


def train_val_split(
    data: torch.Tensor, val_fraction: float = 0.1, block_bytes: int = 32_768
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-interleaved split: the data is cut into blocks and a val_fraction of them, spread
    evenly, becomes validation.

    A plain tail split would make the sorted stdlib's last directories (email/, encodings/ with
    its code-page tables) the whole validation set, a different distribution from training.
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
    parser.add_argument("--corpus", type=Path, default=None, help="read this file instead of the stdlib")
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
