"""Megatron-LM's ``--moe-layer-freq``: which transformer layers are expert layers.

Megatron-LM (``megatron/training/arguments.py``' ``moe_freq_type``, read at
core_v0.16.1) takes either

* an integer ``N``: layer ``i`` (from 0) is an expert layer when ``i % N ==
  0`` (``get_gpt_decoder_layer_specs``), so ``1`` (the default) makes every
  layer one;
* a Python list expression, ``"([0]*3+[1]*58)"`` or ``"([1]*3+[0]*1)*3"``:
  one ``1`` (expert layer) or ``0`` (dense layer) per layer. Megatron-LM
  allows only the characters ``, 0-9 [ ] ( ) + *`` and then calls ``eval``;
  the list must have one entry per layer, each 0 or 1.

:func:`moe_layer_freq` reads both without ``eval``: a small bounded parser for
the forms Megatron-LM documents, list displays of integers (a trailing comma
allowed), ``+`` joining lists or adding integers, ``*`` repeating a list or
multiplying integers, parentheses to group. Every other form (a tuple,
subscripts, ``**``, signs, a list inside a list, a pattern longer than
:data:`MAX_PATTERN_LAYERS`) is refused with one line.
"""

from __future__ import annotations

import re

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.moe import moe_layer_pattern

__all__ = ["MAX_PATTERN_CHARS", "MAX_PATTERN_LAYERS", "moe_layer_freq"]

#: Longest pattern text read (a list spelling out 10,000 layers is ~20,000).
MAX_PATTERN_CHARS = 65_536
#: Longest list a pattern may build, and largest integer it may use.
MAX_PATTERN_LAYERS = 65_536
#: Deepest nesting of parentheses and brackets.
_MAX_DEPTH = 64
#: Megatron-LM's ``_eval_pattern`` refuses any other character.
_FORBIDDEN = re.compile(r"[^,\d\[\]\(\)\+\*]")
_TOKEN = re.compile(r"\d+|\*\*|[\[\](),+*]")
_FLAG = "--moe-layer-freq"
_FORMS = (
    "a positive integer N, or a list expression of 0s and 1s such as ([0]*3+[1]*58)"
)


def _refuse(text: str, why: str) -> ProblemError:
    shown = text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"
    return ProblemError(f"Megatron arguments: {_FLAG} {shown!r}: {why}")


class _Parser:
    """Recursive descent over the tokens, with Python's precedence
    (``*`` before ``+``, both left to right). Values are ``int`` or
    ``list[int]``."""

    def __init__(self, text: str, tokens: list[str]) -> None:
        self.text, self.tokens, self.at = text, tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str) -> None:
        if self.peek() != expected:
            raise self.unexpected()
        self.at += 1

    def unexpected(self) -> ProblemError:
        token = self.peek()
        if token is None:
            return _refuse(self.text, f"ends too early; expected {_FORMS}")
        return _refuse(self.text, f"unexpected {token!r}; expected {_FORMS}")

    def expression(self, depth: int) -> int | list[int]:
        value = self.term(depth)
        while self.peek() == "+":
            self.at += 1
            value = self.combine(value, self.term(depth), "+")
        return value

    def term(self, depth: int) -> int | list[int]:
        value = self.factor(depth)
        while self.peek() == "*":
            self.at += 1
            value = self.combine(value, self.factor(depth), "*")
        return value

    def factor(self, depth: int) -> int | list[int]:
        if depth > _MAX_DEPTH:
            raise _refuse(self.text, f"nests deeper than {_MAX_DEPTH} levels")
        token = self.peek()
        if token is not None and token.isdigit():
            self.at += 1
            # Python refuses leading zeros ("01"), as Megatron-LM's eval does
            if len(token) > 1 and token.strip("0") and token[0] == "0":
                raise _refuse(self.text, f"{token!r} is not a Python integer")
            if len(token) > len(str(MAX_PATTERN_LAYERS)):
                raise _refuse(self.text, f"{token[:20]!r} is too large")
            return self.bounded(int(token))
        if token == "(":
            self.at += 1
            value = self.expression(depth + 1)
            if self.peek() == ",":
                raise _refuse(self.text, "a tuple is not a list")
            self.take(")")
            return value
        if token == "[":
            self.at += 1
            items: list[int] = []
            while self.peek() != "]":
                item = self.expression(depth + 1)
                if isinstance(item, list):
                    raise _refuse(self.text, "a list inside the list")
                items.append(item)
                if self.peek() != ",":
                    break
                self.at += 1
            self.take("]")
            if self.peek() == "[":
                raise _refuse(self.text, "subscripts are not read")
            return self.bounded(items)
        raise self.unexpected()

    def combine(
        self, left: int | list[int], right: int | list[int], op: str
    ) -> int | list[int]:
        lists = isinstance(left, list) + isinstance(right, list)
        if op == "+" and lists == 1:
            raise _refuse(self.text, "adds a list and an integer")
        if op == "*" and lists == 2:
            raise _refuse(self.text, "multiplies two lists")
        if op == "+":
            return self.bounded(left + right)  # type: ignore[operator]
        if lists:
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * times > MAX_PATTERN_LAYERS:  # type: ignore[operator]
                raise self.too_long()
            return items * times  # type: ignore[operator]
        return self.bounded(left * right)  # type: ignore[operator]

    def bounded(self, value: int | list[int]) -> int | list[int]:
        size = len(value) if isinstance(value, list) else value
        if size > MAX_PATTERN_LAYERS:
            raise self.too_long()
        return value

    def too_long(self) -> ProblemError:
        return _refuse(self.text, f"builds more than {MAX_PATTERN_LAYERS:,} entries")


