"""Low-precision parameters: rounding, master weights, 8-bit optimizer state."""
