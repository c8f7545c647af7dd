"""Command-line argument types the examples share: a bad value is an argparse error.

Each type parses one option's text or raises ``argparse.ArgumentTypeError``
with what it expected, which argparse prints as
``error: argument --steps: must be an integer >= 1, got '0'`` and exits 2.
Checks across options (a width divisible by the heads, a step index below
the number of steps) are :func:`require`, which ends the same way.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def default_out(*parts: str) -> str:
  """``examples/out/...``, wherever the example is started from."""
  return os.path.join(HERE, "out", *parts)


def int_in(minimum: int, maximum: int | None = None):
  """An integer option in ``[minimum, maximum]`` (no maximum: ``None``)."""
  expected = (
    f"an integer >= {minimum}"
    if maximum is None
    else f"an integer in [{minimum}, {maximum}]"
  )

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
      raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value

  return parse


def int_at_least(minimum: int):
  """An integer option that must be at least ``minimum``."""
  return int_in(minimum)


def _number(text: str, ok, expected: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not ok(value):
    raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
  return value


def positive_float(text: str) -> float:
  """A finite number above 0."""
  return _number(text, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def fraction(text: str) -> float:
  """A number strictly between 0 and 1."""
  return _number(text, lambda v: 0 < v < 1, "a number in (0, 1)")


def steps_list(text: str) -> list[int]:
  """A comma-separated list of step indices (>= 0); empty for none."""
  if not text.strip():
    return []
  try:
    steps = [int(s) for s in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"must be comma-separated step indices such as 10,11,40, got {text!r}"
    ) from None
  if any(s < 0 for s in steps):
    raise argparse.ArgumentTypeError(f"step indices must be >= 0, got {text!r}")
  return steps


def directory(text: str) -> str:
  """A directory, made absolute (so it means the same from any directory)."""
  if not text:
    raise argparse.ArgumentTypeError("must be a directory, got ''")
  return os.path.abspath(text)


def parser(
  description: str,
  *,
  steps: int,
  batch: int,
  log_every: int | None = None,
  seed: str | None = None,
) -> argparse.ArgumentParser:
  """A parser with the options the training examples share.

  ``--steps`` and ``--batch`` always; ``--log-every`` with a default and
  ``--seed`` (an integer >= 0; NumPy's generators refuse negative seeds)
  with its help text, when given.
  """
  p = argparse.ArgumentParser(
    description=description,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument("--steps", type=int_at_least(1), default=steps, help="training steps")
  p.add_argument("--batch", type=int_at_least(1), default=batch, help="batch size")
  if log_every is not None:
    p.add_argument(
      "--log-every",
      type=int_at_least(1),
      default=log_every,
      help="print a line every this many steps",
    )
  if seed is not None:
    p.add_argument("--seed", type=int_at_least(0), default=0, help=seed)
  return p


def shown(path: str) -> str:
  """``path`` as printed: relative to the working directory when inside it."""
  relative = os.path.relpath(path)
  return path if relative.startswith(os.pardir) else relative


def require(parser: argparse.ArgumentParser, ok: bool, message: str) -> None:
  """``parser.error(message)`` (exit 2) unless ``ok``."""
  if not ok:
    parser.error(message)


def missing(names: list, message: str) -> None:
  """Exits with status 2 and ``error: message`` if ``names`` (the input files
  a command reads) is not empty: the same status and form as a bad argument."""
  if names:
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
