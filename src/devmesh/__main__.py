"""``python -m devmesh ...`` is the ``devmesh`` command."""

import sys

from devmesh.tools.cli import main

sys.exit(main())
