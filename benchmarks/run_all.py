"""Run every benchmark at one commit and write their tables under one header.

Runs each question's script in its own process, one after the other, from
this checkout, and writes ``OUT/<question>.md`` (each script's report),
``OUT/<question>.log`` (what it printed) and ``OUT/tables.md``: a header
with the commit, the date, the command, the machine and the versions, then
each question's tables under its title with the command that made them. A
script's own "Machine:" line is checked against the header (the same commit
in every one) and left out of ``tables.md``.

The questions, in order: the update step against its peers
(``update_step.py``), the train step (``train_step.py``), leaves and compile
time (``leaves.py``), compile time on a transformer's tree of 29 to 293
leaves (``leaves.py``'s tree), the designs tried (``designs.py``), the record's cost
(``telemetry.py``), error paths (``error_paths.py``), block-scaled memory
(``block_memory.py``), low-precision parameters (``bf16_params.py``), the
8-bit optimizer state (``quantize_state.py``), and on a GPU the GPU report
(``gpu_report.py``) and float8 against bfloat16 (``float8_profile.py``).
``probes.py``, the investigation's measurements, is run by hand
(BENCHMARKS.md's log names its commands).

Each script runs with this checkout first on ``PYTHONPATH`` (the package
it imports is printed, and one from outside the checkout refused), so a
clone measures its own code with another checkout's virtual environment.

``--write PATH`` then fills a Markdown file from the run: every block
between ``<!-- run_all: KEY -->`` and ``<!-- /run_all -->`` is replaced by
that question's tables (``header``: the run's header), the text around the
blocks kept. Each question's block starts with the command that made it and
the commit (``Made by `...` at commit `abc1234`.``); a GPU-only question on a
machine without a GPU says that it was not run. With every table of
``BENCHMARKS.md`` in such a block, one command regenerates it whole at one
commit::

  python benchmarks/run_all.py --write BENCHMARKS.md

``--only KEYS --write PATH`` fills only those questions' blocks (the
header and the other blocks stay). ``--report KEY=PATH`` takes a question's
report from a file made on another machine instead of running its script
(for a question whose report names its own commit and device): the GPU
report or the float8 profile, made where a GPU is lent (``python
benchmarks/gpu_report.py --out DIR/gpu_report.md``) and written here with
``--only gpu_report --report gpu_report=DIR/gpu_report.md --write
BENCHMARKS.md``. Its block names the report's own command, commit and
device, and holds the report's measurements (:func:`digest`: the
transformer section of the GPU report, the tokens/s and time split of the
profile, without the environment, the test run, the collapsed listings and
the paragraphs on method, which stay in the report).

A tree with uncommitted changes to tracked files is refused (its numbers
would belong to no commit) unless ``--allow-dirty`` (which also notes,
rather than refuses, a report made after HEAD moved); ``--quick`` runs each
script's smoke options (numbers that mean nothing: never written with
``--write``).

``--jobs N`` runs N scripts at a time (in the order above, each in its
own process): faster on a machine shared with other work, where each
process gets its share of the cores, at the price of noisier times.

Run:  python benchmarks/run_all.py [--quick] [--only KEYS] [--out DIR] [--jobs N]
      [--write PATH] [--report KEY=PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: key: (title, script and its arguments, the same for --quick). Each script
#: writes its report to ``--out``. So that the whole run takes about
#: an hour on a busy 2-core CPU, the slowest sections are left to their
#: scripts (leaves.py's finite check alone, the transformer trained with
#: 8-bit Adam) and the trainings
#: run fewer seeds and steps than their scripts' defaults; update_step.py's
#: float16 table is left out too (for BENCHMARKS.md's length).
QUESTIONS = {
  "update_step": (
    "Update step",
    ["update_step.py", "--sections", "headline"],
    ["update_step.py", "--quick"],
  ),
  "train_step": (
    "Full train step",
    ["train_step.py"],
    ["train_step.py", "--quick"],
  ),
  "leaves": (
    "Leaves and compile time",
    ["leaves.py", "--sections", "leaves,distinct"],
    ["leaves.py", "--quick"],
  ),
  "tree": (
    "A transformer's tree: compile time",
    ["leaves.py", "--sections", "tree"],
    ["leaves.py", "--quick", "--sections", "tree"],
  ),
  "designs": ("Designs tried", ["designs.py"], ["designs.py", "--quick"]),
  "telemetry": (
    "The record's cost",
    ["telemetry.py"],
    ["telemetry.py", "--quick"],
  ),
  "error_paths": (
    "Error paths",
    ["error_paths.py"],
    ["error_paths.py", "--leaves", "5", "12", "--repeats", "1"],
  ),
  "block_memory": (
    "Block-scaled memory",
    ["block_memory.py"],
    ["block_memory.py", "--batch", "2", "--context", "16"],
  ),
  "bf16_params": (
    "Low-precision parameters",
    ["bf16_params.py", "--seeds", "1", "--lm-steps", "150"],
    ["bf16_params.py", "--quick"],
  ),
  "quantize_state": (
    "8-bit optimizer state",
    ["quantize_state.py"],
    ["quantize_state.py", "--quick"],
  ),
  "gpu_report": ("GPU report", ["gpu_report.py"], ["gpu_report.py", "--small"]),
  "float8_profile": (
    "float8 against bfloat16 on a GPU",
    ["float8_profile.py"],
    ["float8_profile.py", "--small"],
  ),
}
#: Run only where the machine's first device is a GPU (unless named in --only).
GPU_ONLY = {"gpu_report", "float8_profile"}
MACHINE_LINE = re.compile(r"^Machine: (.*)\.$", re.M)
BLOCK = re.compile(r"(<!-- run_all: (\w+) -->\n)(.*?)(<!-- /run_all -->)", re.S)


def env():
  """The environment of the scripts: this checkout's package first on the path
  (so that an install of another checkout is not what is measured)."""
  path = [ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
  return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def run(cmd, log_path, timeout=None):
  """Runs ``cmd`` in ROOT; its output to ``log_path``; the exit status."""
  with open(log_path, "w") as log:
    try:
      return subprocess.run(
        cmd,
        cwd=ROOT,
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        timeout=timeout,
      ).returncode
    except subprocess.TimeoutExpired:
      log.write(f"\ntimed out after {timeout} s\n")
      return "timed out"


def git(*args):
  return subprocess.run(
    ["git", *args], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()


def machine():
  """The harness's machine description, from a process of its own; exits
  where that process imports the package from outside this checkout."""
  out = subprocess.run(
    [sys.executable, os.path.join(HERE, "_harness.py")],
    cwd=ROOT,
    env=env(),
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  package = subprocess.run(
    [sys.executable, "-c", "import optax_lossscale as m; print(m.__file__)"],
    cwd=ROOT,
    env=env(),
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  print(f"package: {package}", flush=True)
  if not os.path.realpath(package).startswith(os.path.realpath(ROOT) + os.sep):
    raise SystemExit(f"the scripts would import {package}, not this checkout's")
  return json.loads(out.strip().splitlines()[-1])


def question(key, quick, out_dir, timeout):
  """Runs one question's script; ``(command, report text, failure or None)``."""
  _, full, small = QUESTIONS[key]
  args = small if quick else full
  cmd = [sys.executable, os.path.join("benchmarks", args[0]), *args[1:]]
  md_path = os.path.join(out_dir, f"{key}.md")
  shown = " ".join(["python", *(shlex.quote(c) for c in cmd[1:])])
  cmd += ["--out", md_path]
  print(f"{key}: {shown} --out {md_path}", flush=True)
  t0 = time.perf_counter()
  rc = run(cmd, os.path.join(out_dir, f"{key}.log"), timeout)
  print(f"  exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
  if rc != 0:
    return shown, "", f"exit status {rc} (see {key}.log)"
  with open(md_path) as f:
    return shown, f.read(), None


#: The report's sections that a block holds, by question (default: all).
DIGEST_SECTIONS = {"gpu_report": ("4.",), "float8_profile": ("2.", "3.")}


#: Lines of a digested report that say how it was made rather than what it
#: measured (the report keeps them): a section's call, a list of the rows'
#: code (not a profile's list of sizes), the per-recipe count of the forward
#: pass's matmuls, the paragraphs that say how the CPU blocks' tables of the
#: same scripts and the float8 profile's columns were measured (the report
#: says it whole).
DIGEST_DROP = re.compile(
  r"^(`[\w.]+\(.*\)`.*|- (?!d_model ).*|\S+ matmuls of the forward pass .*|"
  r"(Section|Total) wall time: .*|Left out \(package not installed\): .*|"
  r"(Update step \(update \+ apply|The steps of a table are called|"
  r"The GPU report's decoder|Both precisions are trained|Each precision is timed|"
  r"A `jax\.profiler` trace of) .*)\n",
  re.M,
)


def digest(key, text):
  """The part of a question's report that its block holds.

  For a question in :data:`DIGEST_SECTIONS`: those ``## `` sections, one
  heading level down, without ``<details>`` listings and the lines
  :data:`DIGEST_DROP` matches; otherwise ``text`` itself.
  """
  if key not in DIGEST_SECTIONS:
    return text
  text = re.sub(r"<details>.*?</details>\n*", "", text, flags=re.S)
  text = DIGEST_DROP.sub("", text)
  parts = re.split(r"^## ", text, flags=re.M)[1:]
  kept = ["### " + p.strip("\n") for p in parts if p.startswith(DIGEST_SECTIONS[key])]
  return re.sub(r"\n{3,}", "\n\n", "\n\n".join(kept))


def commit_of_tree(tree_id):
  """The short hash of the newest commit of ``HEAD``'s history whose files
  are the git tree ``tree_id``, or ``None``."""
  log = subprocess.run(
    ["git", "log", "--format=%h %T", "HEAD"], capture_output=True, text=True, cwd=ROOT
  ).stdout
  return next(
    (h for h, t in (line.split() for line in log.splitlines()) if t == tree_id), None
  )


def from_report(key, path, allow_dirty):
  """``(command, block text, failure or None)`` of a report made elsewhere.

  The command is the report's own (its first ``Made by`` line), the commit
  and device its environment table's. A report of uncommitted changes is
  named by the commit here whose files its ``tree`` row names (a copy of a
  working tree can carry an older history), else is a failure unless
  ``allow_dirty``.
  """
  with open(path) as f:
    text = f.read()
  made = re.search(r"^Made by `(.*)`\.$", text, re.M)
  commit = re.search(r"^\| commit \| (.*) \|$", text, re.M)
  device = re.search(r"^\| device kind \| (.*) \|$", text, re.M)
  if not (made and commit and device):
    return "", "", f"{path} lacks its command, commit or device kind"
  shown, named = made.group(1), commit.group(1)
  if "uncommitted" in named:
    tree = re.search(r"^\| tree \| ([0-9a-f]{40}) \|$", text, re.M)
    named = commit_of_tree(tree.group(1)) if tree else None
    if named is None and not allow_dirty:
      return shown, "", f"{path} was made with uncommitted changes"
    named = named or commit.group(1)
  body = digest(key, text)
  if not body.strip():
    return shown, "", f"{path} has none of sections {DIGEST_SECTIONS[key]}"
  head = f"Made by `{shown}` at commit `{named}` on {device.group(1)}."
  return shown, f"{head}\n\n{body}", None


def strip_machine(text, commit):
  """``text`` less its "Machine:" lines; raises if one names a commit other
  than ``commit`` (None: no check)."""
  for m in MACHINE_LINE.finditer(text):
    named = re.search(r"commit (\S+?)(?:;|$)", m.group(1))
    if commit and named and named.group(1) != commit:
      raise RuntimeError(f"a report names commit {named.group(1)}, not {commit}")
  return MACHINE_LINE.sub("", text).strip("\n")


def fill(path, sections, partial=False):
  """Replaces each ``run_all`` block of the file at ``path``; raises on an
  unknown key or a file without blocks. ``partial``: only the blocks of
  ``sections``' keys, the others left as they are (a key of ``sections``
  with no block still raises)."""
  with open(path) as f:
    text = f.read()
  keys = [m.group(2) for m in BLOCK.finditer(text)]
  unknown = sorted(set(keys) - set(sections))
  if partial:
    unknown = sorted(set(sections) - set(keys))
  if not keys or unknown:
    raise SystemExit(f"{path}: no run_all blocks, or keys not run: {unknown}")
  text = BLOCK.sub(
    lambda m: (
      m.group(1)
      + (sections[m.group(2)] + "\n" if m.group(2) in sections else m.group(3))
      + m.group(4)
    ),
    text,
  )
  with open(path, "w") as f:
    f.write(text)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="each script's smoke run")
  p.add_argument("--only", default="", help="comma-separated keys (default: all)")
  p.add_argument("--out", default=os.path.join(HERE, "out", "run_all"), help="folder")
  p.add_argument("--write", default=None, help="fill this file's run_all blocks")
  p.add_argument(
    "--allow-dirty", action="store_true", help="run on uncommitted changes"
  )
  p.add_argument("--timeout", type=float, default=None, help="seconds per script")
  p.add_argument(
    "--jobs", type=int, default=1, help="scripts run at a time (default: one)"
  )
  p.add_argument(
    "--report",
    action="append",
    default=[],
    metavar="KEY=PATH",
    help="take this question's report from PATH (made on another machine)",
  )
  args = p.parse_args(argv)
  keys = [k for k in args.only.split(",") if k] or list(QUESTIONS)
  reports = dict(r.split("=", 1) for r in args.report if "=" in r)
  unknown = sorted((set(keys) | set(reports)) - set(QUESTIONS))
  if unknown or len(reports) != len(args.report):
    p.error(
      f"unknown keys {unknown}, or a --report not KEY=PATH; keys: {list(QUESTIONS)}"
    )
  if set(reports) - set(keys) or set(reports) - set(DIGEST_SECTIONS):
    p.error(
      f"--report: a question that is not run, or not one of {sorted(DIGEST_SECTIONS)}"
    )
  if args.write and args.quick:
    p.error("--quick numbers mean nothing: not written with --write")
  dirty = git("status", "--porcelain", "--untracked-files=no")
  if dirty and not args.allow_dirty:
    p.error(
      "uncommitted changes to tracked files (--allow-dirty to run anyway):\n" + dirty
    )
  os.makedirs(args.out, exist_ok=True)
  info = machine()
  gpu = info["device"].startswith(("gpu", "cuda", "rocm"))
  skipped = [] if args.only or gpu else [k for k in keys if k in GPU_ONLY]
  keys = [k for k in keys if k not in skipped]
  command = "python benchmarks/run_all.py " + " ".join(
    shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
  )
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  header = [
    f"Commit `{git('rev-parse', 'HEAD')}`"
    + (" with uncommitted changes" if dirty else "")
    + f", {date}; made by `{command.strip()}`"
    + (" (--quick: smoke runs, the numbers mean nothing)" if args.quick else "")
    + ".",
    "",
    f"Machine: {info['device']}; {info['cpu']}; Python {info['python']}.",
    "",
    "Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()) + ".",
  ]
  if not gpu:
    header += ["", "No GPU: the GPU report is not run (`--only gpu_report` runs it)."]
  # A partial run (--only) leaves the header of the full run in place.
  sections = {} if args.only else {"header": "\n".join(header)}
  md = ["# Benchmarks", "", *header, ""]
  for key in skipped:
    sections[key] = f"Not run at commit `{info['commit']}`: this machine has no GPU."
    md += [f"## {QUESTIONS[key][0]}", "", sections[key], ""]
  failed = []
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs)
  runs = {
    k: pool.submit(question, k, args.quick, args.out, args.timeout)
    for k in keys
    if k not in reports
  }
  for key in keys:
    if key in reports:  # made elsewhere
      shown, text, failure = "", "", None
    else:
      shown, text, failure = runs[key].result()
    if failure is None and key in DIGEST_SECTIONS:
      # A report that names its own commit and device (the GPU report).
      path = reports.get(key, os.path.join(args.out, f"{key}.md"))
      shown, block, failure = from_report(key, path, args.allow_dirty)
    elif failure is None:
      try:
        text = strip_machine(text, info["commit"])
      except RuntimeError as e:  # HEAD moved during the run
        if not args.allow_dirty:
          failure = str(e)
        text = f"**note**: {e}.\n\n" + strip_machine(text, None)
      block = f"Made by `{shown}` at commit `{info['commit']}`.\n\n{text}"
    if failure:
      failed.append(key)
      block = (
        f"Made by `{shown}` at commit `{info['commit']}`.\n\n**failed**: {failure}."
      )
    sections[key] = block
    md += [f"## {QUESTIONS[key][0]}", "", sections[key], ""]
    with open(os.path.join(args.out, "tables.md"), "w") as f:
      f.write("\n".join(md))
  print(f"wrote {os.path.join(args.out, 'tables.md')}")
  if failed:
    sys.exit(f"failed: {', '.join(failed)}")
  if args.write:
    fill(args.write, sections, partial=bool(args.only))
    print(f"filled {args.write}")


if __name__ == "__main__":
  main()
