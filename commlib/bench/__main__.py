import sys

from commlib.bench.main import main

sys.exit(main())
