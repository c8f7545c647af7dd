"""A compiled program's HLO text, parsed: what each of its kernels does.

:class:`Program` reads ``compiled.as_text()`` (the optimised HLO, after
fusion) into its computations and instructions, and sorts each instruction
that runs as a kernel of its own (the entry computation's, and those of the
loops, branches and calls it runs; not a fusion's body) into one of
:data:`CATEGORIES`, by what it computes:

* ``GEMM``: a ``dot`` or ``convolution``, a custom call to cuBLAS, cuBLASLt
  or cuDNN (``__cublas$lt$matmul$f8`` is the float8 GEMM), or a fusion that
  holds one (a Triton GEMM, XLA:CPU's matmul fusions).
* ``amax``: a kernel that only reduces (its outputs are smaller than its
  largest input) with a ``max`` reduction of an ``abs``: the largest
  magnitude a float8 scale is made from; also the second stage of a
  reduction split in two (a ``max`` reduction of an amax kernel's output).
  A producer that computes the amax of what it writes (a multi-output
  fusion) is not a pass of its own and goes by what it writes.
* ``cast``: a kernel with a ``convert`` to or from a float8 type: the
  quantisation (scaling, rounding to float8) or a widening of float8 values.
* ``transpose/copy``: a ``copy`` or ``transpose``, or a fusion whose output
  is one: an array written again in another layout.
* ``other``: everything else (elementwise work, softmax, layer norms, the
  optimizer, the rescaling of a product that XLA did not fold into it, ...).

A kernel that does several of these counts once, by the first in that
order. The classes are what a float8 recipe adds to a matmul: its passes
over memory (:meth:`Program.passes`) and, matched to a profiler trace's
kernels (:meth:`Program.kernel`), their time.
"""

from __future__ import annotations

import dataclasses
import re

CATEGORIES = ("GEMM", "amax", "cast", "transpose/copy", "other")

#: Custom-call targets that are matrix multiplications.
GEMM_TARGETS = re.compile(r"cublas|cudnn|gemm|matmul|block_scaled_dot", re.I)
#: Instructions that move no data (no kernel, or a view).
FREE = frozenset(
  {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
  }
)
#: Instructions that run other computations as programs (their bodies'
#: instructions are kernels too).
CONTROL = frozenset({"while", "conditional", "call", "async-start", "async-done"})
#: Elementwise instructions with one array operand, through which an amax's
#: ``abs`` is followed to the reduction.
_PASS_THROUGH = frozenset(
  {"convert", "bitcast", "reshape", "copy", "transpose", "bitcast-convert"}
)

_REDUCE = frozenset({"reduce", "reduce-window"})

