"""Every example refuses a bad argument with an argparse error, before any work.

Table-driven over the examples and the values a user mistypes first: a
count of 0 or -1, a vocabulary below the 256 byte values, a width that the
heads do not divide, an index out of range, a non-number. Each must exit
with status 2 and a message naming the option (argparse's
``error: argument --steps: ...``), not a traceback from JAX or NumPy.
"""

import importlib
import re
import sys
from pathlib import Path

import pytest
import versions

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = versions.examples

#: (example, its arguments, what the message must say).
CASES = [
  ("train_lm", "--batch 0", "argument --batch: must be an integer >= 1"),
  ("train_lm", "--vocab 100", "argument --vocab: must be an integer in [256, 65536]"),
  ("train_lm", "--vocab 100000000", "--vocab: must be an integer in [256, 65536]"),
  ("train_lm", "--context 10000000", "--context (10000000) must be shorter than the"),
  ("train_lm", "--val-fraction 0.00001", "shorter than the held-out text"),
  ("train_lm", "--steps 0", "argument --steps: must be an integer >= 1"),
  ("train_lm", "--steps -1", "argument --steps: must be an integer >= 1"),
  ("train_lm", "--steps ten", "argument --steps: must be an integer"),
  ("train_lm", "--width 100 --heads 3", "--width (100) must be a multiple of --heads"),
  ("train_lm", "--heads 0", "argument --heads: must be an integer >= 1"),
  ("train_lm", "--lr nan", "argument --lr: must be a finite number > 0"),
  ("train_lm", "--lr -0.001", "argument --lr: must be a finite number > 0"),
  ("train_lm", "--val-fraction 1", "--val-fraction: must be a number in (0, 1)"),
  ("train_lm", "--seed -1", "argument --seed: must be an integer >= 0"),
  ("train_lm", "--accumulation 0", "--accumulation: must be an integer >= 1"),
  ("train_lm", "--initial-scale 1e30", "--initial-scale (1e+30) must lie in [1,"),
  ("train_lm", "--eval-every 0", "--eval-every: must be an integer >= 1"),
  ("train_lm_float8", "--batch 0", "argument --batch: must be an integer >= 1"),
  ("train_lm_float8", "--width 100 --heads 3", "--width (100) must be a multiple of"),
  ("train_digits", "--steps 0", "argument --steps: must be an integer >= 1"),
  ("train_digits", "--batch -5", "argument --batch: must be an integer >= 1"),
  ("train_digits", "--lr 0", "argument --lr: must be a finite number > 0"),
  ("train_digits_8bit", "--steps 0", "argument --steps: must be an integer >= 1"),
  ("train_digits_8bit", "--lr -1", "argument --lr: must be a finite number > 0"),
  ("mixed_precision", "--steps 0", "argument --steps: must be an integer >= 1"),
  ("flax_linen", "--log-every 0", "--log-every: must be an integer >= 1"),
  ("flax_nnx", "--batch 0", "argument --batch: must be an integer >= 1"),
  ("resnet", "--steps 0", "argument --steps: must be an integer >= 1"),
  ("resnet", "--lr nan", "argument --lr: must be a finite number > 0"),
  ("resnet", "--nan-at 200", "--nan-at steps [200] must be below --steps (200)"),
  ("resnet", "--nan-at x", "argument --nan-at: must be comma-separated step"),
  ("data_parallel", "--batch 100", "--batch (100) must be a multiple of --devices"),
  ("data_parallel", "--bad-device 8", "--bad-device (8) must be below --devices (8)"),
  ("data_parallel", "--nan-at 5,60", "--nan-at steps [5, 60] must be below --steps"),
  ("data_parallel", "--nan-at a,b", "argument --nan-at: must be comma-separated step"),
  ("data_parallel", "--devices 0", "argument --devices: must be an integer >= 1"),
  ("multi_process", "--worker 2", "--worker (2) must be in [0, --processes = 2)"),
  ("multi_process", "--bad-process 2", "--bad-process (2) must be below --processes"),
  ("multi_process", "--batch 30", "--batch (30) must be a multiple of all devices"),
  ("multi_process", "--save-at 31", "--save-at (31) must be at most --steps (30)"),
  ("multi_process", "--processes 0", "--processes: must be an integer >= 1"),
  ("multi_process", "--port 70000", "--port: must be an integer in [0, 65535]"),
  ("multi_process", "--coordinator no.such.host.invalid", "is not an address"),
  ("orbax_resume", "--save-at 60", "--save-at (60) must be below --steps (60)"),
  ("orbax_resume", "--save-at 5", "--save-at needs --ckpt"),
  ("orbax_resume", "--resume /no/ckpt/abc", "a checkpoint directory CKPT/STEP"),
  ("orbax_resume", "--batch 0", "argument --batch: must be an integer >= 1"),
  ("orbax_resume", "--nan-at 100", "--nan-at steps [100] must be below --steps (60)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def examples():
  sys.path.insert(0, str(EXAMPLES))
  try:
    yield lambda name: importlib.import_module(name)
  finally:
    sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize(
  "example, argv, message", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES]
)
def test_a_bad_argument_is_an_argparse_error(examples, capsys, example, argv, message):
  with pytest.raises(SystemExit) as exit_:
    examples(example).parse_args(argv.split())
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert "error: " in err and message in err, err


#: (example, its arguments, what the message must say): the arguments parse,
#: but the files they name are missing when the command runs.
MISSING_INPUTS = [
  ("multi_process", "--compare --out {tmp}", "--compare needs the runs' results in"),
  ("orbax_resume", "--resume {tmp}/ckpt/3", "must be an existing checkpoint directory"),
]


@pytest.mark.parametrize(
  "example, argv, message", MISSING_INPUTS, ids=[c[0] for c in MISSING_INPUTS]
)
def test_missing_inputs_are_named_when_the_command_runs(
  examples, capsys, tmp_path, example, argv, message
):
  module = examples(example)
  args = module.parse_args(argv.format(tmp=tmp_path).split())  # the command is real
  with pytest.raises(SystemExit) as exit_:
    module.check_inputs(args)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert "error: " in err and message in err, err


def test_every_example_is_in_the_table():
  scripts = {p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_")}
  assert scripts == {c[0] for c in CASES}


@pytest.mark.parametrize("example", sorted({c[0] for c in CASES}))
def test_the_defaults_parse(examples, example):
  args = examples(example).parse_args([])
  out = getattr(args, "out", None) or getattr(args, "ckpt", None)
  # Paths are absolute: they mean the same from any working directory.
  assert out is None or Path(out).is_absolute()


@pytest.mark.parametrize("example", sorted({c[0] for c in CASES}))
def test_every_example_option_says_what_it_does_and_its_default(
  examples, capsys, monkeypatch, example
):
  monkeypatch.setenv("COLUMNS", "80")  # argparse's width, as in a pipe
  with pytest.raises(SystemExit) as exit_:
    examples(example).parse_args(["--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  options = out.split("options:", 1)[1]
  # One entry per option: its flags, then what it does, the default last.
  entries = re.split(r"\n  (?=-)", "\n" + options)[1:]
  names = [re.match(r"(-[\w-]+)", e).group(1) for e in entries]
  assert len(names) > 1 and names[0] == "-h", out
  for entry in entries[1:]:
    text = " ".join(entry.split())
    assert re.search(r"\S+ .*\w.*\(default: .*\)$", text), (example, text)
