"""``python -m tcal ...`` = ``tcal ...``; what ``torchrun --nproc_per_node N -m tcal distill ...`` runs."""
import sys

from tcal.cli import main

if __name__ == "__main__":
    sys.exit(main())
