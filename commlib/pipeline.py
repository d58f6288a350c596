"""Deprecated: ``commlib.training.pipeline`` (this alias stays for one release)."""
import warnings

from commlib.training.pipeline import *  # noqa: F401,F403

warnings.warn("commlib.pipeline is deprecated; import commlib.training.pipeline", DeprecationWarning, stacklevel=2)
