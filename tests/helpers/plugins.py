"""A user's own modules for the tests of ``--import`` and ``imports:``: written to a folder, importable,
uniquely named, and whatever they register (policy losses, advantage estimators, rewards) unregistered
afterwards, so that no test sees another's registrations."""

import contextlib
import sys
import uuid


@contextlib.contextmanager
def user_plugins(folder):
    """Yields ``make(source, name=None) -> module name``: the module written to ``folder``, which is put on
    ``sys.path`` for the duration (as the current directory of a run would be)."""
    from fastrlhf.algorithms import ADV_ESTIMATORS, POLICY_LOSSES
    from fastrlhf.rl.rewards import REWARD_FUNCTIONS

    registries = (POLICY_LOSSES, ADV_ESTIMATORS, REWARD_FUNCTIONS)
    before = [set(r) for r in registries]
    folder.mkdir(parents=True, exist_ok=True)
    saved_path = list(sys.path)
    sys.path.insert(0, str(folder))
    names = []

    def make(source: str, name: str | None = None) -> str:
        name = name or f"user_plugin_{uuid.uuid4().hex[:8]}"
        (folder / f"{name}.py").write_text(source)
        names.append(name)
        return name

    try:
        yield make
    finally:
        sys.path[:] = saved_path
        for registry, known in zip(registries, before, strict=True):
            for key in set(registry) - known:
                del registry[key]
        for name in names:
            sys.modules.pop(name, None)
