"""Kubernetes resource quantities ("8Gi", "500M", "1.5"): the pattern, parsing and conversion."""

from __future__ import annotations

import re
from decimal import Decimal

# The apiserver's own grammar, simplified to what a capacity can be: a decimal number with an
# optional binary (Ki..Ei) or decimal (k, M, G, T, P, E) suffix, or an exponent.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|[eE][+-]?[0-9]+)?$"

_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def parse_quantity(value: str | int) -> Decimal:
    """Return the quantity's value in base units (bytes for memory); ValueError on bad syntax."""
    text = str(value).strip()
    match = re.fullmatch(QUANTITY_PATTERN, text)
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 8Gi, 500M, 2)")
    number, suffix = match.group(1), match.group(3) or ""
    if suffix[:1] in ("e", "E"):
        return Decimal(number) * (Decimal(10) ** int(suffix[1:]))
    return Decimal(number) * _SUFFIXES[suffix]


def quantity_to_gb(value: str | int) -> float:
    """Convert a byte quantity to decimal gigabytes (the unit of `kvferry kvstore --capacity-gb`)."""
    return float(parse_quantity(value) / Decimal(10) ** 9)
