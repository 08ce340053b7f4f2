import sys

from tests.rig.cli import main

sys.exit(main())
