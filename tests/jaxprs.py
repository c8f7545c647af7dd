"""Walking a jaxpr: its equations, and those of the jaxprs they hold."""


def sub_jaxprs(params):
  """The jaxprs in an equation's parameters (a closed jaxpr opened)."""
  for p in params.values():
    for item in p if isinstance(p, (tuple, list)) else (p,):
      while not hasattr(item, "eqns") and hasattr(item, "jaxpr"):
        item = item.jaxpr
      if hasattr(item, "eqns"):
        yield item


def eqns(jaxpr):
  """Every equation of ``jaxpr``, recursing into calls, loops and rules."""
  for e in jaxpr.eqns:
    yield e
    for sub in sub_jaxprs(e.params):
      yield from eqns(sub)
