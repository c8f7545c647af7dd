"""benchmarks/float8_traffic.py: the bytes each kind of kernel moves.

``_hlo.Program.traffic`` is checked on the hand-written module of
``test_float8_profile.py`` (every kernel's bytes worked out by hand), the
recipe's default on the float8 profile's decoder compiled here (the proxy
behind keeping attention's matmuls out of float8), and the script runs
``--small`` end to end (integration). Compiling for a GPU without one needs
JAX's CUDA plugin, which the tests do not install: BENCHMARKS.md has that
run.
"""

import importlib.util
import pathlib
import subprocess
import sys

import benchmark_modules
import jax
import pytest
import report_tables
import versions

hlo = benchmark_modules.load("_hlo")
traffic = benchmark_modules.load("float8_traffic")

pytestmark = pytest.mark.standard_promotion  # optax's adam

HAND_WRITTEN = (
  pathlib.Path(__file__).parent / "data" / "float8_kernels.hlo"
).read_text()
BENCH = pathlib.Path(__file__).parent.parent / "benchmarks"

#: Each kernel of the hand-written module: its category and the bytes of its
#: result and of its operands, each operand once (bf16[64,128] is 16384
#: bytes, f8e4m3fn[64,128] 8192, bf16[128,32] 8192, a float32 scalar 4).
HAND_BYTES = {
  "amax.x": ("amax", 4 + 16384),
  "scale.x": ("other", 4 + 4),
  "cast.x": ("cast", 8192 + 16384 + 4),
  "cast.w": ("cast", 4096 + 8192 + 4),
  "transpose.x": ("transpose/copy", 8192 + 8192),
  # bf16[64,32] (the scratch buffer s8[1024] not counted) from both float8
  # operands and the scale, passed twice and read once
  "gemm.f8": ("GEMM", 4096 + 8192 + 4096 + 4),
  "partial.y": ("amax", 8 + 16384),
  "stage.y": ("amax", 4 + 8),
  "produced": ("other", (16384 + 4) + 16384),
  "row.max": ("other", 256 + 16384),
  "gemm.bf16": ("GEMM", 4096 + 16384 + 8192),
  "sum": ("other", 16384 + 16384 + 16384),
  "copy.sum": ("transpose/copy", 16384 + 16384),
  "next": ("other", 4 + 4 + 4),  # the loop's counter and the constant 1
  "twice": ("other", 16384 + 16384),  # reads its one operand once
  "lt.c": ("other", 1 + 4 + 4),
}


def test_hand_written_module_traffic():
  program = hlo.Program(HAND_WRITTEN)
  assert set(program.categories()) == set(HAND_BYTES)
  want = dict.fromkeys(hlo.CATEGORIES, 0)
  for category, size in HAND_BYTES.values():
    want[category] += size
  assert program.traffic() == want


@pytest.mark.parametrize(
  "shape, size",
  [
    ("f32[4,8]{1,0}", 128),
    ("bf16[3,5]", 30),
    ("f8e4m3fn[10]{0}", 10),
    ("f8e8m0fnu[6]", 6),
    ("f4e2m1fn[16]", 8),
    ("pred[]", 1),
    ("(f32[2]{0}, s8[1024]{0})", 8 + 1024),
    ("f64[2,2]", 32),
    ("s2[8]", 2),
    ("f6e2m3fn[4]", 4),
    ("token[]", 0),
    ("f32[<=8,2]", 64),  # a dynamic dimension at its bound
  ],
)
def test_nbytes(shape, size):
  assert hlo.nbytes(shape) == size


def test_nbytes_refuses_an_unknown_type():
  with pytest.raises(ValueError, match="unknown element type 'q7'"):
    hlo.nbytes("q7[3]")


#: A cuBLAS GEMM and a cuDNN GEMM fusion, each with its scratch buffer in a
#: tuple beside its result (s8 and u8), and a kernel that reads both.
SCRATCH = """HloModule jit_scratch

%gemm_body (a: bf16[64,32], b: bf16[32,16]) -> (bf16[64,16], u8[4096]) {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %d = bf16[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %w = u8[4096]{0} constant({...})
  ROOT %t = (bf16[64,16]{1,0}, u8[4096]{0}) tuple(%d, %w)
}

%add_body (p: bf16[64,16], q: bf16[64,16]) -> bf16[64,16] {
  %p = bf16[64,16]{1,0} parameter(0)
  %q = bf16[64,16]{1,0} parameter(1)
  ROOT %s = bf16[64,16]{1,0} add(%p, %q)
}

ENTRY %main (x: bf16[64,32], y: bf16[32,16]) -> bf16[64,16] {
  %x = bf16[64,32]{1,0} parameter(0)
  %y = bf16[32,16]{1,0} parameter(1)
  %blas = (bf16[64,16], s8[1024]) custom-call(%x,%y), custom_call_target="__cublas$gemm"
  %dnn = (bf16[64,16]{1,0}, u8[4096]{0}) fusion(%x, %y), kind=kCustom, calls=%gemm_body
  %r1 = bf16[64,16]{1,0} get-tuple-element(%blas), index=0
  %r2 = bf16[64,16]{1,0} get-tuple-element(%dnn), index=0
  ROOT %sum = bf16[64,16]{1,0} fusion(%r1, %r2), kind=kLoop, calls=%add_body
}
"""


