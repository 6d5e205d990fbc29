"""Quantized base weights (FP8 E4M3) under unchanged LoRA adapters: the scheme a checkpoint and
`--quantization` select (scheme.py) and the FP8 linears built in place of the float ones
(fp8_linear.py); the matmuls live in kernels/fp8_matmul.py."""
