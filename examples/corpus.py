"""The byte-level corpus: :mod:`ds_lioncub.simulate.tasks.corpus`, re-exported under its old name.

The reader ships inside the package (``python -m ds_lioncub.simulate``'s default task reads it wherever
ds_lioncub is installed); the training scripts, benchmarks and tests keep importing ``examples.corpus``.

Run as a module to write the corpus to a file:  python -m examples.corpus --out corpus.bin
"""

from ds_lioncub.simulate.tasks.corpus import (
    DEFAULT_MAX_BYTES,
    Corpus,
    build_corpus,
    load_corpus,
    main,
    pinned_root,
    pinned_sources,
    train_val_split,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Corpus",
    "build_corpus",
    "load_corpus",
    "main",
    "pinned_root",
    "pinned_sources",
    "train_val_split",
]

if __name__ == "__main__":
    main()
