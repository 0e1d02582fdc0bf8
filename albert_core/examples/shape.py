"""The example shape: what one pretraining example looks like, declared once.

An example is `[CLS] A [SEP] B [SEP]` of at most `max_seq_length` tokens, its pair labelled for the pair task
(`objective`), about `short_seq_prob` of them cut to a shorter target; MLM masks about `mask_prob` of its real tokens
in whole-word spans of up to `max_ngram` words. Preprocessing makes the pairs (services.preprocess.config's options),
a run trains on them and masks them (a recipe's [data]), evaluation builds and masks held-out ones alike
(services.eval.evaluate.IntrinsicOptions), and an experiment's [preprocess] table sets the pair task of its cells'
shards. Each of them holds the fields it decides as `shape_field`s: the type, default, meaning and allowed values
are ExampleShape's. tests/test_example_shape.py checks that they agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OBJECTIVES = ("sop", "nsp", "none")  # the pair tasks: sentence order, next sentence, no pair label


def _declared(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ExampleShape:
    max_seq_length: int = _declared(512, "tokens per example, [CLS] and [SEP]s included")
    objective: str = _declared("sop", "the pair task")  # one of OBJECTIVES
    short_seq_prob: float = _declared(0.1, "share of examples with a shorter target")
    mask_prob: float = _declared(0.15, "share of an example's real tokens masked")
    max_ngram: int = _declared(3, "the longest masked span, in words")


def _integer(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(ok: Callable[[float], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v) and ok(v)


# What each field allows: a test of the value, and the words an error says it expected.
ALLOWED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_seq_length": (_integer(5), "an integer >= 5 ([CLS] A [SEP] B [SEP])"),
    "objective": (lambda v: v in OBJECTIVES, f"one of {', '.join(OBJECTIVES)}"),
    "short_seq_prob": (_number(lambda v: 0 <= v <= 1), "a probability in [0, 1]"),
    "mask_prob": (_number(lambda v: 0 < v < 1), "a share in (0, 1)"),
    "max_ngram": (_integer(1), "an integer >= 1"),
}
FIELDS = {f.name: f for f in dataclasses.fields(ExampleShape)}


def shape_field(name: str, **metadata: Any) -> Any:
    """A field of another dataclass that holds the example shape's field `name`: its default and help are
    ExampleShape's (`metadata` adds to them, e.g. a command-line flag), and it is marked `example_shape`."""
    declared = FIELDS[name]
    metadata = {**declared.metadata, "example_shape": name, **metadata}
    return dataclasses.field(default=declared.default, metadata=metadata)


def shape_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` as the example shape's field `name` ("expected ..., got ..."), or None."""
    ok, expected = ALLOWED[name]
    return None if ok(value) else f"expected {expected}, got {value!r}"


def shape_fields(cls: type) -> dict[str, str]:
    """The example shape's fields a dataclass holds: its field name -> the ExampleShape field it is."""
    return {f.name: f.metadata["example_shape"] for f in dataclasses.fields(cls) if "example_shape" in f.metadata}
