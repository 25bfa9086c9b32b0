from fastrlhf.cli import entry

entry()
