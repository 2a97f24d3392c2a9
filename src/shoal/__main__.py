import sys

from shoal.frontend.cli import main

sys.exit(main())
