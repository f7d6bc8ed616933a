"""Shim, kept for one release: `python -m infra.work_pools gpu` goes on printing the GPU pool's template. The module
is `infra.services.work_pools`."""

import sys

from infra.services.work_pools import main

if __name__ == "__main__":
    main(sys.argv[1:])
