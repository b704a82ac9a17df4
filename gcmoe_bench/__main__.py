"""``python -m gcmoe_bench`` and ``torchrun ... -m gcmoe_bench``: the same typer app as ``gcmoe-bench``."""

from gcmoe_bench.cli import main

if __name__ == "__main__":
    main()
