"""autocast's four lists: which primitives run in half, in float32, or follow.

Allow: in the half dtype. Deny: in float32. Infer: in half when every
floating input is half. Clear: their input's dtype passes through.
Names as in TensorFlow's mixed-precision graph rewrite. A primitive in no
list runs in float32.
"""

__all__ = ["ALLOW_LIST", "CLEAR_LIST", "DENY_LIST", "INFER_LIST"]

#: Run in the half dtype.
ALLOW_LIST = frozenset(
  {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)
#: Run in float32.
DENY_LIST = frozenset(
  {
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "logistic",
    "erf",
    "erfc",
    "erf_inv",
    "lgamma",
    "digamma",
    "igamma",
    "pow",
    "integer_pow",
    "square",
    "sqrt",
    "rsqrt",
    "cbrt",
    "div",
    "reduce_sum",
    "reduce_prod",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
    "reduce_precision",
    "tan",
    "atan2",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atan",
    "asinh",
    "acosh",
    "atanh",
    "sin",
    "cos",
  }
)
#: Run in the half dtype if every floating input is half, else float32.
INFER_LIST = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "mul",
    "neg",
    "max",
    "min",
    "abs",
    "sign",
    "tanh",
    "floor",
    "ceil",
    "round",
    "clamp",
    "nextafter",
    "rem",
    "is_finite",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "stop_gradient",
  }
)
#: Primitives that only move values (a transpose, a reshape, a slice of a
#: stacked layer): what :data:`CLEAR_LIST` passes through and what autocast's
#: analyses see through to a function's inputs.
LAYOUT_PRIMITIVES = frozenset(
  {
    "reshape",
    "transpose",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "concatenate",
    "select_n",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "rev",
    "pad",
    "copy",
    "copy_p",
  }
)
#: Pass the dtype through.
CLEAR_LIST = LAYOUT_PRIMITIVES | frozenset(
  {
    "reduce_max",
    "reduce_min",
    "argmax",
    "argmin",
    "sort",
    "convert_element_type",
    "iota",
  }
)
