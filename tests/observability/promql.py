"""The metric names a PromQL expression reads, found by a small tokenizer, and whether an
exposition of `/metrics` has them.

Not a PromQL parser: enough of the language to tell a metric name from everything else an
expression of the shipped dashboard and rules holds. Skipped are strings, label matchers
(`{...}`), ranges and subqueries (`[...]`, durations and Grafana's `$__rate_interval`),
numbers and durations, function and aggregation names (an identifier followed by `(`, or
by `by (...)` or `without (...)`),
keywords (`by`, `without`, `on`, `ignoring`, `group_left`, `group_right`, `bool`,
`offset`, `and`, `or`, `unless`) with the label list that follows a grouping keyword, and
Grafana's `$variables`.
"""

from __future__ import annotations

import re

GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+([eE][+-]?[0-9]+)?)([a-z]+[0-9a-z]*)*")
_GROUPED = re.compile(r"(by|without)\s*\(", re.IGNORECASE)  # `sum by (le) (...)`
_VARIABLE = re.compile(r"\$\{?[A-Za-z0-9_]+\}?")


def _skip_string(text: str, at: int) -> int:
    """The index after the string that starts at `at` (a quote), escapes minded."""
    quote, i = text[at], at + 1
    while i < len(text):
        if text[i] == "\\" and quote != "`":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    raise ValueError(f"an unterminated string at {at}: {text!r}")


def _skip_until(text: str, at: int, close: str) -> int:
    """The index after the `close` that ends the bracket opened at `at`, strings minded."""
    i = at + 1
    while i < len(text):
        if text[i] in "\"'`":
            i = _skip_string(text, i)
            continue
        if text[i] == close:
            return i + 1
        i += 1
    raise ValueError(f"no {close!r} closes the bracket at {at}: {text!r}")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects. ValueError for an expression it cannot read."""
    names: set[str] = set()
    i = 0
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c in "\"'`":
            i = _skip_string(expr, i)
        elif c == "{":
            i = _skip_until(expr, i, "}")
        elif c == "[":
            i = _skip_until(expr, i, "]")
        elif c == "$":
            found = _VARIABLE.match(expr, i)
            if not found:
                raise ValueError(f"a lone $ at {i}: {expr!r}")
            i = found.end()
        elif c.isdigit() or (c == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
            found = _NUMBER.match(expr, i)
            assert found is not None
            i = found.end()
        elif found := _IDENT.match(expr, i):
            word, i = found.group(), found.end()
            rest = expr[i:].lstrip()
            if word.lower() in GROUPING and rest.startswith("("):
                i = _skip_until(expr, len(expr) - len(rest), ")")  # the label list
            elif word.lower() in KEYWORDS or rest.startswith("(") or _GROUPED.match(rest):
                continue  # a keyword, or a function's or an aggregation's name
            else:
                names.add(word)
        else:
            i += 1  # an operator, a parenthesis, a comma
    return names


def exported(exposition: str) -> set[str]:
    """Every name a query may select from `exposition` (the text format): each sample's,
    and those of each declared family, also one with no sample yet (a counter's `_total`
    and `_created`, a histogram's `_bucket`, `_sum`, `_count` and `_created`)."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            if kind == "counter":
                base = name.removesuffix("_total")
                names |= {f"{base}_total", f"{base}_created"}
            elif kind == "histogram":
                names |= {f"{name}_{s}" for s in ("bucket", "sum", "count", "created")}
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            found = _IDENT.match(line)
            if found:
                names.add(found.group())
    return names


def missing(expressions: list[str], exposition: str) -> dict[str, set[str]]:
    """The metric names of each expression that `exposition` does not have (none: {})."""
    have = exported(exposition)
    gaps = {expr: metric_names(expr) - have for expr in expressions}
    return {expr: names for expr, names in gaps.items() if names}


def value(exposition: str, name: str, **labels: str) -> float | None:
    """The sample `name{labels}` of `exposition` (labels in the order they are exported),
    or None when there is none."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    head = f"{name}{{{wanted}}} " if wanted else f"{name} "
    found = [line for line in exposition.splitlines() if line.startswith(head)]
    return float(found[0].split()[-1]) if found else None
