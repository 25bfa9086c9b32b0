"""``python tests/helpers/flaky_kill.py STEP <fastrlhf args>``: the command, killed (SIGKILL of its own process) just
after its metrics line for STEP is written, at the same point in every run. A test that watched the metrics file
and killed the run from outside raced the run's remaining steps: on a busy machine it could see STEP only after
the run had ended."""

import os
import signal
import sys


def _kill_after(log, step: int):
    def log_then_die(self, at, metrics):
        log(self, at, metrics)
        if at >= step:
            os.kill(os.getpid(), signal.SIGKILL)

    return log_then_die


if __name__ == "__main__":
    # Not this folder first on the path: its modules (launch, paths, plugins...) would shadow any of the same name.
    del sys.path[0]
    from fastrlhf.cli import entry
    from fastrlhf.engine.metrics import MetricsLogger

    MetricsLogger.log = _kill_after(MetricsLogger.log, int(sys.argv[1]))
    sys.argv = ["fastrlhf", *sys.argv[2:]]
    entry()
