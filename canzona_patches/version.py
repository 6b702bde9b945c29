"""Guard: Canzona's patches are written against one exact Megatron-Core release.

Every module in ``canzona_patches`` hooks private functions of megatron-core by name,
so a different release can break them silently. Each patch module calls
:func:`require_pinned_megatron` at import time to fail early and clearly instead; being the
first thing before any Megatron import, it also imports Megatron-Core there, once per
process, with its fused kernels compiled on first call rather than at import
(:mod:`canzona_patches.integration.imports`).
"""

import logging
import warnings
from importlib import metadata

PINNED_MEGATRON_CORE = "0.19.2"
"""The megatron-core release every patch in this package was written and tested against."""


class MegatronVersionError(ImportError):
    """Raised at import when the installed megatron-core is not the pinned release."""


def installed_megatron_version() -> str | None:
    """Version string of the installed ``megatron-core`` distribution, or None if absent."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def require_pinned_megatron() -> None:
    """Raise :class:`MegatronVersionError` unless megatron-core == PINNED_MEGATRON_CORE; then
    import it (:func:`~canzona_patches.integration.imports.import_megatron_core`)."""
    found = installed_megatron_version()
    if found == PINNED_MEGATRON_CORE:
        from canzona_patches.integration.imports import import_megatron_core

        import_megatron_core()
        return
    found_text = "is not installed" if found is None else f"is version {found}"
    raise MegatronVersionError(
        f"canzona_patches needs megatron-core=={PINNED_MEGATRON_CORE}, but megatron-core "
        f"{found_text}. Install the pinned release: "
        f"pip install 'megatron-core=={PINNED_MEGATRON_CORE}'."
    )


def quiet_megatron_notices() -> None:
    """Silence Megatron-Core's notices that say nothing to a tool's user: missing
    Transformer Engine/Apex on a CPU machine, an unknown rank outside a job, torch's "no
    CUDA runtime". For command-line tools that print their own results; never for training."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.(core|training)")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.(core|training)")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
