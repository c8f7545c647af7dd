"""Autocast: dtype policies, the op lists and rules, and the casting jaxpr walk."""
