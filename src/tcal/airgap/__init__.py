"""Staging tcal for a GPU machine without network (docs/airgap.md): what ``tcal airgap pack|stage|check`` runs
(:mod:`tcal.recipes.airgap`).

``pack`` (on a machine with network) gathers what tcal fetches on first use, for the built-in teachers asked for
(:data:`tcal.data.teacher_table.TEACHERS`): each teacher's GGUF and its tokenizer as this machine's transformers
converts it, the corpora their defaults and the GPU jobs read (and HumanEval for a code teacher), token pools built
with ``tcal pool``, and the wheels a bare GPU image lacks. Every item is cut into pieces of at most one transfer,
and the pieces are grouped into numbered folders (``.dev/carry/01``, ...) that each travel alone; each folder holds
the manifest of the whole pack (``carry.json``: every item's size, sha256, piece count and destination).

``stage`` (on the GPU machine, once per arriving folder or once for all) keeps the pieces that came, joins each item
whose pieces are all there, checks its size and sha256, and puts it where tcal looks: a GGUF (and its tokenizer, as
``<file>.tokenizer/``) in the cache's ``gguf/`` folder, the corpora in the cache (``cache_root()``: ``$TCAL_CACHE``
or ``~/.cache/tcal``), the pools under the stage folder's ``pools/``, the wheels installed into its ``site/``.
``check TEACHER`` says whether a teacher is staged.

Below the recipes: the airgap recipe is the only code that imports it.
"""
from __future__ import annotations

DEFAULT_CARRY = ".dev/carry"  # where pack writes its folders and stage reads them (git-ignored)
DEFAULT_STAGE = "/tmp/tcal-stage"  # the GPU machine's stage folder: pieces waiting for the others, pools, site
TRANSFER_MB = 52  # the largest folder one transfer may carry, in MiB
