"""A logger that drops everything, for loops run in tests (``fastrlhf.engine.loop.run_steps``'s ``logger``)."""


class NullLogger:
    def log(self, step, metrics):
        pass

    def message(self, line):
        pass

    def close(self):
        pass
