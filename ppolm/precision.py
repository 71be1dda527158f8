"""Device and precision: now in :mod:`ppolm.runtime` (this module re-exports them)."""

from ppolm.runtime import _SAID, MasterWeights, dtype_of, native_bf16, resolve_device, resolve_precision

__all__ = ["_SAID", "MasterWeights", "dtype_of", "native_bf16", "resolve_device", "resolve_precision"]