_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_LINE = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(
  r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)="
  r"%?([\w.\-]+)"
)
_CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_FLOAT8 = re.compile(r"^\(?\s*f8e")
#: The element type of a shape (a tuple's first).
_ELEMENT = re.compile(r"^\(?\s*([a-z][a-z0-9]*)\[")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: ``%name = shape opcode(operands), attributes``.

  Attributes:
    name: the instruction's name (without ``%``).
    shape: its result type as printed (``f32[8,16]{1,0}``, a tuple in
      parentheses).
    opcode: ``fusion``, ``dot``, ``custom-call``, ``reduce``, ...
    operands: the names of its operands, in order.
    calls: the computations it calls (a fusion's body, a reducer, a loop's
      body and condition, a conditional's branches).
    target: a custom call's target (``""`` for any other instruction).
    root: whether it is its computation's result.
    text: the whole line.
  """

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  calls: tuple[str, ...]
  target: str
  root: bool
  text: str


def _split_operands(rest):
  """``(operands text, attributes text)`` of what follows ``opcode(``."""
  depth = 1
  for i, ch in enumerate(rest):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        return rest[:i], rest[i + 1 :]
  return rest, ""


def _parse_line(line):
  m = _LINE.match(line)
  if m is None:
    return None
  root, name, shape, opcode, rest = m.groups()
  operand_text, attrs = _split_operands(rest)
  calls = _CALLS.findall(attrs)
  for group in _CALL_LISTS.findall(attrs):
    calls += re.findall(r"%?([\w.\-]+)", group)
  target = re.search(r'custom_call_target="([^"]*)"', attrs)
  return Instruction(
    name=name,
    shape=shape,
    opcode=opcode,
    operands=tuple(re.findall(r"%([\w.\-]+)", operand_text)),
    calls=tuple(calls),
    target=target.group(1) if target else "",
    root=bool(root),
    text=line.strip(),
  )


def elements(shape):
  """The number of elements of an array type (a tuple's: the sum of its parts')."""
  total = 0
  for dims in re.findall(r"\[([\d,]*)\]", shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n
  return total


#: Bits per element of HLO's element types.
_BITS = {
  "token": 0,
  "pred": 8,
  "s2": 2,
  "u2": 2,
  "s4": 4,
  "u4": 4,
  "f4e2m1fn": 4,
  "s8": 8,
  "u8": 8,
  "s16": 16,
  "u16": 16,
  "f16": 16,
  "bf16": 16,
  "s32": 32,
  "u32": 32,
  "f32": 32,
  "s64": 64,
  "u64": 64,
  "f64": 64,
  "c64": 64,
  "c128": 128,
}
#: A GEMM's scratch buffer: the byte array beside its result in a tuple.
_SCRATCH = re.compile(r",\s*[su]8\[\d+\](\{[\d,]*\})?")


def nbytes(shape):
  """The bytes of an array type (a tuple's: the sum of its parts'; a
  dynamic dimension at its bound). Float8 and float6 types take one byte an
  element, 4- and 2-bit types are counted packed; an element type not known
  here is a ``ValueError``."""
  total = 0
  for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,<=]*)\]", shape):
    n = 1
    for d in filter(None, dims.replace("<=", "").split(",")):
      n *= int(d)
    if dtype.startswith(("f8e", "f6e")):
      bits = 8
    elif dtype in _BITS:
      bits = _BITS[dtype]
    else:
      raise ValueError(f"unknown element type {dtype!r} in {shape!r}")
    total += n * bits // 8
  return total


def kernel_name(name):
  """The GPU kernel name XLA gives instruction ``name`` (``.`` and ``-`` as ``_``)."""
  return re.sub(r"[^\w]", "_", name)


class Program:
  """The optimised HLO of one compiled program (``compiled.as_text()``).

  Attributes:
    module: the module's name (``jit_step``), what a profiler trace's
      ``hlo_module`` names.
    computations: ``{name: [Instruction, ...]}``, each in program order.
    entry: the entry computation's name.
    instructions: ``{name: Instruction}`` of every computation.
  """

  def __init__(self, hlo_text):
    head = re.search(r"^HloModule ([\w.\-]+)", hlo_text, re.M)
    self.module = head.group(1) if head else ""
    self.computations, self.entry, current = {}, None, None
    for line in hlo_text.splitlines():
      m = _HEAD.match(line)
      if m:
        current = m.group(2)
        self.computations[current] = []
        if m.group(1):
          self.entry = current
        continue
      if current is None:
        continue
      if line.strip() == "}":
        current = None
        continue
      instr = _parse_line(line)
      if instr is not None:
        self.computations[current].append(instr)
    if self.entry is None:
      raise ValueError("no ENTRY computation in the HLO text")
    self.instructions = {i.name: i for body in self.computations.values() for i in body}
    self._top = self.instructions  # names are unique in a module
    self._categories = None

  # -- structure ----------------------------------------------------------

  def root(self, computation):
    """The result instruction of ``computation``."""
    body = self.computations[computation]
    return next((i for i in body if i.root), body[-1])

  def body(self, instr):
    """Every instruction that ``instr``'s called computations hold, nested
    calls followed (a fusion's body and its reducers)."""
    seen, todo, out = set(), list(instr.calls), []
    while todo:
      c = todo.pop()
      if c in seen or c not in self.computations:
        continue
      seen.add(c)
      for i in self.computations[c]:
        out.append(i)
        todo += i.calls
    return out

  def kernels(self):
    """The instructions that run as kernels of their own, in program order:
    the entry computation's and those of the loops, branches and calls it
    runs, without the ones that move no data (parameters, tuples, bitcasts)
    or only run others (loops, branches)."""
    return self._kernels_from([self.entry])

  def in_loops(self):
    """The names of the kernels (:meth:`kernels`) that run in a loop's body
    (or its condition), once per iteration: with :meth:`categories`, what
    a ``lax.scan`` repeats and what XLA hoisted out of it."""
    loops = [
      c
      for body in self.computations.values()
      for i in body
      if i.opcode == "while"
      for c in i.calls
    ]
    return {i.name for i in self._kernels_from(loops)}

  def _kernels_from(self, computations):
    """The kernels of ``computations`` and of those they run, in order."""
    out, seen, todo = [], set(), list(computations)
    while todo:
      c = todo.pop(0)
      if c in seen or c not in self.computations:
        continue
      seen.add(c)
      for i in self.computations[c]:
        if i.opcode in CONTROL:
          todo += i.calls
        elif i.opcode not in FREE:
          out.append(i)
    return out

  # -- what an instruction does -------------------------------------------

  def _is_float8(self, shape):
    return bool(_FLOAT8.match(shape)) or ", f8e" in shape

  def _is_gemm(self, instr):
    return any(
      i.opcode in ("dot", "convolution")
      or (i.opcode == "custom-call" and GEMM_TARGETS.search(i.target))
      for i in (instr, *self.body(instr))
    )

  def _max_reducer(self, reduce):
    return any(
      self.root(c).opcode == "maximum" for c in reduce.calls if c in self.computations
    )

  def _scope(self, computation):
    return {i.name: i for i in self.computations.get(computation, ())}

  def _from_magnitudes(self, name, scope, caller, amax):
    """Whether value ``name`` of a computation (``scope``: its instructions)
    is an ``abs`` or an amax kernel's result, through copies and converts.

    A parameter of a kernel's body (``caller``: the kernel) is followed to
    the kernel's operand; a kernel's result into its body's root.
    """
    seen = set()
    while name not in seen:
      seen.add(name)
      instr = scope.get(name)
      if instr is None:
        return False
      if caller is None and name in amax:
        return True
      if instr.opcode == "abs":
        return True
      if instr.opcode == "parameter" and caller is not None:
        index = int(re.search(r"parameter\((\d+)\)", instr.text).group(1))
        if index >= len(caller.operands):
          return False
        name, scope, caller = caller.operands[index], self._top, None
        continue
      if caller is None and instr.opcode == "fusion" and instr.calls:
        body = self._scope(instr.calls[0])
        root = self.root(instr.calls[0])
        if root.opcode == "tuple":  # a multi-output kernel: any of its results
          return any(self._from_magnitudes(o, body, None, set()) for o in root.operands)
        name, scope = root.name, body  # its parameters are not followed
        continue
      if instr.opcode not in _PASS_THROUGH and instr.opcode != "get-tuple-element":
        return False
      if not instr.operands:
        return False
      name = instr.operands[0]
    return False

  def _amax_kind(self, instr, amax):
    """``"abs"`` where kernel ``instr`` only reduces, by a max of magnitudes
    (an ``abs``); ``"stage"`` where it reduces an amax kernel's partial
    maxima (``amax`` names the amax kernels before it); else ``None``."""
    largest_in = max(
      (elements(self._top[o].shape) for o in instr.operands if o in self._top),
      default=0,
    )
    if elements(instr.shape) * 2 > largest_in:
      return None  # writes as much as it reads: a producer, not a reduction
    if instr.opcode in _REDUCE:
      reduces, scope, caller = [instr], self._top, None
    elif instr.opcode == "fusion" and instr.calls:
      scope, caller = self._scope(instr.calls[0]), instr
      reduces = [i for i in self.body(instr) if i.opcode in _REDUCE]
    else:
      return None
    for r in reduces:
      if not (self._max_reducer(r) and r.operands):
        continue
      if self._from_magnitudes(r.operands[0], scope, caller, set()):
        return "abs"
      if self._from_magnitudes(r.operands[0], scope, caller, amax):
        return "stage"
    return None

  def _is_cast(self, instr):
    for i in (instr, *self.body(instr)):
      if i.opcode != "convert":
        continue
      if self._is_float8(i.shape):
        return True
      src = self.instructions.get(i.operands[0]) if i.operands else None
      if src is not None and self._is_float8(src.shape):
        return True
    return False

  def _is_transpose(self, instr):
    if instr.opcode in ("copy", "transpose", "copy-start", "copy-done"):
      return True
    if instr.opcode != "fusion":
      return False
    root = self.root(instr.calls[0]) if instr.calls else None
    if root is None:
      return False
    roots = (
      [self.instructions[o] for o in root.operands if o in self.instructions]
      if root.opcode == "tuple"
      else [root]
    )
    return any(r.opcode in ("copy", "transpose") for r in roots)

  def categories(self):
    """``{name: category}`` of every kernel (:meth:`kernels`)."""
    if self._categories is None:
      out, amax = {}, set()
      self._stages = set()
      for instr in self.kernels():
        if self._is_gemm(instr):
          cat = "GEMM"
        elif kind := self._amax_kind(instr, amax):
          cat = "amax"
          amax.add(instr.name)
          if kind == "stage":
            self._stages.add(instr.name)
        elif self._is_cast(instr):
          cat = "cast"
        elif self._is_transpose(instr):
          cat = "transpose/copy"
        else:
          cat = "other"
        out[instr.name] = cat
      self._categories = out
    return self._categories

  def passes(self):
    """``{category: kernels}``: the passes over memory, by category.

    A kernel passes over memory where it reads or writes an array (more
    than one element); a kernel of scalars (a scale computed from an amax)
    and the second stage of a split amax (it reduces the first stage's
    partial maxima) are not counted. Every category is a key, zeros
    included.
    """
    counts = dict.fromkeys(CATEGORIES, 0)
    self.categories()
    for name, cat in self._categories.items():
      instr = self.instructions[name]
      sizes = [elements(instr.shape)]
      sizes += [elements(self._top[o].shape) for o in instr.operands if o in self._top]
      if name not in self._stages and max(sizes) > 1:
        counts[cat] += 1
    return counts

  def traffic(self):
    """``{category: bytes}``: what the kernels of each category read and
    write, every category a key.

    A kernel's bytes are its results' and its operands' sizes
    (:func:`nbytes`), each operand counted once: what it moves where it
    reads each operand whole and once (a kernel that reads part of one, a
    slice in a fusion, counts all of it). A kernel in a loop's body counts
    once, not once an iteration. A GEMM's scratch buffer (an ``s8``/``u8``
    array beside its result in a tuple) is not counted.
    A proxy for the time a kernel that is bound by memory bandwidth takes.
    """
    out = dict.fromkeys(CATEGORIES, 0)
    for name, cat in self.categories().items():
      instr = self.instructions[name]
      shape = instr.shape
      if cat == "GEMM" and shape.startswith("("):  # a custom call's, a fusion's
        shape = _SCRATCH.sub("", shape)
      operands = {o for o in instr.operands if o in self._top}
      out[cat] += nbytes(shape) + sum(nbytes(self._top[o].shape) for o in operands)
    return out

  def float8_gemms(self):
    """The GEMM kernels with a float8 operand: cuBLASLt's float8 GEMM, or
    (where the backend widens float8 first, as XLA:CPU does) a GEMM whose
    operand is a cast kernel's output or of a float8 type."""
    cats = self.categories()
    out = []
    for name, cat in cats.items():
      if cat != "GEMM":
        continue
      instr = self.instructions[name]
      if "$f8" in instr.target or any(
        cats.get(o) == "cast" or self._is_float8(self.instructions[o].shape)
        for o in instr.operands
        if o in self.instructions
      ):
        out.append(name)
    return out

  def float8_passes(self):
    """``{category: kernels}``: the passes over memory of the float8 matmuls.

    Every amax and cast pass (:meth:`passes`), and the transposes and
    copies made for a float8 GEMM: those that read a float8 GEMM's or a
    cast's output (or such a copy's), or whose result an amax, a cast or
    a float8 GEMM reads. A copy of the program's own input (a donated
    parameter kept for a later reader while its buffer takes the update) is
    the donation's, not the recipe's, and is not counted. ``GEMM`` is the
    number of float8 GEMMs.
    """
    counted = self.passes()  # for the amax and cast totals
    return {
      "GEMM": len(self.float8_gemms()),
      "amax": counted["amax"],
      "cast": counted["cast"],
      "transpose/copy": len(self._float8_moves()),
    }

  def float8_moves(self):
    """``{element type: kernels}``: the transposes and copies that
    :meth:`float8_passes` counts, by the element type they write. A float8
    type is a float8 operand moved after its cast (a transpose a GEMM's
    layout asks for: the cast did not write it so); a wider one moves an
    operand before its cast, or a product."""
    out = {}
    for name in sorted(self._float8_moves()):
      m = _ELEMENT.match(self.instructions[name].shape)
      key = m.group(1) if m else "?"
      out[key] = out.get(key, 0) + 1
    return out

  def _float8_moves(self):
    """The names of the transposes and copies :meth:`float8_passes` counts."""
    self.categories()
    gemms = set(self.float8_gemms())
    users = {}
    for name in self._categories:
      for o in self.instructions[name].operands:
        users.setdefault(self._producer(o), set()).add(name)
    recipe = set(gemms) | {n for n, c in self._categories.items() if c == "cast"}
    moved = set()
    for name, cat in self._categories.items():
      if cat != "transpose/copy":
        continue
      instr = self.instructions[name]
      reads = {self._producer(o) for o in instr.operands}
      if all(
        r in self.instructions and self.instructions[r].opcode == "parameter"
        for r in reads
      ):
        continue  # the donation's copy of an input
      read_by = users.get(name, set())
      if reads & recipe or any(
        self._categories.get(u) in ("amax", "cast") or u in gemms for u in read_by
      ):
        recipe.add(name)
        moved.add(name)
    return moved

  def _producer(self, name):
    """The kernel whose result ``name`` is (through tuple elements, bitcasts)."""
    while name in self.instructions and self.instructions[name].opcode in (
      "get-tuple-element",
      "bitcast",
    ):
      name = self.instructions[name].operands[0]
    return name

  # -- a profiler's kernels -----------------------------------------------

  def kernel(self, hlo_op="", name=""):
    """The kernel instruction a profiler event belongs to, or ``None``.

    ``hlo_op`` is the event's ``hlo_op`` argument (the instruction that
    launched it), ``name`` the kernel's name (XLA names a fusion's kernel
    after the fusion, :func:`kernel_name`).
    """
    cats = self.categories()
    if hlo_op in cats:
      return hlo_op
    if not hasattr(self, "_by_kernel_name"):
      self._by_kernel_name = {kernel_name(n): n for n in cats}
    return self._by_kernel_name.get(kernel_name(name)) if name else None
