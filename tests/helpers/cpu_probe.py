"""Both answers of the CPU probe (``fastrlhf.cpu.probe``) for the tests of machine-dependent code.

A test of code whose path depends on the CPU runs once with the probe's real answer for this machine
and once with the probe forced to "unavailable" (``FASTRLHF_CPU_FAST_PATHS=off``), and derives what
it expects from the answer it got, so a machine whose CPU allows every fast path still runs the path
of a CPU that allows none (an AMD EPYC whose oneDNN packs bf16 otherwise, a machine without a C
compiler). ``cpu_probe_answer`` (tests/conftest.py) is the per-test fixture; ``probe_answer`` the
context for a module-scoped fixture.
"""

from contextlib import contextmanager

import pytest

from fastrlhf.cpu.probe import FORCE_ENV, cpu_probe

ANSWERS = ("real", "forced-off")


@contextmanager
def probe_answer(answer: str):
    """Within: ``cpu_probe()`` gives ``answer`` ("real": this machine's, whatever the caller's
    environment says; "forced-off": every fast path unavailable). Yields the probe."""
    if answer not in ANSWERS:
        raise ValueError(f"answer must be one of {ANSWERS}, got {answer!r}")
    with pytest.MonkeyPatch.context() as patch:
        if answer == "forced-off":
            patch.setenv(FORCE_ENV, "off")
        else:
            patch.delenv(FORCE_ENV, raising=False)
        yield cpu_probe()


def skip_unless_packs_in_place(probe, dtype) -> None:
    """Skip, naming the probe's answer, where it allows no in-place packed ``dtype`` weight."""
    if not probe.packs_in_place(dtype):
        name = str(dtype).removeprefix("torch.")
        pytest.skip(f"the CPU probe: {name} in-place packing unavailable ({probe.unavailable.get(name)})")
