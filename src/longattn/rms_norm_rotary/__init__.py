from .api import rms_norm_rotary

__all__ = ["rms_norm_rotary"]
