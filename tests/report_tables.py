"""Reading the Markdown tables the benchmark reports write."""

import re


def table(text, first_header):
  """The rows (lists of cells) of the table whose header starts so."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
  rows = []
  for line in lines[start + 2 :]:
    if not line.startswith("|"):
      break
    rows.append([c.strip() for c in line.strip().strip("|").split("|")])
  assert rows, f"no rows under {first_header!r}"
  return rows


def number(cell, unit=""):
  """A cell's number (bold or not, an exponent allowed), in ``unit``."""
  match = re.fullmatch(rf"\**([+-]?[0-9.]+(?:e[+-]?\d+)?)\**\s*{re.escape(unit)}", cell)
  assert match, f"{cell!r} is not a number in {unit or 'no unit'}"
  return float(match.group(1))
