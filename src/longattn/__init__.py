"""longattn: attention operators for long-context LLM inference (PyTorch + Triton).

Semantics follow ONNX Runtime's ``com.microsoft`` contrib operators; every op has a
``triton -> chunked -> reference`` backend cascade (see ``longattn._cascade``).
"""

from ._rotary import rope_cache
from .rms_norm_rotary import rms_norm_rotary

__version__ = "0.1.0"

__all__ = ["__version__", "rms_norm_rotary", "rope_cache"]
