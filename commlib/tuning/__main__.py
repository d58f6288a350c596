import sys

from commlib.tuning.autotune import main

sys.exit(main())
