"""Deprecated: ``commlib.training.moe`` (this alias stays for one release)."""
import warnings

from commlib.training.moe import *  # noqa: F401,F403

warnings.warn("commlib.moe is deprecated; import commlib.training.moe", DeprecationWarning, stacklevel=2)
