"""This process's resident memory, read from /proc/self/status, and a 20 ms peak sampler
(benchmarks/infinity.py and benchmarks/pretrained.py).

    peak = PeakRSS(); peak.start(); ...; peak.stop.set(); peak.peak["RssAnon"]

``VmRSS`` is ``RssAnon`` (what the process allocated) plus ``RssFile`` (pages of mapped files
it touched: page cache, shared and reclaimable); ``VmHWM`` is the kernel's own VmRSS peak.
"""

from __future__ import annotations

import threading

__all__ = ["PeakRSS", "status"]


def status() -> dict[str, int]:
    """Bytes: VmRSS, RssAnon, RssFile, VmHWM."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class PeakRSS(threading.Thread):
    """Samples this process's RSS every 20 ms; keeps the peaks, overall and per ``phase``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.phase = "setup"
        self.phases: dict[str, dict[str, int]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.sample()

    def sample(self) -> dict[str, int]:
        s = status()
        phase = self.phases.setdefault(self.phase, dict.fromkeys(self.peak, 0))
        for k in self.peak:
            self.peak[k] = max(self.peak[k], s.get(k, 0))
            phase[k] = max(phase[k], s.get(k, 0))
        return s
