"""The privileged commands netcluster issues (``ip``, ``tc``), and whether this machine allows them."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


class NetclusterError(RuntimeError):
    """Setting up, running or tearing down an emulated cluster failed; the message says why."""


NOT_ROOT_MESSAGE = (
    "netcluster needs root: it creates network namespaces, veth links and tc qdiscs. "
    "Run it as root (e.g. `sudo -E .venv/bin/python -m benchmarks.netcluster ...`)."
)


def run(args: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run one command; on failure raise :class:`NetclusterError` with the command and its stderr."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as error:
        raise NetclusterError(f"`{args[0]}` not found; netcluster needs iproute2 (ip, tc)") from error
    except subprocess.TimeoutExpired as error:
        raise NetclusterError(f"`{' '.join(args)}` did not finish in {timeout} s") from error
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise NetclusterError(f"`{' '.join(args)}` failed with exit code {done.returncode}: {detail}")
    return done


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip [-n NETNS] ARGS``."""
    return run(["ip", *(["-n", netns] if netns else []), *args], check=check)


def tc(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``tc [-n NETNS] ARGS``."""
    return run(["tc", *(["-n", netns] if netns else []), *args], check=check)


def is_root() -> bool:
    return os.geteuid() == 0


def require_root() -> None:
    if not is_root():
        raise NetclusterError(NOT_ROOT_MESSAGE)


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here (``None``: they can). Creates and removes one probe."""
    if not is_root():
        return NOT_ROOT_MESSAGE
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"ncl-probe-{os.getpid()}"
    created = run(["ip", "netns", "add", probe], check=False)
    if created.returncode != 0:
        return f"`ip netns add` does not work here: {created.stderr.strip()}"
    run(["ip", "netns", "del", probe], check=False)
    return None


def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    done = ip("netns", "list")
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    """Processes running inside namespace ``name``."""
    done = ip("netns", "pids", name, check=False)
    return [int(token) for token in done.stdout.split() if token.isdigit()]
