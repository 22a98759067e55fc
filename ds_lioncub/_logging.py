"""The package logger."""

from __future__ import annotations

import logging

LOGGER_NAME = "ds_lioncub"


def get_logger() -> logging.Logger:
    """The ``ds_lioncub`` logger: INFO to stderr unless the application configured it."""
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [ds_lioncub] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
