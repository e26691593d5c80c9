"""Weight-only quantization: low-bit linears (linear.py), their integer codes from
GGUF blocks or float weights (codes.py), and swapping them into a loaded model
(model.py). The model code does not know about any of it."""

from tokenmill.quant.linear import Int4Linear, Int8Linear, QuantizedLinear
from tokenmill.quant.model import (
    DENSE_MIN_ROWS,
    METHODS,
    QuantizationSummary,
    quantize_model,
    resolve_method,
)

__all__ = ["DENSE_MIN_ROWS", "METHODS", "Int4Linear", "Int8Linear", "QuantizationSummary",
           "QuantizedLinear", "quantize_model", "resolve_method"]
