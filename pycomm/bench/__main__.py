"""``python -m pycomm.bench``: see ``python -m pycomm.bench --help`` and bench/README.md."""
import sys

if __name__ == "__main__":
    # Under the "spawn" start method each rank re-imports this module as __mp_main__;
    # the guard keeps the ranks from running the CLI themselves.
    from pycomm.bench.cli import main

    sys.exit(main())
