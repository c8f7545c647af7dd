"""Low-bit matmuls: float8 recipes, MXFP8/NVFP4 quantisation and GEMMs."""
