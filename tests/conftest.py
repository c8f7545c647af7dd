"""Strict numerics for every test: silent dtype upcasts are bugs here."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

# tests/multidevice needs 8 (simulated) devices, which must be requested
# before JAX starts: it runs in its own process (see the test command in README.md).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore = ["multidevice"]

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "standard_promotion: the test runs third-party code (optax's adam, "
    "Keras, Flax) that is not written for strict dtype promotion; our own "
    "code is still checked under strict promotion by every other test.",
  )


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  marked = request.node.get_closest_marker("standard_promotion")
  with jax.numpy_dtype_promotion("standard" if marked else "strict"):
    yield
