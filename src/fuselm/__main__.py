import sys

from fuselm.cli import main

sys.exit(main())
