"""python -m fusedist.envs --markdown: the environment table of docs/configuration.md. A module
of its own, so that running it does not re-execute the registry the package already imported."""

import sys

from . import main

sys.exit(main())
