"""``python -m weightstream`` is the ``weightstream`` command."""

import sys

from weightstream.cli.main import main

sys.exit(main())
