"""Mixed-precision policies: names, strings, casts, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


@pytest.mark.parametrize(
  "text, expected",
  [
    ("float32", (F32, F32, F32)),
    ("mixed_float16", (F32, F16, F32)),
    ("Mixed_BFloat16", (F32, BF16, F32)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
    ("p=f32,c=bf16,o=bf16", (F32, BF16, BF16)),
    (" c = f16 ", (F32, F16, F32)),  # missing keys are float32
    ("param=full,out=f16", (F32, F32, F16)),
    ("f16", (F16, F16, F16)),
  ],
)
def test_names_and_strings(text, expected):
  policy = ols.Policy.from_string(text)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected
  assert ols.get_policy(text) == policy
  assert ols.get_policy(policy) is policy
  assert ols.Policy.from_string(policy.name) == policy  # the name round-trips
  assert policy.variable_dtype == policy.param_dtype


def test_half_is_the_backends_half():
  assert ols.default_half_dtype("gpu") == F16
  assert ols.default_half_dtype("cuda") == F16
  assert ols.default_half_dtype("tpu") == BF16
  assert ols.default_half_dtype("cpu") == BF16
  assert ols.Policy.from_string("c=half", backend="gpu").compute_dtype == F16
  assert ols.Policy.from_string("c=half", backend="tpu").compute_dtype == BF16
  here = ols.default_half_dtype()
  assert ols.Policy.from_string("half").compute_dtype == here
  assert here == (F16 if jax.default_backend() == "gpu" else BF16)


@pytest.mark.parametrize(
  "text, match",
  [
    ("mixed_float8", "mixed_float8"),
    ("params=float32,compute=flaot16", "flaot16"),
    ("params=float32,kompute=float16", "kompute"),
    ("p=f32,p=f16", "repeats"),
    ("p=f32,,c=f16", "Empty part"),
    ("p=f32,c", "'c' is not key=dtype"),
    ("", "non-empty"),
    ("c=int32", "int32"),
  ],
)
def test_bad_strings_name_the_bad_part(text, match):
  with pytest.raises(ValueError, match=match):
    ols.Policy.from_string(text)


def test_bad_dtypes():
  with pytest.raises(ValueError, match="compute_dtype"):
    ols.Policy(jnp.float32, jnp.int32, jnp.float32)
  with pytest.raises(ValueError, match="param_dtype"):
    ols.Policy("not a dtype")
  with pytest.raises(ValueError, match="non-empty"):
    ols.get_policy(3)


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
def test_float8_is_for_matmuls_only(field):
  with pytest.raises(ValueError, match=f"`{field}`.*matmul='float8'"):
    ols.Policy(**{field: jnp.float8_e4m3fn})


def test_casts_touch_only_floating_arrays():
  policy = ols.Policy.from_string("p=f32,c=f16,o=bf16")
  tree = {
    "w": jnp.ones((2, 2), jnp.float32),
    "h": np.ones(3, np.float64),
    "step": jnp.array(3),
    "mask": jnp.array([True, False]),
    "z": jnp.array([1 + 2j], jnp.complex64),
    "none": None,
    "masked": optax.MaskedNode(),
    "py": 1.5,
  }
  out = policy.cast_to_compute(tree)
  assert out["w"].dtype == F16 and out["h"].dtype == F16
  for key in ("step", "mask", "z", "py"):
    assert out[key] is tree[key]
  assert out["none"] is None and out["masked"] == optax.MaskedNode()
  assert policy.cast_to_output(out)["w"].dtype == BF16
  back = policy.cast_to_param(out)
  assert back["w"].dtype == F32 and back["step"] is tree["step"]
  # Under jit too, and leaves already in the dtype are returned as they are.
  jitted = jax.jit(policy.cast_to_compute)(tree)
  assert jitted["w"].dtype == F16 and jitted["step"].dtype == tree["step"].dtype
  f16 = {"a": jnp.ones(2, F16)}
  assert policy.cast_to_compute(f16)["a"] is f16["a"]
