import sys

from fastrlhf.cli import main

sys.exit(main())
