"""number_words: a count in English words, as SmolVLM's video prompt spells its frame count (num2words'
British style: "twenty-one", "one hundred and five")."""

from __future__ import annotations

_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """0 <= n < 1,000,000 in words."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"number_words: {n} is out of range")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else "")
    if n < 1000:
        rest = n % 100
        return f"{_ONES[n // 100]} hundred" + (f" and {number_words(rest)}" if rest else "")
    rest = n % 1000
    head = f"{number_words(n // 1000)} thousand"
    if not rest:
        return head
    return head + (" and " if rest < 100 else ", ") + number_words(rest)