def test_a_gemms_scratch_buffer_is_not_counted():
  program = hlo.Program(SCRATCH)
  assert program.categories() == {"blas": "GEMM", "dnn": "GEMM", "sum": "other"}
  gemm = 2048 + 4096 + 1024  # result, x, y: bytes of bf16[64,16], [64,32], [32,16]
  assert program.traffic() == {
    **dict.fromkeys(hlo.CATEGORIES, 0),
    "GEMM": 2 * gemm,
    "other": 3 * 2048,
  }


@pytest.fixture(scope="module")
def decoder_steps():
  """The float8 profile's decoder step (1 layer, d_model 32) compiled here
  for each of the script's variants."""
  size = traffic.parse_sizes("32:1:2:16:2")[0]
  # The decoder broadcasts its positions and optax's adam promotes (a module
  # fixture runs outside the tests' rules).
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    return {
      name: traffic.measure(
        hlo.Program(traffic.compile_step(size, 256, wrap, None).as_text())
      )
      for name, (_, wrap) in traffic.VARIANTS.items()
    }


@versions.xla_figures
def test_attention_in_float8_adds_amax_and_cast_passes(decoder_steps):
  """The default recipe keeps attention's two batched products in bfloat16:
  3 float8 GEMMs for each of the 5 weights' matmuls (the layer's four and
  the output layer's), against 7 with attention's; and fewer bytes in amax
  reductions and casts (the scores, a batch x heads x queries x keys
  tensor, and their gradient are neither reduced nor cast)."""
  default, every = decoder_steps["float8"], decoder_steps["float8, attention too"]
  assert default["float8_gemms"] == 3 * 5
  assert every["float8_gemms"] == 3 * 7
  for kind in ("amax", "cast"):
    assert 0 < default["bytes"][kind] < every["bytes"][kind], kind
  bf16 = decoder_steps["bfloat16"]
  assert bf16["float8_gemms"] == 0
  assert bf16["bytes"]["amax"] == bf16["bytes"]["cast"] == 0
  # The same GEMMs in every variant: the recipe changes their operands' type.
  assert (
    default["kernels"]["GEMM"] == every["kernels"]["GEMM"] == bf16["kernels"]["GEMM"]
  )


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--sizes", "32:2:3:16:2"], "multiple of heads"),
    (["--target", "/nonexistent.txtpb"], "No such file"),
    (["--small", "--target", "/nonexistent.txtpb"], "takes no --target"),
    (["--small", "--vocab", "0"], "--vocab must be at least 1"),
  ],
)
def test_bad_arguments_are_refused(argv, message, capsys, tmp_path):
  with pytest.raises(SystemExit):
    traffic.parse_args(argv)
  assert message in capsys.readouterr().err


def test_a_target_without_its_bandwidth_is_refused(tmp_path, capsys):
  path = tmp_path / "gpu.txtpb"
  path.write_text('device_description_str: "A GPU"\n')
  with pytest.raises(SystemExit):
    traffic.parse_args(["--target", str(path)])
  assert "memory_bandwidth" in capsys.readouterr().err


def test_the_shipped_target_is_read():
  _, target = traffic.read_target(traffic.DEFAULT_TARGET)
  assert target == {"name": "NVIDIA H200", "bandwidth": 4_800_000_000_000}


@pytest.mark.integration
@pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins") is not None,
  reason="a JAX plugin is installed: the script would compile for the GPU",
)
def test_without_the_cuda_plugin_the_script_says_what_it_needs(tmp_path):
  out = tmp_path / "report.md"
  proc = subprocess.run(
    [sys.executable, str(BENCH / "float8_traffic.py"), "--out", str(out)],
    capture_output=True,
    text=True,
    cwd=BENCH.parent,
    timeout=300,
  )
  assert proc.returncode != 0
  assert "cannot compile for NVIDIA H200" in proc.stderr, proc.stderr[-2000:]
  assert "pip install -e '.[cuda]'" in proc.stderr
  assert not out.exists()


@pytest.mark.integration
def test_small_report(tmp_path):
  out = tmp_path / "report.md"
  text = benchmark_modules.run_small("float8_traffic.py", out)
  assert text.startswith("# float8 against bfloat16, compiled for a GPU")
  for d_model in (32, 64):
    part = text[text.index(f"d_model {d_model}, ") :]
    rows = report_tables.table(part, "| step |")
    assert [r[0] for r in rows] == list(traffic.VARIANTS)
    for row in rows:
      megabytes = [report_tables.number(c.split(" (")[0]) for c in row[1:6]]
      assert sum(megabytes) == pytest.approx(report_tables.number(row[6]), abs=0.03)
      assert 0 < report_tables.number(row[6])
    assert rows[0][8:] == ["1.000", "0 (0)"]
    assert [r[9].split(" (")[0] for r in rows[1:]] == [
      "15" if d_model == 64 else "27",
      "21" if d_model == 64 else "39",
    ]
  assert "Traceback" not in text