def _pattern(text: str) -> list[int]:
    if len(text) > MAX_PATTERN_CHARS:
        raise _refuse(text, f"is longer than {MAX_PATTERN_CHARS:,} characters")
    bad = _FORBIDDEN.search(text)
    if bad:
        # Megatron-LM's _eval_pattern refuses it too ("Invalid pattern")
        raise _refuse(
            text, f"{bad.group()!r} is not allowed (only , digits [ ] ( ) + *)"
        )
    tokens = _TOKEN.findall(text)
    if "**" in tokens:
        raise _refuse(text, f"'**' is not read; expected {_FORMS}")
    parser = _Parser(text, tokens)
    value = parser.expression(0)
    if parser.peek() is not None:
        raise parser.unexpected()
    if not isinstance(value, list):  # (no list expression reduces to an int)
        raise _refuse(text, f"is not a list; expected {_FORMS}")
    return value


def moe_layer_freq(text: str, num_layers: int) -> tuple[bool, ...]:
    """Which of ``num_layers`` layers are expert layers under
    ``--moe-layer-freq text`` (module docstring).

    Raises:
        ProblemError: a form not read here or that Megatron-LM refuses, a
            frequency that is not positive, a list whose length is not
            ``num_layers`` or with entries other than 0 and 1 (Megatron Core's
            ``get_gpt_decoder_layer_specs`` refuses both).
    """
    if "[" not in text:
        try:
            if len(text) > 40:  # (int() of thousands of digits takes long)
                raise ValueError(text)
            freq = int(text)
        except ValueError:
            raise _refuse(text, f"expected {_FORMS}") from None
        if freq <= 0:
            # (Megatron-LM takes i % N: N = 0 fails, N < 0 is no frequency)
            raise _refuse(text, "the frequency must be a positive integer")
        # N > L makes only layer 0 an expert layer, as N = L does
        return moe_layer_pattern(num_layers, freq=min(freq, num_layers))
    pattern = _pattern(text)
    if len(pattern) != num_layers:
        raise _refuse(
            text,
            f"names {len(pattern)} layers, --num-layers is {num_layers} (Megatron "
            "Core asserts they agree)",
        )
    if any(entry not in (0, 1) for entry in pattern):
        raise _refuse(text, "each entry must be 0 (dense) or 1 (experts)")
    return tuple(entry == 1 for entry in pattern)
