"""``python -m tcal.airgap ...`` is ``tcal airgap ...`` (:mod:`tcal.recipes.airgap`)."""
import sys

from tcal.cli import main

if __name__ == "__main__":
    sys.exit(main(["airgap", *sys.argv[1:]]))
