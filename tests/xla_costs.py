"""What XLA's deterministic cost figures should show, for the proxy tests."""

import jax

from optax_lossscale._loss_scale.finite import FINITE_CHECK_CHUNK


def check_scratch(grads):
  """Bytes the finite check writes: one byte an entry of one leaf per chunk.

  XLA's CPU backend writes out the input of a reduction it hands to its
  library, so each chunk's verdicts (one uint8 an entry of one of its
  leaves) are written once and read once.
  """
  groups = {}
  for g in jax.tree.leaves(grads):
    groups.setdefault((g.size, g.dtype), []).append(g.size)
  chunk = FINITE_CHECK_CHUNK
  return sum(-(-len(n) // chunk) * n[0] for n in groups.values())


def reductions(hlo_text):
  """``(outside, inside)``: reductions of a compiled program, by where they run.

  ``inside`` counts the ``reduce`` and ``reduce-window`` instructions
  reachable only through a ``conditional``'s branches, ``outside`` the
  others (fusions followed through ``calls=``); a ``to_apply`` reducer is
  not an instruction of its own.
  """
  import re

  bodies, name = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)
    if head and line.rstrip().endswith("{"):
      name = head.group(1)
      bodies[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None and line.strip() and line.strip() != "}":
      bodies[name].append(line)

  def calls(line):
    found = re.findall(
      r"(?:calls|body|condition|true_computation|false_computation)=%([\w.\-]+)", line
    )
    for group in re.findall(
      r"(?:branch_computations|called_computations)=\{([^}]*)\}", line
    ):
      found += re.findall(r"%([\w.\-]+)", group)
    return found

  def count(root, skip_branches):
    seen, todo, n = set(), [root], 0
    while todo:
      c = todo.pop()
      if c in seen:
        continue
      seen.add(c)
      for line in bodies[c]:
        n += bool(re.search(r"\breduce(-window)?\(", line))
        if skip_branches and " conditional(" in line:
          continue
        todo += calls(line)
    return n

  outside = count(entry, skip_branches=True)
  return outside, count(entry, skip_branches=False) - outside
