import sys

from ec_daemon.cli import main

sys.exit(main())
