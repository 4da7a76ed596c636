"""One module per command: its config dataclass and ``run(cfg)``.

Recipes are the only code that owns output directories, prints and reports. A recipe's module
level holds its config only (no torch), so that ``tcal --help`` reads every command's flags at
once; the pipeline is imported when ``run`` starts.
"""
