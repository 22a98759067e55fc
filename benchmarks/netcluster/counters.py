"""Bytes and packets on the wire, from the kernel's interface counters.

``/sys/class/net/<if>/statistics/{tx,rx}_{bytes,packets}`` count every frame the interface sent
or received (Ethernet header included, preamble and FCS not), whatever produced it: payload, TCP/IP
headers, ACKs, retransmissions, ARP. A process started by ``ip netns exec`` sees its own
namespace's interfaces there (ip remounts /sys), so a rank can read its link with
:func:`read_sysfs`; from outside, :func:`read_in_netns` reads a namespace's interface.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from benchmarks.netcluster.system import NetclusterError, run

SYSFS_NET = Path("/sys/class/net")
FIELDS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")


@dataclass(frozen=True)
class Counters:
    """A snapshot (or a difference of two snapshots) of one interface's counters."""

    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_packets: int = 0
    rx_packets: int = 0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> Counters:
        missing = [name for name in FIELDS if name not in values]
        if missing:
            raise ValueError(f"counters are missing {missing}")
        return cls(**{name: int(values[name]) for name in FIELDS})


def read_sysfs(ifname: str, root: Path = SYSFS_NET) -> Counters:
    """The counters of ``ifname`` in the calling process's namespace."""
    stats = root / ifname / "statistics"
    try:
        return Counters(**{name: int((stats / name).read_text()) for name in FIELDS})
    except FileNotFoundError as error:
        raise NetclusterError(f"no interface {ifname!r} under {root} (is this process inside the cluster?)") from error


def parse_counters(text: str) -> Counters:
    """Parse ``grep -H . .../statistics/<name>`` output: one ``<path>/<name>:<value>`` line per counter."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        path, sep, value = line.rpartition(":")
        name = os.path.basename(path)
        if not sep or name not in FIELDS:
            raise ValueError(f"unexpected counter line {line!r}")
        values[name] = int(value)
    return Counters.from_dict(values)


def read_in_netns(netns: str, ifname: str) -> Counters:
    """The counters of ``ifname`` inside network namespace ``netns``."""
    paths = [str(SYSFS_NET / ifname / "statistics" / name) for name in FIELDS]
    done = run(["ip", "netns", "exec", netns, "grep", "-H", ".", *paths])
    return parse_counters(done.stdout)


# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): the headers of every TCP frame the ranks send.
TCP_FRAME_HEADERS = 66


def as_mtu_frames(counted: Counters, mtu: int = 1500, headers: int = TCP_FRAME_HEADERS) -> Counters:
    """Estimate the bytes and frames the counted traffic makes when every frame is at most ``mtu``.

    With segmentation offload (the default link) TCP hands a veth up to 64 KiB super-frames, and the
    counters see one set of headers per super-frame; a physical link carries one per MTU-sized
    frame (as the tbf shaper also charges). Each counted packet is taken to carry ``headers`` bytes of
    headers plus payload, and the payload is re-cut into ``mtu - (headers - 14)``-byte segments.
    Traffic counted without offload (``LinkSpec(segment_offload=False)``) comes back nearly unchanged.
    Preamble, inter-frame gap and FCS (24 bytes a frame on copper) are in no counter and not added.
    """
    segment = mtu - (headers - 14)

    def direction(nbytes: int, packets: int) -> tuple[int, int]:
        payload = max(0, nbytes - packets * headers)
        frames = max(packets, -(-payload // segment))
        return payload + frames * headers, frames

    tx_bytes, tx_packets = direction(counted.tx_bytes, counted.tx_packets)
    rx_bytes, rx_packets = direction(counted.rx_bytes, counted.rx_packets)
    return Counters(tx_bytes, rx_bytes, tx_packets, rx_packets)
