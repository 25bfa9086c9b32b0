"""The one error type of run configuration, and the range rule most checks use."""

from __future__ import annotations

__all__ = ["ConfigError", "is_default", "positive"]


class ConfigError(ValueError):
    """An invalid run configuration; ``str()`` is the one-line message shown to the user."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


def positive(value, key: str, strict: bool = True) -> None:
    """``key`` must be > 0 (``strict``) or >= 0; None (unset) passes."""
    if value is None:
        return
    if (value <= 0) if strict else (value < 0):
        raise ConfigError(key, f"must be {'> 0' if strict else '>= 0'}, got {value}")


def is_default(section, name: str) -> bool:
    """Whether the dataclass ``section`` has its field ``name`` at the schema's default (a setting left unset)."""
    import dataclasses

    field = next(f for f in dataclasses.fields(section) if f.name == name)
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    return getattr(section, name) == default
