from fastrlhf.version import __version__
