"""Pytree, dtype, argument and jaxpr helpers for every subsystem; imports none."""
