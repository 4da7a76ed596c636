"""Redraw recovery.png for finished `tcal recover` output directories (e.g. results fetched from the GPU).

    python bench/plot_recovery.py bench/results/2026-11-29-recovery-73-percent [more dirs]
"""

import argparse

from tcal.recipes.recover import replot


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", help="output directories of `tcal recover` (with recovery.json)")
    for d in p.parse_args(argv).dirs:
        print("wrote", replot(d))


if __name__ == "__main__":
    main()
