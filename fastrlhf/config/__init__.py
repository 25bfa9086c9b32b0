"""Run configuration: YAML -> frozen dataclasses, validated before any work starts.

- :mod:`.schema`: the frozen dataclasses of every command's config (each setting and its default, once);
- :mod:`.loading`: the YAML reader (1.2 floats), ``--set`` overrides, typed building, renamed keys;
- :mod:`.checks`: cross-field validation, and :func:`check_world_size` for the rules that need the ranks;
- :mod:`.errors`: :class:`ConfigError`.

Importing this package must stay cheap (no torch): a bad config has to fail in well under a second.
Every problem raises :class:`ConfigError` whose message is one line naming the offending key.
"""

from __future__ import annotations

from . import schema
from .checks import _check_reward_spec, check_world_size, validate  # noqa: F401 (private, imported by name)
from .errors import ConfigError
from .loading import RENAMED_KEYS, apply_overrides, config_to_dict, load_config, parse_config
from .schema import *  # noqa: F403 -- every dataclass of the schema is part of this package's API

__all__ = ["ConfigError", *schema.__all__, "RENAMED_KEYS", "load_config", "parse_config", "apply_overrides",
           "config_to_dict", "validate", "check_world_size"]
