"""Deprecated: ``commlib.tuning.autotune`` (this alias stays for one release)."""
import warnings

from commlib.tuning.autotune import *  # noqa: F401,F403
from commlib.tuning.autotune import autotune, cached_config, get_config, main, search  # noqa: F401

warnings.warn("commlib.tune is deprecated; import commlib.tuning.autotune", DeprecationWarning, stacklevel=2)
