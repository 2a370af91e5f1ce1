"""``python -m devmesh.tools.cli``: the ``devmesh`` command."""

import sys

from devmesh.tools.cli import main

sys.exit(main())
