"""benchmarks/float8_sizes.py: its shapes, its break-even, its report."""

import benchmark_modules
import pytest
import report_tables

sizes = benchmark_modules.load("float8_sizes")


def test_shapes_parse_and_bad_ones_are_refused():
  assert sizes.parse_shapes("1:2:3,4:5:6") == [(1, 2, 3), (4, 5, 6)]
  assert len(sizes.parse_shapes(sizes.SHAPES)) == 24
  for bad in ("", "1:2", "1:2:0", "1:2:x", "1:2:3:4", "-1:2:3"):
    with pytest.raises(ValueError):
      sizes.parse_shapes(bad)


@pytest.mark.parametrize(
  "ratios, want",
  [
    # (shape, float8 speed-up): the least min(M, K, N) above which all win
    ({(8, 64, 64): 0.5, (64, 64, 64): 1.2, (128, 128, 128): 1.5}, 64),
    ({(8, 64, 64): 1.1, (64, 64, 64): 1.2}, 8),
    ({(8, 64, 64): 1.1, (64, 64, 64): 0.9, (128, 128, 128): 1.5}, 128),
    ({(64, 64, 64): 0.9, (128, 128, 128): 1.0}, None),  # equal is not faster
  ],
)
def test_the_break_even_is_where_every_larger_shape_wins(ratios, want):
  # each float8 recipe has its own: the other's speed-ups do not count
  for recipe in sizes.FLOAT8:
    for other in (0.5, 2.0):  # the other recipe always losing, always winning
      results = {
        s: {"speed-up": {**dict.fromkeys(sizes.FLOAT8, other), recipe: r}}
        for s, r in ratios.items()
      }
      assert sizes.break_even(results, recipe) == want


@pytest.mark.integration
def test_the_small_run_reports_each_shape(tmp_path):
  text = benchmark_modules.run_small("float8_sizes.py", tmp_path / "sizes.md")
  assert "error" not in text
  rows = report_tables.table(text, "| M | K | N |")
  shapes = sizes.parse_shapes(sizes.SMALL["shapes"])
  assert [tuple(int(c) for c in r[:3]) for r in rows] == shapes
  n = len(sizes.FLOAT8)
  # float8, with power-of-two scales, with fast accumulation in the gradients
  assert n == 3
  for row in rows:
    times = [float(c) for c in row[3 : 4 + n]]
    assert all(t > 0 for t in times)
    for i in range(n):  # each recipe's speed-up is bfloat16's time over its own
      got = report_tables.number(row[4 + n + i])
      assert got == pytest.approx(times[0] / times[1 + i], rel=0.02)
  assert "Least `min(M, K, N)` from which the recipe was faster" in text
  for recipe in sizes.FLOAT8:
    assert f"\n- {recipe}: " in text
