"""Parsing of tc-style rates (``"100mbit"``) and durations (``"1ms"``) into bits/s and seconds.

:func:`parse_rate` and :func:`parse_duration` read the spellings of tc(8), so that the ``--bandwidth`` and
``--latency`` options of ``gradcomm bench`` and the arguments of
:class:`~gradcomm.testing.network.ShapedNetwork` mean what they would to ``tc``. They need no privileges.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_duration", "parse_rate"]

_NUMBER = r"(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_RATE_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[a-zA-Z]*)\s*$")
# tc(8), "RATES": bit and byte units, SI (powers of 1000) and IEC (powers of 1024), case-insensitive.
_RATE_UNITS: dict[str, float] = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 1024.0,
    "mibit": 1024.0**2,
    "gibit": 1024.0**3,
    "tibit": 1024.0**4,
    "bps": 8.0,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
    "kibps": 8 * 1024.0,
    "mibps": 8 * 1024.0**2,
    "gibps": 8 * 1024.0**3,
    "tibps": 8 * 1024.0**4,
}
_RATE_FORMS = (
    "a positive number with a tc unit: bit, kbit, mbit, gbit, tbit (bits/s, powers of 1000), kibit..tibit "
    "(powers of 1024), or bps, kbps, mbps, gbps, tbps, kibps..tibps (BYTES/s as in tc: 100mbps = 800mbit); "
    "e.g. 100mbit, 1gbit, 2.5gbit, 500kbit"
)

_DURATION_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[a-zA-Zµ]*)\s*$")
_DURATION_UNITS: dict[str, float] = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "ms": 1e-3,
    "msec": 1e-3,
    "msecs": 1e-3,
    "us": 1e-6,
    "usec": 1e-6,
    "usecs": 1e-6,
    "µs": 1e-6,
    "ns": 1e-9,
    "nsec": 1e-9,
    "nsecs": 1e-9,
}
_DURATION_FORMS = (
    "a non-negative number with a unit s, ms, us or ns (also sec, msec, usec, nsec), or 0; "
    "e.g. 1ms, 250us, 0.5s"
)


def parse_rate(text: str) -> int:
    """Bits per second from a tc-style rate such as ``"100mbit"``, ``"1gbit"``, ``"10Gbit"`` or ``"2.5gbit"``.

    Units follow tc(8) and are case-insensitive: ``bit`` (or a bare number), ``kbit``, ``mbit``, ``gbit``,
    ``tbit`` are bits per second in powers of 1000, ``kibit`` .. ``tibit`` in powers of 1024; ``bps``,
    ``kbps``, ``mbps``, ``gbps``, ``tbps`` (and ``kibps`` .. ``tibps``) are **bytes** per second, exactly as
    tc reads them: ``"100mbps"`` is 800,000,000 bit/s, not 100 Mbit/s. The result is rounded to whole bits.

    Raises:
        ValueError: not a positive number with one of these units.
    """
    if not isinstance(text, str):
        raise ValueError(f"rate must be a string such as '100mbit', got {text!r}")
    match = _RATE_RE.match(text)
    unit = match.group("unit").lower() if match else ""
    if match is None or (unit and unit not in _RATE_UNITS):
        raise ValueError(f"invalid rate {text!r}: expected {_RATE_FORMS}")
    bits = float(match.group("num")) * _RATE_UNITS.get(unit, 1.0)
    if not math.isfinite(bits) or round(bits) < 1:
        raise ValueError(f"invalid rate {text!r}: must be at least 1 bit/s; expected {_RATE_FORMS}")
    return int(round(bits))


def parse_duration(text: str) -> float:
    """Seconds from a duration such as ``"1ms"``, ``"250us"``, ``"0.5s"`` or ``"0"``.

    Units: ``s``, ``ms``, ``us`` (or ``µs``), ``ns``, and tc's spellings ``sec``, ``msec``, ``usec``,
    ``nsec`` (with an optional plural ``s``), case-insensitive. A bare number is accepted only for ``0``: tc
    would read a bare ``5`` as microseconds, a reader as seconds, so a unit is required.

    Raises:
        ValueError: not a non-negative number with one of these units.
    """
    if not isinstance(text, str):
        raise ValueError(f"duration must be a string such as '1ms', got {text!r}")
    match = _DURATION_RE.match(text)
    unit = match.group("unit").lower() if match else ""
    if match is None or (unit and unit not in _DURATION_UNITS):
        raise ValueError(f"invalid duration {text!r}: expected {_DURATION_FORMS}")
    value = float(match.group("num"))
    if not unit and value != 0:
        raise ValueError(
            f"invalid duration {text!r}: a unit is required (is it {text}ms or {text}s?); "
            f"expected {_DURATION_FORMS}"
        )
    seconds = value * _DURATION_UNITS.get(unit, 1.0)
    if not math.isfinite(seconds):
        raise ValueError(f"invalid duration {text!r}: expected {_DURATION_FORMS}")
    return seconds
